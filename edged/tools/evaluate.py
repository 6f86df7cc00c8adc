"""``edged eval``: a model's accuracy measured through the daemon's own pipeline.

Frames go through exactly what `edged run` does to them (`FramePipeline`: the same letterbox,
the same contract, the same decoder and NMS), so the figures describe the deployed behaviour,
not a training framework's. Data is either a folder of images with YOLO-format label files (what
ultralytics and Roboflow export) or generated inspection scenes with their ground truth.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import cv2
import numpy as np

from edged.config import ModelConfig, RuntimeConfig
from edged.errors import DataError, UsageError
from edged.model import LoadedModel, load_model
from edged.pipeline import FramePipeline
from edged.sources.images import IMAGE_SUFFIXES
from edged.tools.metrics import EvalReport, MetricAccumulator
from edged.tools.scenes import SceneGenerator


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
    model: LoadedModel, samples: Iterator[EvalSample], total: int, report_conf: float, progress: ProgressBar | None = None
) -> EvalReport:
    """Run every sample through the daemon's pipeline and score the detections."""
    names = model.labels or [str(i) for i in range(model.num_classes)]
    acc = MetricAccumulator(names)
    plan: FramePipeline | None = None
    for done, sample in enumerate(samples, 1):
        h, w = sample.image.shape[:2]
        if plan is None or (plan.spec.width, plan.spec.height) != (w, h):
            plan = FramePipeline(model, w, h, "bgr")
        detections, _ = plan.process(sample.image)
        acc.add(detections.xyxy, detections.scores, detections.class_ids, sample.boxes, sample.class_ids)
        if progress:
            progress.update(done)
    return acc.report(conf=report_conf)


def format_report(report: EvalReport) -> str:
    lines = [f"{'class':<16}{'images':>8}{'labels':>8}{'P':>8}{'R':>8}{'mAP50':>8}{'mAP50-95':>10}"]
    lines.append(
        f"{'all':<16}{report.n_images:>8}{sum(c.n_gt for c in report.per_class):>8}"
        f"{report.precision:>8.3f}{report.recall:>8.3f}{report.map50:>8.3f}{report.map50_95:>10.3f}"
    )
    for c in report.per_class:
        lines.append(f"{c.name:<16}{'':>8}{c.n_gt:>8}{c.precision:>8.3f}{c.recall:>8.3f}{c.ap50:>8.3f}{c.ap50_95:>10.3f}")
    lines.append(f"(precision and recall at conf {report.conf:g}; AP is COCO-style, 101-point interpolation)")
    return "\n".join(lines)


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--size must be WIDTHxHEIGHT, e.g. 1280x720; got {text!r}") from None
    return width, height


def run_eval(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        cfg = ModelConfig(path=args.model, labels=args.labels, conf=args.conf, iou=args.iou, max_det=args.max_det)
    except ValueError as e:
        raise UsageError(str(e)) from None
    model = load_model(cfg, RuntimeConfig())
    if args.data is not None:
        total, samples = folder_samples(args.data, model.num_classes)
    else:
        width, height = _size(args.size)
        total, samples = scene_samples(args.scenes, args.seed, width, height)
    report = evaluate(model, samples, total, args.report_conf, ProgressBar(total))
    print(format_report(report), file=out)
    if args.json is not None:
        document = {
            "model": str(args.model),
            "model_sha256": model.engine.identity.sha256,
            "data": str(args.data) if args.data else f"scenes seed={args.seed} n={args.scenes}",
            "conf": args.conf,
            "iou": args.iou,
            **report.to_dict(),
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0
