"""Generated inspection scenes for anomaly models: a part on a belt, good or with a defect.

A grey part with a bored hole and ribbing on a textured background, slightly moved and lit
differently each time; a defect is a dark spot or a bright scratch on the part. The anomaly test
model (tests/data/anomaly, made by build_anomalib.py) was trained on good ones. Run alone (numpy
and OpenCV, no anomalib) it writes held-out scenes for ``edged eval``, good/, bad/ and masks/
(each bad scene's defect, by its name):

    python tests/reference/anomaly_scenes.py --out /tmp/heldout --count 100 --seed 99
    edged eval --model tests/data/anomaly/padim.onnx --data /tmp/heldout
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cv2
import numpy as np

TRAIN_SIZE = (320, 240)  # w, h of the training scenes
DEFECTS = ("spot", "scratch")


def scene(size: tuple[int, int], rng: np.random.Generator, defect: str | None) -> np.ndarray:
    """An RGB uint8 scene ``size`` (w, h): textured background, the part, and a ``defect`` on it."""
    return scene_and_mask(size, rng, defect)[0]


def scene_and_mask(size: tuple[int, int], rng: np.random.Generator, defect: str | None) -> tuple[np.ndarray, np.ndarray]:
    """`scene`, and the mask of its defect (uint8, 255 on the defect)."""
    w, h = size
    mask = np.zeros((h, w), np.uint8)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    u, v = xx / w, yy / h
    base = 70 + 10 * np.sin(u * 40) * np.cos(v * 30) + rng.normal(0, 3, (h, w))
    img = np.repeat(base[..., None], 3, axis=2)
    img[..., 2] += 12  # a bluish belt
    cx, cy = 0.5 + rng.uniform(-0.02, 0.02), 0.5 + rng.uniform(-0.02, 0.02)
    part = (np.abs(u - cx) < 0.3) & (np.abs(v - cy) < 0.3)
    shade = 160 + rng.uniform(-8, 8) + 12 * np.sin((u - cx) * 90)  # ribbing across the part
    img[part] = shade[part][:, None] + np.array([4.0, 0.0, -6.0])
    hole = (u - cx) ** 2 + ((v - cy) * h / w) ** 2 < 0.08**2
    img[hole] = 40
    if defect == "spot":
        dx, dy = cx + rng.uniform(0.1, 0.2), cy + rng.uniform(-0.2, 0.2)
        spot = (u - dx) ** 2 + ((v - dy) * h / w) ** 2 < rng.uniform(0.025, 0.04) ** 2
        img[spot] = np.array([60.0, 40.0, 30.0])
        mask[spot] = 255
    elif defect == "scratch":
        x0, y0 = cx - 0.22, cy + rng.uniform(-0.25, -0.1)
        slope = rng.uniform(0.3, 0.6)
        line = (np.abs((v - y0) - slope * (u - x0)) < 0.012) & (u > x0) & (u < x0 + 0.3) & part
        img[line] = 235
        mask[line] = 255
    return np.clip(img, 0, 255).astype(np.uint8), mask


def main() -> None:
    parser = argparse.ArgumentParser(description="write good/ and bad/ folders of generated scenes")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=100, help="scenes of each kind")
    parser.add_argument("--seed", type=int, default=99, help="7 and 11 made the training and test scenes")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    for kind in ("good", "bad", "masks"):
        (args.out / kind).mkdir(parents=True, exist_ok=True)
    for kind in ("good", "bad"):
        for i in range(args.count):
            image, mask = scene_and_mask(TRAIN_SIZE, rng, DEFECTS[i % len(DEFECTS)] if kind == "bad" else None)
            cv2.imwrite(str(args.out / kind / f"{i:03d}.png"), image[:, :, ::-1])
            if kind == "bad":
                cv2.imwrite(str(args.out / "masks" / f"{i:03d}.png"), mask)


if __name__ == "__main__":
    main()
