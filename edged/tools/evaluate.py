"""``edged eval``: a model's accuracy measured through the daemon's own pipeline.

Frames go through exactly what `edged run` does to them (`FramePipeline`: the same letterbox,
the same contract, the same decoder and NMS), so the figures describe the deployed boxes. They
are ranked and scored as ``yolo val`` ranks and scores them (its defaults conf 0.001, NMS IoU
0.7, 300 detections, and every class of a box above conf, not only its best), so that a user can
hold them against the figures ultralytics gave for the same model and data; ``--coco`` scores the
same predictions as pycocotools does (`edged.tools.metrics` has both conventions). Precision and
recall count the boxes the daemon publishes. Data is either a folder of images with YOLO-format
label files (what ultralytics and Roboflow export) or generated inspection scenes with their
ground truth.

A segmentation model's masks are scored too, on labels with outlines, as ``yolo val`` scores them
(`_with_masks`, `truth_masks`): the same predictions and matching, by the IoU of masks at the
prototypes' size.

A classification model is scored as ``yolo val`` scores one, top-1 and top-5 accuracy (the share of
images whose class is the best, or among the five best), on an ultralytics classification folder:
one folder per class, named as the model names it, under ``--data`` or its ``val/``.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

import cv2
import numpy as np
from pydantic import ValidationError

from edged.classify import Classes
from edged.config import ModelConfig, RuntimeConfig
from edged.decode import Decoder, Detections
from edged.errors import DataError, ImageError, UsageError
from edged.files import FileTooLarge, NotRegularFile, read_regular, refuse_overwriting, write_whole
from edged.geometry import BoxMap
from edged.heads.base import rows
from edged.heads.registry import head_named
from edged.heads.segment import MASK_COEFFICIENTS, SegmentHead
from edged.model import LoadedModel, load_model
from edged.pipeline import FramePipeline, planned
from edged.segment import Segmenter
from edged.settings.sources import MAX_HEIGHT, MAX_WIDTH, MIN_SIDE
from edged.sources.images import IMAGE_SUFFIXES, is_image_file, read_image
from edged.sources.scenes import CLASS_NAMES, SceneGenerator
from edged.tools.calibrate import PixelAuroc, auroc, best_f1, decoded, f1_at, images_in, score_images
from edged.tools.metrics import Convention, EvalReport, MetricAccumulator, Predictions, require_pycocotools

log = logging.getLogger(__name__)

MAX_LABEL_BYTES = 16 << 20  # a box is a line of some 40 bytes, an outline of 1000 points some 18 KB
# Objects one label file may hold: each is matched against every prediction (300 by default), some
# 20 KB of IoU a box and 250 KB a segmentation mask; the 570,000 boxes 16 MiB holds took 11 GB.
# Densely labelled sets (shelves, crowds, aerial views) hold at most some thousands an image.
MAX_LABEL_OBJECTS = 5000


@dataclass(frozen=True, slots=True)
class EvalSample:
    name: str
    image: np.ndarray  # (H, W, 3) uint8 BGR
    boxes: np.ndarray  # (M, 4) float32 x1 y1 x2 y2 in pixels
    class_ids: np.ndarray  # (M,) int64
    outlines: tuple[np.ndarray, ...] = ()  # (p, 2) float32 in pixels per object, where the labels have them


def label_path(image: Path) -> Path:
    """YOLO convention: .../images/x.jpg -> .../labels/x.txt, else x.txt beside the image."""
    parts = list(image.parts)
    if "images" in parts:
        i = len(parts) - 1 - parts[::-1].index("images")
        candidate = Path(*parts[:i], "labels", *parts[i + 1 :]).with_suffix(".txt")
        if os.path.lexists(candidate):  # a folder or a link to nothing too: `read_yolo_outlines` refuses it
            return candidate
    return image.with_suffix(".txt")


def read_yolo_labels(path: Path, width: int, height: int, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``class cx cy w h``, or ``class x1 y1 x2 y2 ...`` (an outline), normalised to 0..1 (as
    ultralytics, a box outside, or NaN, is refused: it would score silently wrong; a row repeated is
    kept once, with a warning); a missing file is an image without objects. An outline's box is its
    extent, as ultralytics takes it."""
    boxes, classes, _ = read_yolo_outlines(path, width, height, num_classes)
    return boxes, classes


def check_labels(folder: Path, num_classes: int) -> None:
    """Read every label file of the images under ``folder``, so that a bad one (`DataError`) is said
    before the work that needs them, not after it."""
    for image in image_files(folder):
        read_yolo_outlines(label_path(image), 1, 1, num_classes, warn=False)


def read_yolo_outlines(
    path: Path, width: int, height: int, num_classes: int, *, warn: bool = True
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
    """`read_yolo_labels` and each object's outline, (p, 2) float32 in pixels (a box row's, its corners);
    ``warn``: log the duplicate rows it drops. Only a name that is not there is an image without
    objects: a link to nothing (a DVC or git-annex label never fetched) or a pipe was read as one."""
    if path.is_dir():
        raise DataError(f"{path} is a folder, not a label file: move it away or replace it with the image's labels")
    if not os.path.lexists(path):
        return np.zeros((0, 4), np.float32), np.zeros(0, np.int64), ()
    boxes, classes, outlines = [], [], []
    seen: set[tuple[float, ...]] = set()
    dropped = 0
    for number, line in enumerate(_label_lines(path), 1):
        fields = line.split()
        if not fields:
            continue
        try:
            as_float = float(fields[0])  # as ultralytics reads it: "1.0" is class 1
            if not as_float.is_integer():
                raise ValueError(fields[0])
            c = int(as_float)
        except ValueError:
            raise DataError(
                f"{path}:{number}: the class {_excerpt(fields[0])} is no whole number from 0 to {num_classes - 1} "
                "(the first field of a YOLO label)"
            ) from None
        try:
            values = [float(v) for v in fields[1:]]
        except ValueError:
            values = []
        if len(values) == 4:
            box = cx, cy, w, h = values
            values = [cx - w / 2, cy - h / 2, cx + w / 2, cy - h / 2, cx + w / 2, cy + h / 2, cx - w / 2, cy + h / 2]
        elif len(values) < 6 or len(values) % 2:
            raise DataError(
                f"{path}:{number}: expected 'class cx cy w h' or 'class x1 y1 x2 y2 x3 y3 ...', got {_excerpt(line)}"
            )
        else:  # an outline: its box is checked, as ultralytics checks it; a point may stray a hair outside
            xs, ys = values[0::2], values[1::2]
            box = [(min(xs) + max(xs)) / 2, (min(ys) + max(ys)) / 2, max(xs) - min(xs), max(ys) - min(ys)]
        if not (all(math.isfinite(v) for v in values) and all(0.0 <= v <= 1.0 for v in box)):
            raise DataError(
                f"{path}:{number}: coordinates are fractions of the image's width and height, from 0 to 1 "
                f"(YOLO format), got {_excerpt(line)}"
            )
        if not 0 <= c < num_classes:  # named as written: "1e300" as an int has 301 digits, and a long one is rounded
            written = fields[0] if len(fields[0]) <= 20 else _excerpt(fields[0], 20)
            raise DataError(f"{path}:{number}: class {written} but the model has {num_classes} classes")
        if (c, *box) in seen:  # yolo val keeps one row per class and box
            dropped += 1
            continue
        if len(seen) == MAX_LABEL_OBJECTS:
            raise DataError(
                f"{path}:{number}: more than {MAX_LABEL_OBJECTS} objects in one image's labels, more than edged "
                "scores at once (each is matched against every prediction): is it the right file?"
            )
        seen.add((c, *box))
        outline = np.asarray(values, np.float32).reshape(-1, 2) * np.array((width, height), np.float32)
        boxes.append((*outline.min(axis=0), *outline.max(axis=0)))
        classes.append(c)
        outlines.append(outline)
    if dropped and warn:
        log.warning("%s: %d duplicate label(s) removed, as yolo val removes them", path, dropped)
    return np.asarray(boxes, np.float32).reshape(-1, 4), np.asarray(classes, np.int64), tuple(outlines)


def _excerpt(text: str, limit: int = 80) -> str:
    """``text`` quoted for an error message, cut short: a label line may be megabytes long."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _label_lines(path: Path) -> list[str]:
    """The lines of label file `path`; `DataError` naming it where it is no UTF-8 text, cannot be
    read, is a link to nothing or no regular file (a pipe would be waited on), or is larger than
    `MAX_LABEL_BYTES` (read whole, it would take ten times that)."""
    try:
        return read_regular(path, MAX_LABEL_BYTES).decode("utf-8-sig").splitlines()  # Windows editors write a BOM
    except FileTooLarge as e:
        raise DataError(
            f"{path} holds {e.size / 1e6:.1f} MB, more than a label file of any image "
            f"({MAX_LABEL_BYTES >> 20} MiB): is it the right file?"
        ) from None
    except NotRegularFile:
        raise DataError(f"{path}: not a regular file (a pipe or a device): replace it with the image's labels") from None
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}: not UTF-8 text (byte {e.start}); a YOLO label file holds lines 'class cx cy w h', "
            "save it as UTF-8 or remove it"
        ) from None
    except OSError as e:
        nothing = e.errno == errno.ENOENT and path.is_symlink()
        why = "a link to nothing: fetch its content" if nothing else e.strerror
        raise DataError(f"{path}: cannot read the label file: {why}") from None


def _run_eval_classes(args: argparse.Namespace, model: LoadedModel, out: TextIO) -> int:
    """``edged eval`` of a classification model: top-1 and top-5 accuracy on a classification folder."""
    if args.data is None:
        raise UsageError("a classification model is evaluated on --data, a folder per class: scenes have no classes")
    samples = class_samples(args.data, model.class_names)
    report = evaluate_classes(model, samples, ProgressBar(len(samples)))
    print(report.format(), file=out)
    if args.json is not None:
        document = {
            "model": str(args.model),
            "model_sha256": model.engine.identity.sha256,
            "data": str(args.data),
            "top1": report.top1,
            "top5": report.top5,
            "images": report.images,
        }
        write_whole(args.json, json.dumps(document, indent=2) + "\n")
    return 0


def image_files(folder: Path) -> list[Path]:
    """The images under ``folder``, sorted; `DataError` where there is none, or it is no folder (a
    file or a glob, which the shell left unexpanded: said as such, not as a folder without images)."""
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        glob = " (a glob is not expanded)" if any(c in str(folder) for c in "*?[") else ""
        raise DataError(f"{folder} {what}: give the folder that holds the images{glob}")
    images = sorted(p for p in folder.rglob("*") if is_image_file(p))
    if not images:
        raise DataError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {folder}")
    return images


def check_labelled(folder: Path, images: Sequence[Path]) -> None:
    """`DataError` when none of ``images`` under ``folder`` has a label file (`label_path`): scored
    against no label, every class would read 0 as if the model had found nothing."""
    if not any(os.path.lexists(label_path(image)) for image in images):  # a link to nothing is said when read
        raise DataError(
            f"none of the {len(images)} image(s) under {folder} has a YOLO label file (images/NAME.jpg's "
            "labels/NAME.txt, else NAME.txt beside it): eval scores a model against its labels"
        )


def folder_samples(folder: Path, num_classes: int | None) -> tuple[int, Iterator[EvalSample]]:
    """The images under ``folder`` with their labels, for a model of ``num_classes``; None reads no
    label (calibration takes the pixels only, and a label it would refuse must not stop it)."""
    images = image_files(folder)
    unlabelled = np.zeros((0, 4), np.float32), np.zeros(0, np.int64), ()

    def generate() -> Iterator[EvalSample]:
        for path in images:
            image = decoded(path)
            found = (
                unlabelled
                if num_classes is None
                else read_yolo_outlines(label_path(path), image.shape[1], image.shape[0], num_classes)
            )
            yield EvalSample(str(path.relative_to(folder)), image, *found)

    return len(images), generate()


def check_scene_classes(model: LoadedModel, instead: str) -> None:
    """`UsageError` saying what to do ``instead`` when ``model``'s classes are not the generated
    scenes' (scratch, spot, crack as class 0, 1, 2): scored on them, any model would seem to lose
    nothing, since it finds nothing of its own classes there."""
    names = tuple(model.labels[: len(CLASS_NAMES)])
    if model.num_classes < len(CLASS_NAMES) or (names and names != CLASS_NAMES):
        theirs = ", ".join(names) if names else f"{model.num_classes} unnamed"
        raise UsageError(
            f"the generated scenes hold {', '.join(CLASS_NAMES)} as classes 0-{len(CLASS_NAMES) - 1}, and the "
            f"model's classes are {theirs}: scores on them would say nothing; {instead}"
        )


def scene_samples(
    count: int, seed: int, width: int, height: int, *, outlines: bool = False
) -> tuple[int, Iterator[EvalSample]]:
    """Generated scenes with their boxes and, with ``outlines`` (for scoring masks), each defect's
    painted outline; without, no mask is rendered or traced."""
    generator = SceneGenerator(width, height, seed=seed)

    def generate() -> Iterator[EvalSample]:
        for index in range(count):
            scene = generator.render(index, masks=outlines)
            traced = tuple(_outline(mask) for mask in scene.masks) if scene.masks is not None else ()
            yield EvalSample(f"scene {seed}:{index}", scene.image, scene.boxes, scene.class_ids.astype(np.int64), traced)

    return count, generate()


def _outline(mask: np.ndarray) -> np.ndarray:
    """A scene defect's mask as one outline, (p, 2) float32: its longest outer contour (a defect is
    one painted stroke or blob; stray anti-aliased specks are left out, as a labeller would)."""
    contours, _ = cv2.findContours(mask.astype(np.uint8), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
    longest = max(contours, key=len)
    return longest.reshape(-1, 2).astype(np.float32)


class ProgressBar:
    """A one-line progress bar on a terminal; a line per tenth elsewhere (journals, CI logs)."""

    def __init__(self, total: int, out: TextIO = sys.stderr) -> None:
        self.total, self.out, self.started = total, out, time.monotonic()
        self._tty = out.isatty()
        self._last_tenth = -1

    def update(self, done: int) -> None:
        elapsed = time.monotonic() - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        if self._tty:
            filled = int(30 * done / self.total)
            self.out.write(f"\r[{'#' * filled}{' ' * (30 - filled)}] {done}/{self.total} {rate:.1f} img/s")
            if done == self.total:
                self.out.write("\n")
        elif done * 10 // self.total != self._last_tenth:
            self._last_tenth = done * 10 // self.total
            self.out.write(f"{done}/{self.total} images, {rate:.1f} img/s\n")
        self.out.flush()


def evaluate(
    model: LoadedModel,
    samples: Iterator[EvalSample],
    total: int,
    report_conf: float,
    progress: ProgressBar | None = None,
    convention: Convention = "ultralytics",
) -> EvalReport:
    """Run every sample through the daemon's pipeline and score the detections under `convention`."""
    names = model.labels or [str(i) for i in range(model.num_classes)]
    acc = MetricAccumulator(names)
    mask_acc = MetricAccumulator(names) if model.task == "segment" else None
    plan: FramePipeline | None = None
    for done, sample in enumerate(samples, 1):
        plan = planned(plan, model, sample.image)
        detections, _ = plan.process(sample.image)
        assert isinstance(detections, Detections)  # run_eval scores classifiers and anomaly models apart
        published = (detections.xyxy.copy(), detections.scores.copy(), detections.class_ids.copy())
        xyxy, scores, classes = _every_class(plan) or published
        acc.add(xyxy, scores, classes, sample.boxes, sample.class_ids, published=published)
        if mask_acc is not None:
            outlines = sample.outlines or tuple(_corners(box) for box in sample.boxes)
            truth = truth_masks(outlines, plan.box_map, plan.binding.outputs[1].shape[2:])
            (ranked, ranked_masks), (shown, shown_masks) = _with_masks(plan)
            mask_acc.add(
                *ranked, sample.boxes, sample.class_ids, shown, (ranked_masks, truth), published_masks=(shown_masks, truth)
            )
        if progress:
            progress.update(done)
    report = acc.report(conf=report_conf, convention=convention)
    if mask_acc is None:
        return report
    return replace(report, mask=mask_acc.report(conf=report_conf))


@dataclass(frozen=True, slots=True)
class ClassReport:
    """Top-1 and top-5 accuracy, as fractions, over ``images`` images."""

    top1: float
    top5: float
    images: int

    def format(self) -> str:
        return f"top1_acc {self.top1:.4f}  top5_acc {self.top5:.4f}  ({self.images} images)"


def class_samples(folder: Path, class_names: tuple[str, ...]) -> list[tuple[Path, int]]:
    """The images of an ultralytics classification folder (``folder/val`` when there is one, as yolo
    val reads it), each with the class id its folder names, subfolders included (as torchvision's
    ImageFolder, which yolo val reads it with); `DataError` for a folder no class has."""
    root = folder / "val" if (folder / "val").is_dir() else folder
    ids = {name: i for i, name in enumerate(class_names)}
    samples = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        if sub.name not in ids:
            raise DataError(f"{sub}: no class of the model is named {sub.name!r} (its classes: {', '.join(class_names)})")
        images = sorted(p for p in sub.rglob("*") if is_image_file(p))
        samples += [(image, ids[sub.name]) for image in images]
    if not samples:
        raise DataError(f"no images in class folders under {root} (a classification folder has one folder per class)")
    return samples


def evaluate_classes(
    model: LoadedModel, samples: list[tuple[Path, int]], progress: ProgressBar | None = None
) -> ClassReport:
    """Run every image through the daemon's pipeline; the share whose class is the best, and among the five best."""
    plan: FramePipeline | None = None
    top1 = top5 = 0
    for done, (path, class_id) in enumerate(samples, 1):
        image = decoded(path)
        plan = planned(plan, model, image)
        classes, _ = plan.process(image)
        assert isinstance(classes, Classes)  # a classifier's pipeline
        best = classes.class_ids.tolist()[:5]
        top1 += bool(best) and best[0] == class_id
        top5 += class_id in best
        if progress:
            progress.update(done)
    return ClassReport(top1 / len(samples), top5 / len(samples), len(samples))


def _every_class(plan: FramePipeline) -> Predictions | None:
    """yolo val's predictions for the frame `plan` last processed; None where they are the published ones.

    ``yolo val`` keeps every class of a candidate box whose score is above conf (ultralytics'
    multi-label NMS), where the daemon keeps its best class only; a box two classes claim is
    ranked under both. The daemon's own decoder, run once per class on a copy of the output with
    every other class's scores zeroed, gives exactly those: NMS is per class anyway, and the best
    ``max_det`` over all classes are kept. (yolo val also stops at its 30,000 best candidates
    before NMS; edged does not, which can only matter where more than that score above conf.)
    """
    if not isinstance(plan.decoder, Decoder):
        return None
    masked = np.empty_like(plan.output)
    scores = head_named(plan.model.head).class_scores(masked)  # a view: zeroing it edits `masked`
    if scores is None or plan.model.num_classes == 1:
        return None
    parts = []
    for c in range(plan.model.num_classes):
        np.copyto(masked, plan.output)
        scores[:c] = 0.0
        scores[c + 1 :] = 0.0
        found = plan.decoder.decode(masked, plan.box_map)
        assert isinstance(found, Detections)  # a classifier's decoder has no class scores to mask: returned above
        parts.append((found.xyxy.copy(), found.scores.copy(), found.class_ids.copy()))
    xyxy, scores, classes = (np.concatenate([part[i] for part in parts]) for i in range(3))
    best = np.argsort(-scores, kind="stable")[: plan.model.cfg.max_det]
    return xyxy[best], scores[best], classes[best]


def _with_masks(plan: FramePipeline) -> tuple[tuple[Predictions, np.ndarray], tuple[Predictions, np.ndarray]]:
    """A segmentation model's predictions for the frame `plan` last processed with their masks as
    ``yolo val`` makes them: yolo val's (as `_every_class`), then the daemon's, each with (N, h*w)
    masks at the prototypes' size (ultralytics' ``process_mask``: coefficients times prototypes
    above 0, cropped to the box scaled to that size). The daemon's are taken before it drops those
    whose mask is empty at the input size: yolo val keeps them, with an empty mask."""
    segmenter = plan.decoder
    assert isinstance(segmenter, Segmenter)  # a segmentation model's pipeline
    detector, model = segmenter.detector, plan.model
    head = detector.head
    assert isinstance(head, SegmentHead)  # a Segmenter refuses any other
    nc = model.num_classes
    prototypes = plan.binding.outputs[1][0]
    _, mh, mw = prototypes.shape
    protos = prototypes.reshape(MASK_COEFFICIENTS, mh * mw)
    to_protos = np.array([mw / plan.box_map.input_w, mh / plan.box_map.input_h] * 2, np.float32)
    columns_x, rows_y = np.arange(mw, dtype=np.float32), np.arange(mh, dtype=np.float32)

    def found(output: np.ndarray) -> tuple[Predictions, np.ndarray]:
        det = detector.decode(output, plan.box_map)
        slots = detector.kept()[: len(det)]
        columns = head.selected[slots]
        boxes = rows(head.boxes, 4, head.selected.shape[0])[:, slots].T * to_protos  # x1 y1 x2 y2 in the prototypes
        coefficients = plan.output[0, 4 + nc : 4 + nc + MASK_COEFFICIENTS][:, columns]
        masks = (coefficients.T @ protos).reshape(-1, mh, mw) > 0
        masks &= ((columns_x >= boxes[:, 0:1]) & (columns_x < boxes[:, 2:3]))[:, None, :]
        masks &= ((rows_y >= boxes[:, 1:2]) & (rows_y < boxes[:, 3:4]))[:, :, None]
        return (det.xyxy.copy(), det.scores.copy(), det.class_ids.copy()), masks.reshape(len(det), mh * mw)

    shown = found(plan.output)
    if nc == 1:
        return shown, shown
    masked = np.empty_like(plan.output)
    scores = head.class_scores(masked)  # a view: zeroing it edits `masked`
    assert scores is not None  # a segment head has class scores
    parts = []
    for c in range(nc):
        np.copyto(masked, plan.output)
        scores[:c] = 0.0
        scores[c + 1 :] = 0.0
        parts.append(found(masked))
    xyxy, confs, classes = (np.concatenate([part[0][i] for part in parts]) for i in range(3))
    masks = np.concatenate([part[1] for part in parts])
    best = np.argsort(-confs, kind="stable")[: model.cfg.max_det]
    return ((xyxy[best], confs[best], classes[best]), masks[best]), shown


def truth_masks(outlines: Sequence[np.ndarray], m: BoxMap, size: tuple[int, ...]) -> np.ndarray:
    """The ground truth's masks as ``yolo val`` makes them, (M, h*w) bool at the prototypes' `size`:
    each outline in the input (resampled to 1000 points, as its dataset does), filled at the input
    size on whole pixels, resized to `size`; where outlines overlap, the smaller one's (ultralytics'
    ``polygons2masks_overlap`` and ``overlap_mask``)."""
    mh, mw = size
    painted = []
    for outline in outlines:
        points = _resampled(
            outline * np.array((m.scale_x, m.scale_y), np.float32) + np.array((m.pad_x, m.pad_y), np.float32)
        )
        filled = np.zeros((m.input_h, m.input_w), np.uint8)
        cv2.fillPoly(filled, [points.astype(np.int32)], color=1)
        painted.append(cv2.resize(filled, (mw, mh)))
    if not painted:
        return np.zeros((0, mh * mw), np.bool_)
    areas = np.array([int(p.sum()) for p in painted])
    order = np.argsort(-areas)  # the largest drawn first, the smallest on top
    overlap = np.zeros((mh, mw), np.int32)
    for rank, i in enumerate(order, 1):
        np.maximum(overlap, painted[i].astype(np.int32) * rank, out=overlap)
    ranks = np.empty(len(order), np.int32)
    ranks[order] = np.arange(1, len(order) + 1)
    masks: np.ndarray = overlap.reshape(1, -1) == ranks[:, None]
    return masks


def _corners(box: np.ndarray) -> np.ndarray:
    """A box as the outline of its rectangle, (4, 2) float32."""
    x1, y1, x2, y2 = box.tolist()
    return np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]], np.float32)


def _resampled(outline: np.ndarray, n: int = 1000) -> np.ndarray:
    """A closed outline resampled to `n` points along its sides, keeping its corners (ultralytics' ``resample_segments``)."""
    if len(outline) == n:
        return outline
    closed = np.concatenate((outline, outline[:1]))
    x = np.linspace(0, len(closed) - 1, n - len(closed) if len(closed) < n else n)
    xp = np.arange(len(closed))
    if len(closed) < n:
        x = np.insert(x, np.searchsorted(x, xp), xp)
    return np.stack([np.interp(x, xp, closed[:, i]) for i in range(2)], axis=1).astype(np.float32)


_CONVENTION_NOTES: dict[Convention, str] = {
    "ultralytics": "AP as yolo val: its predictions, 101-point precision envelope integrated by the trapezoid rule",
    "coco": "AP as pycocotools' COCOeval on yolo val's predictions: 101-point precision envelope averaged, "
    "at most 100 per class and image",
}


def format_report(report: EvalReport) -> str:
    """The box table and, for a segmentation model, the mask table beneath it."""
    lines = _table(report, "boxes")
    if report.mask is not None:
        lines += ["", "Mask", *_table(report.mask, "masks")]
        lines.append("(mask AP as yolo val: masks at the prototypes' size, a quarter of the input's)")
    return "\n".join(lines)


def _table(report: EvalReport, what: str) -> list[str]:
    lines = [f"{'class':<16}{'images':>8}{'labels':>8}{'P':>8}{'R':>8}{'mAP50':>8}{'mAP50-95':>10}"]
    lines.append(
        f"{'all':<16}{report.n_images:>8}{sum(c.n_gt for c in report.per_class):>8}"
        f"{report.precision:>8.3f}{report.recall:>8.3f}{report.map50:>8.3f}{report.map50_95:>10.3f}"
    )
    for c in report.per_class:
        lines.append(f"{c.name:<16}{'':>8}{c.n_gt:>8}{c.precision:>8.3f}{c.recall:>8.3f}{c.ap50:>8.3f}{c.ap50_95:>10.3f}")
    lines.append(f"({_CONVENTION_NOTES[report.convention]})")
    lines.append(
        f"(precision and recall: the {what} the daemon publishes at conf {report.report_conf:g}, matched at IoU 0.5)"
    )
    return lines


def _option_problem(loc: tuple[int | str, ...], message: str) -> str:
    """A `ModelConfig` problem named by the ``edged eval`` option that set the field."""
    if not loc:
        return message
    field = str(loc[0])
    return f"--{'model' if field == 'path' else field.replace('_', '-')}: {message}"


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--size must be WIDTHxHEIGHT, e.g. 1280x720; got {text!r}") from None
    if not (MIN_SIDE <= width <= MAX_WIDTH and MIN_SIDE <= height <= MAX_HEIGHT):  # a synthetic camera's frames
        raise UsageError(f"--size must be from {MIN_SIDE}x{MIN_SIDE} to {MAX_WIDTH}x{MAX_HEIGHT}; got {text}")
    return width, height


def _masks_by_stem(masks: Path) -> dict[str, Path]:
    """The files in ``masks`` by name without suffix, the first by name where several share one: read once,
    not once for each bad image (tens of thousands of them)."""
    return {p.stem: p for p in sorted(masks.iterdir(), reverse=True)} if masks.is_dir() else {}


def _truth_kept(masks: Path, found: Mapping[str, Path], bad_images: Sequence[Path]) -> bool:
    """Whether the bad images have their defects marked, for a pixel AUROC: each has a mask in
    ``masks`` (``found``) by its name (non-zero on the defect) or YOLO polygons in its label file
    (`label_path`, as edged's evidence writes an anomaly's regions). Said before any image is scored:
    False when none has either, `DataError` naming those without when only some have."""
    missing = [p.name for p in bad_images if p.stem not in found and not os.path.lexists(label_path(p))]
    if len(missing) == len(bad_images):
        return False
    if missing:
        raise DataError(_no_mask(masks, missing))
    return True


def _no_mask(masks: Path, names: Sequence[str]) -> str:
    where = f"a PNG of the same name in {masks}, or YOLO polygons in a label file beside the image"
    return f"no readable mask for {', '.join(names)} ({where})"


def _defect(masks: Path, mask_path: Path | None, image: Path, size: tuple[int, ...]) -> np.ndarray:
    """The defect pixels of bad ``image`` at ``size`` (h, w), from its mask (``mask_path``, in ``masks``)
    or its YOLO polygons."""
    h, w = size
    if mask_path is not None:
        try:
            mask = read_image(mask_path, cv2.IMREAD_GRAYSCALE | cv2.IMREAD_ANYDEPTH)  # 16-bit ids of 1 are marks
        except ImageError as e:
            raise DataError(f"{mask_path} is no readable mask for {image.name} ({e.why})") from e
        return cv2.resize(mask, (w, h), interpolation=cv2.INTER_NEAREST) > 0
    labels = label_path(image)
    if not os.path.lexists(labels):  # gone since `_truth_kept` saw it
        raise DataError(_no_mask(masks, [image.name]))
    _, _, outlines = read_yolo_outlines(labels, w, h, 1)  # an anomaly's regions are class 0, as evidence writes them
    drawn = np.zeros((h, w), np.uint8)
    if outlines:
        cv2.fillPoly(drawn, [np.round(o).astype(np.int32) for o in outlines], 1)
    return drawn > 0


def evaluate_anomaly(model: LoadedModel, data: Path | None, json_path: Path | None, out: TextIO) -> int:
    """An anomaly model over ``data``/good and ``data``/bad (images of good and bad parts): the image
    AUROC, and the F1 and misses at the export's threshold (0.5), through the daemon's pipeline."""
    if data is None:
        raise UsageError("an anomaly model is evaluated on --data DIR holding good/ and bad/ folders of images")
    bad_images, masks = images_in(data / "bad"), data / "masks"
    found = _masks_by_stem(masks)
    pixels = PixelAuroc() if _truth_kept(masks, found, bad_images) else None

    def bad_map(index: int, values: np.ndarray) -> None:
        assert pixels is not None
        image = bad_images[index]
        pixels.add(values, _defect(masks, found.get(image.stem), image, values.shape))

    good = score_images(model, images_in(data / "good"), pixels.good if pixels else None)
    bad = score_images(model, bad_images, bad_map if pixels else None)
    threshold, best = best_f1(good, bad)
    pixel = pixels.value() if pixels is not None else None
    if pixels is not None and pixel is None:
        raise DataError(f"the masks and labels of the bad images in {data} mark no defect pixel")
    document = {
        "model": str(model.cfg.path),
        "model_sha256": model.engine.identity.sha256,
        "data": str(data),
        "good": int(good.size),
        "bad": int(bad.size),
        "image_auroc": auroc(good, bad),
        "threshold": 0.5,
        "f1": f1_at(good, bad, 0.5),
        "missed": int((bad <= 0.5).sum()),
        "false_alarms": int((good > 0.5).sum()),
        "best_f1": best,
        "best_f1_threshold": threshold,
        "pixel_auroc": pixel,
    }
    print(
        f"{good.size} good, {bad.size} bad parts: image AUROC {document['image_auroc']:.4f}; at the threshold 0.5 "
        f"F1 {document['f1']:.4f}, {document['missed']} missed, {document['false_alarms']} false alarm(s); "
        f"best F1 {best:.4f} at {threshold:.4f}" + (f"; pixel AUROC {pixel:.4f}" if pixel is not None else ""),
        file=out,
    )
    if json_path is not None:
        write_whole(json_path, json.dumps(document, indent=2) + "\n")
    return 0


def run_eval(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    refuse_overwriting({"--json": args.json}, {"--model": args.model, "--labels": args.labels})
    convention: Convention = "coco" if args.coco else "ultralytics"
    if convention == "coco":
        require_pycocotools()
    try:
        cfg = ModelConfig(path=args.model, labels=args.labels, conf=args.conf, iou=args.iou, max_det=args.max_det, top_k=5)
    except ValidationError as e:
        raise UsageError("; ".join(_option_problem(err["loc"], err["msg"]) for err in e.errors())) from None
    model = load_model(cfg, RuntimeConfig())
    if model.task == "classify":
        return _run_eval_classes(args, model, out)
    if model.task == "anomaly":
        return evaluate_anomaly(model, args.data, args.json, out)
    if args.data is not None:
        check_labelled(args.data, image_files(args.data))
        total, samples = folder_samples(args.data, model.num_classes)
    else:
        check_scene_classes(model, "evaluate it on your own labelled images with --data DIR")
        width, height = _size(args.size)
        total, samples = scene_samples(args.scenes, args.seed, width, height, outlines=model.task == "segment")
    report = evaluate(model, samples, total, args.report_conf, ProgressBar(total), convention)
    print(format_report(report), file=out)
    if args.data is not None and not any(c.n_gt for c in report.per_class):
        log.warning("the labels under %s hold no box: every figure is 0 for want of one, not measured", args.data)
    if args.json is not None:
        document = {
            "model": str(args.model),
            "model_sha256": model.engine.identity.sha256,
            "data": str(args.data) if args.data else f"scenes seed={args.seed} n={args.scenes}",
            "conf": args.conf,
            "iou": args.iou,
            "max_det": args.max_det,
            **report.to_dict(),
        }
        write_whole(args.json, json.dumps(document, indent=2) + "\n")
    return 0
