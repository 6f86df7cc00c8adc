"""A real YOLOv8n, trained by ultralytics on generated scenes, for the accuracy side of precision choices.

`yolov8n_like.py` costs what YOLOv8n costs but its outputs mean nothing, so whether INT8 or bf16
keeps a YOLOv8n's detections and verdicts (`edged tune`'s gate) cannot be judged on it. This
script trains one, with no pretrained weights: ultralytics' own ``yolov8n.yaml`` (3 classes:
scratch, spot, crack), from random initialisation, on scenes from `edged.sources.scenes`, and
exports it as ultralytics does (``[1, 3, 640, 640]`` in, ``[1, 7, 8400]`` out, ONNX opset 17).

Training is cheap at 320 and the export runs at 640 on whole frames: each training image is a
320x320 crop of a 1280x720 scene halved (as the 640 letterbox halves it), so defects keep the
size in pixels they have at inference.

Runs in a scratch environment with ultralytics and torch (never edged's dependencies), from a
checkout so that ``edged`` imports; the run BENCHMARKS.md reports (2,400 crops, as many epochs as
1.45 hours held on 2 cores: 15, the last cut short)::

    PYTHONPATH=$PWD python benchmarks/yolov8n_trained.py --out /tmp/edged-bench/yolov8n-scenes.onnx \
        --scenes 1200 --batch 16 --hours 1.45

Beside the model it writes ``yolov8n-scenes-images/``: held-out 1280x720 scenes (seed 1000, never
trained on) under ``images/`` to tune and judge on, their YOLO labels under ``labels/``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import types
from pathlib import Path

import cv2
import numpy as np

from edged.sources.scenes import SceneGenerator

NAMES = ("scratch", "spot", "crack")
CROP = 320
MIN_KEPT = 0.4  # a defect cut by the crop keeps its label when this share of its box is inside


def _crops(scene_image: np.ndarray, boxes: np.ndarray, rng: np.random.Generator) -> list[tuple[np.ndarray, list[str]]]:
    """Two CROPxCROP crops of the halved scene, with their defects' YOLO label lines."""
    half = cv2.resize(scene_image, None, fx=0.5, fy=0.5, interpolation=cv2.INTER_LINEAR)
    h, w = half.shape[:2]
    out = []
    for x0 in (0, w - CROP):
        y0 = int(rng.integers(0, h - CROP + 1))
        lines = []
        for (x1, y1, x2, y2), cls in boxes:
            bx1, by1, bx2, by2 = x1 / 2 - x0, y1 / 2 - y0, x2 / 2 - x0, y2 / 2 - y0
            cx1, cy1, cx2, cy2 = max(bx1, 0), max(by1, 0), min(bx2, CROP), min(by2, CROP)
            if cx2 - cx1 < 2 or cy2 - cy1 < 2:
                continue
            if (cx2 - cx1) * (cy2 - cy1) < MIN_KEPT * (bx2 - bx1) * (by2 - by1):
                continue
            cx, cy, bw, bh = (cx1 + cx2) / 2 / CROP, (cy1 + cy2) / 2 / CROP, (cx2 - cx1) / CROP, (cy2 - cy1) / CROP
            lines.append(f"{cls} {cx:.6f} {cy:.6f} {bw:.6f} {bh:.6f}")
        out.append((np.ascontiguousarray(half[y0 : y0 + CROP, x0 : x0 + CROP]), lines))
    return out


def _write_split(root: Path, split: str, seeds: range, per_seed: int) -> int:
    (root / "images" / split).mkdir(parents=True, exist_ok=True)
    (root / "labels" / split).mkdir(parents=True, exist_ok=True)
    count = 0
    for seed in seeds:
        gen = SceneGenerator(1280, 720, seed=seed)
        rng = np.random.default_rng(seed)
        for i in range(per_seed):
            scene = gen.render(i)
            pairs = list(zip(scene.boxes.tolist(), scene.class_ids.tolist(), strict=True))
            for k, (image, lines) in enumerate(_crops(scene.image, pairs, rng)):
                name = f"s{seed}-{i:05d}-{k}"
                cv2.imwrite(str(root / "images" / split / f"{name}.png"), image)
                (root / "labels" / split / f"{name}.txt").write_text("".join(f"{line}\n" for line in lines))
                count += 1
    return count


def _write_held_out(folder: Path, count: int) -> None:
    """Whole 1280x720 scenes (seed 1000, never trained on) with labels in frame-normalised YOLO form."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    (folder / "labels").mkdir(parents=True, exist_ok=True)
    gen = SceneGenerator(1280, 720, seed=1000)
    for i in range(count):
        scene = gen.render(i)
        cv2.imwrite(str(folder / "images" / f"scene{i:03d}.png"), scene.image)
        lines = [
            f"{c} {(x1 + x2) / 2560:.6f} {(y1 + y2) / 1440:.6f} {(x2 - x1) / 1280:.6f} {(y2 - y1) / 720:.6f}\n"
            for (x1, y1, x2, y2), c in zip(scene.boxes.tolist(), scene.class_ids.tolist(), strict=True)
        ]
        (folder / "labels" / f"scene{i:03d}.txt").write_text("".join(lines))


def _torch_nms(boxes: object, scores: object, iou: float) -> object:
    from ultralytics.utils.nms import TorchNMS

    return TorchNMS.nms(boxes, scores, iou)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the ONNX model to write")
    parser.add_argument("--scenes", type=int, default=2400, help="training scenes (two crops each)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hours", type=float, default=None, help="train for this long (overrides --epochs)")
    parser.add_argument("--held-out", type=int, default=48, help="whole scenes written beside the model")
    parser.add_argument("--work", type=Path, default=None, help="dataset and run folder (default: beside --out)")
    args = parser.parse_args(argv)
    os.environ.setdefault("YOLO_OFFLINE", "1")
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        # A torchvision build whose ops cannot load (a CUDA build beside the CPU torch) breaks
        # ultralytics' trainer, which imports it for its validator; the validator's NMS is the one
        # op it uses, and ultralytics has its own.
        stand_in = types.ModuleType("torchvision")
        stand_in.ops = types.SimpleNamespace(nms=_torch_nms)  # type: ignore[attr-defined]
        sys.modules["torchvision"] = stand_in
    from ultralytics import YOLO
    from ultralytics.utils import USER_CONFIG_DIR

    # ultralytics fetches a font for its plots on first use, which fails offline; no plot is drawn,
    # so any local TrueType font stands in.
    for font in ("Arial.ttf", "Arial.Unicode.ttf"):
        target = USER_CONFIG_DIR / font
        if not target.exists():
            shutil.copy("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", target)

    work = args.work or args.out.parent / f"{args.out.stem}-work"
    data = work / "data"
    start = time.perf_counter()
    if not (data / "images" / "train").is_dir():
        n_train = _write_split(data, "train", range(1, 9), args.scenes // 8)
        n_val = _write_split(data, "val", range(1), 100)
        print(f"dataset: {n_train} train, {n_val} val crops in {time.perf_counter() - start:.0f} s", flush=True)
    yaml = work / "scenes.yaml"
    yaml.write_text(
        f"path: {data}\ntrain: images/train\nval: images/val\nnames:\n"
        + "".join(f"  {i}: {n}\n" for i, n in enumerate(NAMES))
    )
    model = YOLO("yolov8n.yaml")
    model.train(
        data=str(yaml),
        imgsz=CROP,
        epochs=args.epochs,
        time=args.hours,
        warmup_epochs=1,
        cache="ram",
        batch=args.batch,
        workers=0,
        device="cpu",
        project=str(work),
        name="run",
        exist_ok=True,
        plots=False,
        seed=0,
        deterministic=False,
        amp=False,
        pretrained=False,
        val=False,
        scale=0.25,
        flipud=0.5,
        mosaic=1.0,
        close_mosaic=1,
        verbose=False,
    )
    best = YOLO(str(work / "run" / "weights" / "last.pt"))
    exported = Path(best.export(format="onnx", imgsz=640, opset=17, simplify=False, dynamic=False))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(exported, args.out)
    _write_held_out(args.out.parent / f"{args.out.stem}-images", args.held_out)
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
