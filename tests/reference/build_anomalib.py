"""Build the anomaly test model and anomalib's own results on it (tests/data/anomaly/).

Runs only in a scratch environment, never in edged's: anomalib is no dependency of edged.

    python3 -m venv /tmp/anomalib
    /tmp/anomalib/bin/pip install torch "anomalib==2.*" onnx
    /tmp/anomalib/bin/python tests/reference/build_anomalib.py

It generates defect-free scenes (`anomaly_scenes.py`: a grey part with a bored hole and ribbing on
a textured background, slightly moved and lit differently each time) and scenes with defects (dark
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
from anomalib.models import Padim, Patchcore  # noqa: E402
from anomaly_scenes import TRAIN_SIZE, scene  # noqa: E402
from PIL import Image  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "data" / "anomaly"
# Frames the results are recorded on: name, (w, h), defect kind (None: a good part).
FRAMES = [
    ("good_320x240", (320, 240), None),
    ("spot_320x240", (320, 240), "spot"),
    ("scratch_640x480", (640, 480), "scratch"),
    ("good_1280x720", (1280, 720), None),
    ("spot_256x256", (256, 256), "spot"),
    ("scratch_200x300", (200, 300), "scratch"),
]


def write_scenes(root: Path) -> None:
    rng = np.random.default_rng(7)
    for folder, count, defects in (("good", 40, [None]), ("bad", 12, ["spot", "scratch"])):
        (root / folder).mkdir(parents=True)
        for i in range(count):
            image = scene(TRAIN_SIZE, rng, defects[i % len(defects)])
            Image.fromarray(image).save(root / folder / f"{i:03d}.png")


def shapes(path: Path) -> dict[str, list[int | str]]:
    """Each input's and output's shape in an ONNX file, symbolic dimensions by name."""
    graph = onnx.load(str(path), load_external_data=False).graph
    return {
        value.name: [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
        for value in [*graph.input, *graph.output]
    }


def export(engine: Engine, model: Padim | Patchcore, work: Path, name: str, static: bool) -> dict[str, object]:
    """anomalib's ONNX export, re-saved with its weights inline as tests/data/anomaly/<name>.onnx, and
    its default export's shapes; ``static``: the model stored is exported without dynamic axes, at a
    batch of 1 and the trained size (PatchCore's default export is fixed at a batch of 2)."""
    default = engine.export(model, export_type="onnx", export_root=work / name / "default")
    print("anomalib exported", default, sorted(p.name for p in Path(default).parent.iterdir()), file=sys.stderr)
    served = default
    if static:
        served = engine.export(
            model,
            export_type="onnx",
            export_root=work / name / "served",
            input_size=(256, 256),
            onnx_kwargs={"dynamic_axes": {}},
        )
    graph = onnx.load(str(served))  # reads model.onnx.data too
    onnx.save(graph, str(OUT / f"{name}.onnx"))
    return {"default_export": shapes(Path(default)), "stored_export": shapes(OUT / f"{name}.onnx")}


def record(engine: Engine, model: Padim | Patchcore, work: Path, name: str, exported: dict[str, object]) -> None:
    """``Engine.predict`` on each frame; the frames and its outputs into tests/data/anomaly/."""
    rng = np.random.default_rng(11)
    frames = work / name / "frames"
    frames.mkdir(parents=True)
    for frame, size, defect in FRAMES:
        image = scene(size, rng, defect)
        Image.fromarray(image).save(OUT / f"{frame}.png")
        shutil.copy(OUT / f"{frame}.png", frames / f"{frame}.png")
    results: dict[str, dict[str, object]] = {}
    arrays: dict[str, np.ndarray] = {}
    for batch in engine.predict(model=model, data_path=frames) or []:
        for i, path in enumerate(batch.image_path):
            frame = Path(path).stem
            results[frame] = {
                "pred_score": float(batch.pred_score[i]),
                "pred_label": bool(batch.pred_label[i]),
                "map_shape": list(batch.anomaly_map[i].squeeze().shape),
            }
            arrays[f"{frame}_map"] = batch.anomaly_map[i].squeeze().numpy().astype(np.float32)
            arrays[f"{frame}_mask"] = batch.pred_mask[i].squeeze().numpy().astype(np.bool_)
    post = model.post_processor
    results["_thresholds"] = {
        "image": float(post.image_threshold),
        "pixel": float(post.pixel_threshold),
        "image_min": float(post.image_min),
        "image_max": float(post.image_max),
        "pixel_min": float(post.pixel_min),
        "pixel_max": float(post.pixel_max),
    }
    results["_exports"] = exported
    (OUT / f"{name}.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    np.savez_compressed(OUT / f"{name}_maps.npz", **arrays)


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
        padim = Padim(backbone="resnet18", layers=["layer1"], pre_trained=False, n_features=8, visualizer=False)
        # PatchCore: a memory bank of 0.2 % of the layer1 patches keeps the export small and the coreset quick.
        patchcore = Patchcore(
            backbone="resnet18", layers=["layer1"], pre_trained=False, coreset_sampling_ratio=0.002, visualizer=False
        )
        # PatchCore's default export is fixed at a batch of 2 (Dynamo specialises it at its example's);
        # without dynamic axes, at the trained size, anomalib exports it at a batch of 1.
        wanted = sys.argv[1:] or ["padim", "patchcore"]  # e.g. build_anomalib.py patchcore
        for name, model, static in (("padim", padim, False), ("patchcore", patchcore, True)):
            if name not in wanted:
                continue
            torch.manual_seed(0)
            engine = Engine(accelerator="cpu", devices=1, default_root_dir=work / name / "run", logger=False)
            engine.fit(model=model, datamodule=data)
            print(name, engine.test(model=model, datamodule=data), file=sys.stderr)
            exported = export(engine, model, work, name, static)
            record(engine, model, work, name, exported)


if __name__ == "__main__":
    main()
