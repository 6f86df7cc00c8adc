"""Build the anomaly test model and anomalib's own results on it (tests/data/anomaly/).

Runs only in a scratch environment, never in edged's: anomalib is no dependency of edged.

    python3 -m venv /tmp/anomalib
    /tmp/anomalib/bin/pip install torch "anomalib==2.*" onnx
    /tmp/anomalib/bin/python tests/reference/build_anomalib.py

It generates defect-free scenes (a grey part with a bored hole and ribbing on a textured
background, slightly moved and lit differently each time) and held-out scenes with defects (dark
spots and scratches on the part), trains anomalib's PaDiM on the good ones (resnet18 built without
downloaded weights, layer1 only, 8 features, so the export stays near 1 MB), exports it with
anomalib's own ONNX export and re-saves it with its weights inline (anomalib writes them to a
``model.onnx.data`` file beside it). Then it runs ``Engine.predict`` (anomalib's inference of the
trained model, which resizes with antialiasing) on frames of several sizes and aspect ratios and
stores every output: ``pred_score``, ``pred_label``, ``anomaly_map`` and ``pred_mask``. The tests
compare edged with those.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch

# PyPI's torchvision wheel is built against CUDA torch: with the CPU torch its compiled ops do not
# load and importing it fails on registering their fakes. anomalib never calls those ops here, so
# declaring the two it registers first lets it import.
_TORCHVISION = torch.library.Library("torchvision", "DEF")
for _op in ("nms", "qnms"):
    _TORCHVISION.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

from anomalib.data import Folder  # noqa: E402
from anomalib.engine import Engine  # noqa: E402
from anomalib.models import Padim  # noqa: E402
from PIL import Image  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "data" / "anomaly"
TRAIN_SIZE = (320, 240)  # w, h of the training scenes
# Frames the results are recorded on: name, (w, h), defect kind (None: a good part).
FRAMES = [
    ("good_320x240", (320, 240), None),
    ("spot_320x240", (320, 240), "spot"),
    ("scratch_640x480", (640, 480), "scratch"),
    ("good_1280x720", (1280, 720), None),
    ("spot_256x256", (256, 256), "spot"),
    ("scratch_200x300", (200, 300), "scratch"),
]


def scene(size: tuple[int, int], rng: np.random.Generator, defect: str | None) -> np.ndarray:
    """An RGB uint8 scene ``size`` (w, h): textured background, the part, and a ``defect`` on it."""
    w, h = size
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
    elif defect == "scratch":
        x0, y0 = cx - 0.22, cy + rng.uniform(-0.25, -0.1)
        slope = rng.uniform(0.3, 0.6)
        line = (np.abs((v - y0) - slope * (u - x0)) < 0.012) & (u > x0) & (u < x0 + 0.3) & part
        img[line] = 235
    return np.clip(img, 0, 255).astype(np.uint8)


def write_scenes(root: Path) -> None:
    rng = np.random.default_rng(7)
    for folder, count, defects in (("good", 40, [None]), ("bad", 12, ["spot", "scratch"])):
        (root / folder).mkdir(parents=True)
        for i in range(count):
            image = scene(TRAIN_SIZE, rng, defects[i % len(defects)])
            Image.fromarray(image).save(root / folder / f"{i:03d}.png")


def export(engine: Engine, model: Padim, work: Path) -> None:
    """anomalib's ONNX export, re-saved with its weights inline as tests/data/anomaly/padim.onnx."""
    path = engine.export(model, export_type="onnx", export_root=work / "export")
    print("anomalib exported", path, sorted(p.name for p in Path(path).parent.iterdir()), file=sys.stderr)
    graph = onnx.load(str(path))  # reads model.onnx.data too
    onnx.save(graph, str(OUT / "padim.onnx"))


def record(engine: Engine, model: Padim, work: Path) -> None:
    """``Engine.predict`` on each frame; the frames and its outputs into tests/data/anomaly/."""
    rng = np.random.default_rng(11)
    frames = work / "frames"
    frames.mkdir()
    for name, size, defect in FRAMES:
        image = scene(size, rng, defect)
        Image.fromarray(image).save(OUT / f"{name}.png")
        shutil.copy(OUT / f"{name}.png", frames / f"{name}.png")
    results: dict[str, dict[str, object]] = {}
    arrays: dict[str, np.ndarray] = {}
    for batch in engine.predict(model=model, data_path=frames) or []:
        for i, path in enumerate(batch.image_path):
            name = Path(path).stem
            results[name] = {
                "pred_score": float(batch.pred_score[i]),
                "pred_label": bool(batch.pred_label[i]),
                "map_shape": list(batch.anomaly_map[i].squeeze().shape),
            }
            arrays[f"{name}_map"] = batch.anomaly_map[i].squeeze().numpy().astype(np.float32)
            arrays[f"{name}_mask"] = batch.pred_mask[i].squeeze().numpy().astype(np.bool_)
    post = model.post_processor
    results["_thresholds"] = {
        "image": float(post.image_threshold),
        "pixel": float(post.pixel_threshold),
        "image_min": float(post.image_min),
        "image_max": float(post.image_max),
        "pixel_min": float(post.pixel_min),
        "pixel_max": float(post.pixel_max),
    }
    (OUT / "padim.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    np.savez_compressed(OUT / "padim_maps.npz", **arrays)


def main() -> None:
    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_scenes(work / "scenes")
        data = Folder(
            name="scenes",
            root=work / "scenes",
            normal_dir="good",
            abnormal_dir="bad",
            train_batch_size=8,
            eval_batch_size=8,
            num_workers=0,
            seed=0,
        )
        model = Padim(backbone="resnet18", layers=["layer1"], pre_trained=False, n_features=8, visualizer=False)
        engine = Engine(accelerator="cpu", devices=1, default_root_dir=work / "run", logger=False)
        engine.fit(model=model, datamodule=data)
        print(engine.test(model=model, datamodule=data), file=sys.stderr)
        export(engine, model, work)
        record(engine, model, work)


if __name__ == "__main__":
    main()
