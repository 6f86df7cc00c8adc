"""How far a reduced-precision model agrees with the FP32 one, on the user's own images, without labels.

A classifier is compared by its best class instead (`class_agreement`): the share of images where
both models name the same one, and with ``[inspect]`` the OK/NG/uncertain verdicts that flip.

The FP32 model's published boxes (at ``model.conf``) are the ground truth: the candidate's boxes are
ranked and scored against them with `edged.tools.metrics` (mAP@0.5 and mAP@0.5:0.95, as ``edged eval``
scores labels), so identical models score 1.0 (0.995 under yolo val's integration). With an
``[inspect]`` section both models' boxes are also judged OK/NG, as the daemon judges them, and the
frames whose verdict flips are named: what a line would notice. Both models run through the daemon's
own `FramePipeline` at a low threshold, so the candidate's boxes just under ``model.conf`` still rank;
since NMS only suppresses a box under a higher-scoring one, keeping those at or above a class's
threshold afterwards gives exactly the boxes the daemon publishes at that threshold.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edged.classify import Classes
from edged.config import Settings
from edged.decode import Detections
from edged.errors import UsageError
from edged.messages import Verdict
from edged.model import LoadedModel
from edged.pipeline import FramePipeline, planned
from edged.settings.inspect import InspectConfig
from edged.sources.images import IMAGE_SUFFIXES
from edged.tools.evaluate import EvalSample, ProgressBar, label_path
from edged.tools.metrics import MetricAccumulator
from edged.verdict import ClassInspector, Inspector

RANK_CONF = 0.001  # the threshold both models are loaded at here, as `edged eval` ranks


@dataclass(frozen=True, slots=True)
class Flip:
    """An image the two models judge differently, and how: an NG that turns OK is a defect let through."""

    image: str
    reference: Verdict | None
    candidate: Verdict | None

    def __str__(self) -> str:
        return f"{self.image} ({self.reference} -> {self.candidate})"

    def to_dict(self) -> dict[str, Any]:
        return {"image": self.image, "reference": self.reference, "candidate": self.candidate}


@dataclass(slots=True)
class Agreement:
    """The candidate against the reference over ``images`` frames; verdict figures None without ``[inspect]``."""

    images: int
    map50: float
    map50_95: float
    reference_boxes: int
    verdicts_agree: float | None = None
    flipped: list[Flip] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        boxes = {"map50": self.map50, "map50_95": self.map50_95, "reference_boxes": self.reference_boxes}
        return {"images": self.images, **boxes, **_verdicts(self.verdicts_agree, self.flipped)}

    def format(self) -> str:
        line = (
            f"agreement with FP32's boxes on {self.images} image(s) ({self.reference_boxes} boxes): "
            f"mAP@0.5 {self.map50:.3f}, mAP@0.5:0.95 {self.map50_95:.3f}"
        )
        return line + _said(self.verdicts_agree, self.flipped)


class _Judge:
    """One model's frames at one size, and its verdicts under ``[inspect]``."""

    def __init__(self, model: LoadedModel, inspect: InspectConfig | None, conf: float) -> None:
        if model.task != "detect" and model.task != "segment":
            raise UsageError(f"agreement compares boxes; this model is a {model.task} model")
        self.model = model
        self.plan: FramePipeline | None = None
        names = model.labels or [str(i) for i in range(model.num_classes)]
        masks = model.task == "segment"
        max_det = model.cfg.max_det
        self.inspector = Inspector(inspect, names, model.num_classes, conf, max_det, masks=masks) if inspect else None
        self.thresholds = np.array(self.inspector.thresholds if self.inspector else [conf] * model.num_classes)

    def __call__(self, image: np.ndarray) -> tuple[Detections, Detections, Verdict | None]:
        """(every box down to RANK_CONF, the boxes published at the thresholds, the verdict or None)."""
        h, w = image.shape[:2]
        self.plan = planned(self.plan, self.model, image)
        found, _ = self.plan.process(image)
        assert isinstance(found, Detections)  # checked in __init__: a detection or segmentation model
        ranked = Detections(found.xyxy.copy(), found.scores.copy(), found.class_ids.copy())
        keep = ranked.scores >= self.thresholds[ranked.class_ids]
        shown = Detections(ranked.xyxy[keep], ranked.scores[keep], ranked.class_ids[keep])
        verdict = self.inspector(shown, w, h).verdict if self.inspector else None
        return ranked, shown, verdict


def agreement(
    reference: LoadedModel,
    candidate: LoadedModel,
    samples: Iterator[EvalSample],
    *,
    inspect: InspectConfig | None = None,
    conf: float = 0.25,
    progress: ProgressBar | None = None,
) -> Agreement:
    """Score ``candidate`` against ``reference``'s published boxes (at ``conf``, or ``[inspect]``'s
    per-class thresholds) on each sample, and compare their verdicts when ``inspect`` is given. Both
    models should be loaded at `RANK_CONF` so that what ranks below ``conf`` is there to rank."""
    judges = _Judge(reference, inspect, conf), _Judge(candidate, inspect, conf)
    names = reference.labels or [str(i) for i in range(reference.num_classes)]
    acc = MetricAccumulator(names)
    agree = boxes = found = images = 0
    flipped: list[Flip] = []
    for images, sample in enumerate(samples, 1):
        _, truth, expected = judges[0](sample.image)
        ranked, shown, verdict = judges[1](sample.image)
        boxes, found = boxes + len(truth), found + len(shown)
        acc.add(
            ranked.xyxy,
            ranked.scores,
            ranked.class_ids,
            truth.xyxy,
            truth.class_ids,
            published=(shown.xyxy, shown.scores, shown.class_ids),
        )
        if verdict == expected:
            agree += 1
        else:
            flipped.append(Flip(sample.name, expected, verdict))
        if progress:
            progress.update(images)
    if images == 0:
        raise UsageError("no images to compare the models on")
    report = acc.report(conf=conf)
    verdicts = agree / images if inspect else None
    if boxes == 0:  # nothing to find: agreement is finding nothing too
        score = 1.0 if found == 0 else 0.0
        return Agreement(images, score, score, boxes, verdicts, flipped)
    return Agreement(images, report.map50, report.map50_95, boxes, verdicts, flipped)


@dataclass(slots=True)
class ClassAgreement:
    """A classifier against the reference over ``images`` frames; verdict figures None without ``[inspect]``."""

    images: int
    top1_agree: float
    changed: list[str]  # the images whose best class differs
    verdicts_agree: float | None = None
    flipped: list[Flip] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        top1 = {"top1_agree": self.top1_agree, "top1_changed": self.changed}
        return {"images": self.images, **top1, **_verdicts(self.verdicts_agree, self.flipped)}

    def format(self) -> str:
        line = f"agreement with FP32's best class on {self.images} image(s): {100 * self.top1_agree:.1f} %"
        return line + _named(self.changed, "changed") + _said(self.verdicts_agree, self.flipped)


def _verdicts(agree: float | None, flipped: list[Flip]) -> dict[str, Any]:
    return {"verdicts_agree": agree, "verdicts_flipped": [f.image for f in flipped], "flips": [f.to_dict() for f in flipped]}


def _said(agree: float | None, flipped: list[Flip]) -> str:
    """The verdict figures, as the reports print them; nothing without ``[inspect]``."""
    return (
        ""
        if agree is None
        else f"; OK/NG verdicts agree on {100 * agree:.1f} %" + _named(list(map(str, flipped)), "flipped")
    )


def _named(images: list[str], what: str) -> str:
    return f", {what} on: {', '.join(images[:5])}" + (" ..." if len(images) > 5 else "") if images else ""


def class_agreement(
    reference: LoadedModel,
    candidate: LoadedModel,
    samples: Iterator[EvalSample],
    *,
    inspect: InspectConfig | None = None,
    conf: float = 0.25,
    progress: ProgressBar | None = None,
) -> ClassAgreement:
    """Whether ``candidate`` names ``reference``'s best class on each sample, and, with ``inspect``,
    gives the same verdict as the daemon judges a classifier (thresholds from ``conf``)."""
    models = (reference, candidate)
    plans: list[FramePipeline | None] = [None, None]
    inspectors = [ClassInspector(inspect, m.labels, m.num_classes, conf) for m in models] if inspect is not None else None
    same = agree = images = 0
    changed: list[str] = []
    flipped: list[Flip] = []
    for images, sample in enumerate(samples, 1):
        tops, verdicts = [], []
        for i, model in enumerate(models):
            plan = plans[i] = planned(plans[i], model, sample.image)
            found, _ = plan.process(sample.image)
            assert isinstance(found, Classes)  # checked by the caller: a classification model
            tops.append(found.top[0] if found.top is not None else None)
            verdicts.append(inspectors[i](found).verdict if inspectors is not None else None)
        if tops[0] == tops[1]:
            same += 1
        else:
            changed.append(sample.name)
        if verdicts[0] == verdicts[1]:
            agree += 1
        else:
            flipped.append(Flip(sample.name, verdicts[0], verdicts[1]))
        if progress:
            progress.update(images)
    if images == 0:
        raise UsageError("no images to compare the models on")
    return ClassAgreement(images, same / images, changed, agree / images if inspect else None, flipped)


def check_inspection(model: LoadedModel, inspect: InspectConfig | None, conf: float) -> None:
    """Refuse now (`ConfigError`) an inspection that names a class ``model`` lacks: found when the
    verdicts are compared, it would come after minutes of quantising."""
    if inspect is None:
        return
    if model.task == "classify":
        ClassInspector(inspect, model.labels, model.num_classes, conf)
    elif model.task in ("detect", "segment"):
        _Judge(model, inspect, conf)


def camera_inspection(settings: Settings, camera_id: str | None) -> InspectConfig | None:
    """What camera ``camera_id`` (the first without one) judges its frames with, as the daemon does
    (`Settings.inspection`: its [source.inspect] keys, such as ``mm_per_px``, over [inspect])."""
    cameras = {cfg.camera_id: cfg for cfg in settings.source}
    if camera_id is None:
        return settings.inspection(settings.source[0])
    if camera_id not in cameras:
        raise UsageError(f"--camera {camera_id!r}: the configuration's cameras are {', '.join(cameras)}")
    return settings.inspection(cameras[camera_id])


def labelled(folder: Path) -> bool:
    """Whether any image under ``folder`` has a YOLO label file (`edged.tools.evaluate.label_path`)."""
    return any(label_path(p).is_file() for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
