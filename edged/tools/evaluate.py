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

A classification model is scored as ``yolo val`` scores one, top-1 and top-5 accuracy (the share of
images whose class is the best, or among the five best), on an ultralytics classification folder:
one folder per class, named as the model names it, under ``--data`` or its ``val/``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import cv2
import numpy as np

from edged.classify import Classes
from edged.config import ModelConfig, RuntimeConfig
from edged.decode import Decoder, Detections
from edged.errors import DataError, UsageError
from edged.heads.registry import head_named
from edged.model import LoadedModel, load_model
from edged.pipeline import FramePipeline
from edged.sources.images import IMAGE_SUFFIXES
from edged.sources.scenes import SceneGenerator
from edged.tools.calibrate import auroc, best_f1, f1_at, images_in, ranked_auroc, score_images
from edged.tools.metrics import Convention, EvalReport, MetricAccumulator, Predictions, require_pycocotools


@dataclass(frozen=True, slots=True)
class EvalSample:
    name: str
    image: np.ndarray  # (H, W, 3) uint8 BGR
    boxes: np.ndarray  # (M, 4) float32 x1 y1 x2 y2 in pixels
    class_ids: np.ndarray  # (M,) int64


def label_path(image: Path) -> Path:
    """YOLO convention: .../images/x.jpg -> .../labels/x.txt, else x.txt beside the image."""
    parts = list(image.parts)
    if "images" in parts:
        i = len(parts) - 1 - parts[::-1].index("images")
        candidate = Path(*parts[:i], "labels", *parts[i + 1 :]).with_suffix(".txt")
        if candidate.is_file():
            return candidate
    return image.with_suffix(".txt")


def read_yolo_labels(path: Path, width: int, height: int, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``class cx cy w h`` normalised to 0..1; a missing file is an image without objects."""
    if not path.is_file():
        return np.zeros((0, 4), np.float32), np.zeros(0, np.int64)
    boxes, classes = [], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        try:
            c, cx, cy, w, h = int(fields[0]), *map(float, fields[1:5])
        except (ValueError, TypeError):
            raise DataError(f"{path}:{number}: expected 'class cx cy w h', got {line!r}") from None
        if not 0 <= c < num_classes:
            raise DataError(f"{path}:{number}: class {c} but the model has {num_classes} classes")
        boxes.append(((cx - w / 2) * width, (cy - h / 2) * height, (cx + w / 2) * width, (cy + h / 2) * height))
        classes.append(c)
    return np.asarray(boxes, np.float32).reshape(-1, 4), np.asarray(classes, np.int64)


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
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


def folder_samples(folder: Path, num_classes: int) -> tuple[int, Iterator[EvalSample]]:
    images = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not images:
        raise DataError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {folder}")

    def generate() -> Iterator[EvalSample]:
        for path in images:
            image = cv2.imread(str(path), cv2.IMREAD_COLOR)
            if image is None:
                raise DataError(f"cannot decode image {path}")
            boxes, classes = read_yolo_labels(label_path(path), image.shape[1], image.shape[0], num_classes)
            yield EvalSample(str(path.relative_to(folder)), image, boxes, classes)

    return len(images), generate()


def scene_samples(count: int, seed: int, width: int, height: int) -> tuple[int, Iterator[EvalSample]]:
    generator = SceneGenerator(width, height, seed=seed)

    def generate() -> Iterator[EvalSample]:
        for index in range(count):
            scene = generator.render(index)
            yield EvalSample(f"scene {seed}:{index}", scene.image, scene.boxes, scene.class_ids.astype(np.int64))

    return count, generate()


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
    plan: FramePipeline | None = None
    for done, sample in enumerate(samples, 1):
        h, w = sample.image.shape[:2]
        if plan is None or (plan.spec.width, plan.spec.height) != (w, h):
            plan = FramePipeline(model, w, h, "bgr")
        detections, _ = plan.process(sample.image)
        assert isinstance(detections, Detections)  # run_eval scores classifiers and anomaly models apart
        published = (detections.xyxy.copy(), detections.scores.copy(), detections.class_ids.copy())
        xyxy, scores, classes = _every_class(plan) or published
        acc.add(xyxy, scores, classes, sample.boxes, sample.class_ids, published=published)
        if progress:
            progress.update(done)
    return acc.report(conf=report_conf, convention=convention)


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
    val reads it), each with the class id its folder names; `DataError` for a folder no class has."""
    root = folder / "val" if (folder / "val").is_dir() else folder
    ids = {name: i for i, name in enumerate(class_names)}
    samples = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        if sub.name not in ids:
            raise DataError(f"{sub}: no class of the model is named {sub.name!r} (its classes: {', '.join(class_names)})")
        images = sorted(p for p in sub.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
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
        image = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if image is None:
            raise DataError(f"cannot decode image {path}")
        h, w = image.shape[:2]
        if plan is None or (plan.spec.width, plan.spec.height) != (w, h):
            plan = FramePipeline(model, w, h, "bgr")
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


_CONVENTION_NOTES: dict[Convention, str] = {
    "ultralytics": "AP as yolo val: its predictions, 101-point precision envelope integrated by the trapezoid rule",
    "coco": "AP as pycocotools' COCOeval on yolo val's predictions: 101-point precision envelope averaged, "
    "at most 100 per class and image",
}


def format_report(report: EvalReport) -> str:
    lines = [f"{'class':<16}{'images':>8}{'labels':>8}{'P':>8}{'R':>8}{'mAP50':>8}{'mAP50-95':>10}"]
    lines.append(
        f"{'all':<16}{report.n_images:>8}{sum(c.n_gt for c in report.per_class):>8}"
        f"{report.precision:>8.3f}{report.recall:>8.3f}{report.map50:>8.3f}{report.map50_95:>10.3f}"
    )
    for c in report.per_class:
        lines.append(f"{c.name:<16}{'':>8}{c.n_gt:>8}{c.precision:>8.3f}{c.recall:>8.3f}{c.ap50:>8.3f}{c.ap50_95:>10.3f}")
    lines.append(f"({_CONVENTION_NOTES[report.convention]})")
    lines.append(
        f"(precision and recall: the boxes the daemon publishes at conf {report.report_conf:g}, matched at IoU 0.5)"
    )
    return "\n".join(lines)


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--size must be WIDTHxHEIGHT, e.g. 1280x720; got {text!r}") from None
    return width, height


def _pixel_auroc(
    masks: Path, bad_images: Sequence[Path], good_maps: Sequence[np.ndarray], bad_maps: Sequence[np.ndarray]
) -> float | None:
    """The pixel AUROC of the maps against the defect masks in ``masks`` (one per bad image, by its
    name; non-zero on the defect; good images have none), each stretched to the map's size as the
    frame was; None without a masks folder or a map."""
    if not masks.is_dir() or not bad_maps:
        return None
    truth = [np.zeros(m.shape, np.bool_) for m in good_maps]
    for path, anomaly_map in zip(bad_images, bad_maps, strict=True):
        found = [p for p in masks.iterdir() if p.stem == path.stem]
        mask = cv2.imread(str(found[0]), cv2.IMREAD_GRAYSCALE) if found else None
        if mask is None:
            raise DataError(f"{masks} has no readable mask for {path.name} (a PNG named {path.stem}.png)")
        h, w = anomaly_map.shape
        truth.append(cv2.resize(mask, (w, h), interpolation=cv2.INTER_NEAREST) > 0)
    positive = np.concatenate([t.ravel() for t in truth])
    if not positive.any():
        raise DataError(f"the masks in {masks} mark no defect pixel")
    return ranked_auroc(np.concatenate([m.ravel() for m in (*good_maps, *bad_maps)]), positive)


def evaluate_anomaly(model: LoadedModel, data: Path | None, json_path: Path | None, out: TextIO) -> int:
    """An anomaly model over ``data``/good and ``data``/bad (images of good and bad parts): the image
    AUROC, and the F1 and misses at the export's threshold (0.5), through the daemon's pipeline."""
    if data is None:
        raise UsageError("an anomaly model is evaluated on --data DIR holding good/ and bad/ folders of images")
    bad_images = images_in(data / "bad")
    scored_good, scored_bad = score_images(model, images_in(data / "good")), score_images(model, bad_images)
    good, bad = scored_good.scores, scored_bad.scores
    threshold, best = best_f1(good, bad)
    pixel = _pixel_auroc(data / "masks", bad_images, scored_good.maps, scored_bad.maps)
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
        json_path.write_text(json.dumps(document, indent=2) + "\n")
    return 0


def run_eval(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    convention: Convention = "coco" if args.coco else "ultralytics"
    if convention == "coco":
        require_pycocotools()
    try:
        cfg = ModelConfig(path=args.model, labels=args.labels, conf=args.conf, iou=args.iou, max_det=args.max_det, top_k=5)
    except ValueError as e:
        raise UsageError(str(e)) from None
    model = load_model(cfg, RuntimeConfig())
    if model.task == "classify":
        return _run_eval_classes(args, model, out)
    if model.task == "anomaly":
        return evaluate_anomaly(model, args.data, args.json, out)
    if args.data is not None:
        total, samples = folder_samples(args.data, model.num_classes)
    else:
        width, height = _size(args.size)
        total, samples = scene_samples(args.scenes, args.seed, width, height)
    report = evaluate(model, samples, total, args.report_conf, ProgressBar(total), convention)
    print(format_report(report), file=out)
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
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0
