"""Build a small labelled segmentation folder and ``yolo val``'s own box and mask figures on it.

Run only in a scratch environment that has ultralytics (see build_ultralytics_tasks.py), after
that script made ``tests/data/tasks/seg.onnx``:

    /tmp/ul/bin/python tests/reference/build_segment_val.py

It writes tests/data/tasks/segval/: eight 160x160 frames (the model's input size) under ``images/``
with ultralytics segmentation labels (polygons) under ``labels/``, and ``val.json``, what
``yolo val`` (ultralytics' SegmentationValidator, its defaults) reported for ``seg.onnx`` there.
The labels are some of the model's own outlines, some of them shifted, and one made-up shape per
frame, so that the figures are neither 0 nor 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_ultralytics_tasks import OUT, SEG_IMGSZ, SEG_NAMES, frame

FOLDER = OUT / "segval"
FRAMES = 8


def main() -> None:
    import torchvision
    from ultralytics import YOLO
    from ultralytics.utils.nms import TorchNMS

    torchvision.ops.nms = TorchNMS.nms  # documented as torchvision's; works where its kernels do not load
    (FOLDER / "images").mkdir(parents=True, exist_ok=True)
    (FOLDER / "labels").mkdir(exist_ok=True)
    model = YOLO(str(OUT / "seg.onnx"), task="segment")
    rng = np.random.default_rng(7)
    for i in range(FRAMES):
        image = frame(f"val{i}", SEG_IMGSZ, SEG_IMGSZ, 10 + i)
        path = FOLDER / "images" / f"val{i}.png"
        cv2.imwrite(str(path), image)
        result = model.predict(cv2.imread(str(path)), imgsz=SEG_IMGSZ, conf=0.1, verbose=False)[0]
        lines = []
        for k, (polygon, c) in enumerate(
            zip(result.masks.xyn if result.masks else [], result.boxes.cls.tolist(), strict=False)
        ):
            if k % 3 == 2 or len(polygon) < 3:
                continue  # a detection the labels do not have: a false positive
            if k % 3 == 1:
                polygon = np.clip(polygon + rng.uniform(-0.03, 0.03, 2), 0, 1)  # an outline a little off
            lines.append(f"{int(c)} " + " ".join(f"{x:.6f} {y:.6f}" for x, y in polygon))
        centre = rng.uniform(0.25, 0.75, 2)
        angles = np.sort(rng.uniform(0, 2 * np.pi, 7))
        shape = np.clip(centre + rng.uniform(0.05, 0.2, (7, 1)) * np.stack([np.cos(angles), np.sin(angles)], 1), 0, 1)
        lines.append(f"{int(rng.integers(len(SEG_NAMES)))} " + " ".join(f"{x:.6f} {y:.6f}" for x, y in shape))
        (FOLDER / "labels" / f"val{i}.txt").write_text("\n".join(lines) + "\n")
    data = FOLDER / "data.yaml"
    data.write_text(f"path: {FOLDER}\ntrain: images\nval: images\nnames: {dict(enumerate(SEG_NAMES))}\n")
    metrics = model.val(data=str(data), imgsz=SEG_IMGSZ, batch=1, plots=False, verbose=False)
    figures = {
        "box_map50": float(metrics.box.map50),
        "box_map50_95": float(metrics.box.map),
        "mask_map50": float(metrics.seg.map50),
        "mask_map50_95": float(metrics.seg.map),
    }
    data.unlink()
    for cache in FOLDER.glob("*.cache"):
        cache.unlink()
    (FOLDER / "val.json").write_text(json.dumps({"imgsz": SEG_IMGSZ, **figures}, indent=1) + "\n")
    print(figures)


if __name__ == "__main__":
    main()
