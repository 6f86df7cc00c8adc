"""Build the classification and segmentation exports and ultralytics' own predictions of them.

Run only in a scratch environment that has ultralytics (it is no dependency of edged):

    python3 -m venv /tmp/ul && /tmp/ul/bin/pip install torch ultralytics onnx onnxslim onnxruntime
    /tmp/ul/bin/python tests/reference/build_ultralytics_tasks.py [cls] [seg]   # both by default

It writes tests/data/tasks/: ``cls.onnx`` and ``seg.onnx``, tiny YOLOv8 ``-cls`` and ``-seg`` exports
built from ultralytics' model yaml with random weights (nothing downloaded), scaled so that their
outputs follow the input (the classifier's last layer fitted to give each frame chosen
probabilities); the frames they are run on (PNG, four aspect ratios); and ``cls.json`` /
``seg.npz``, what ultralytics' ``predict`` returned for each frame. The tests compare edged with
those stored results and need no ultralytics.

Where the torchvision wheel is a CUDA build that cannot load its kernels, its import still gives the
transforms classification needs: the kernels' registration is skipped, and segmentation's NMS is
ultralytics' own torch NMS (``TorchNMS.nms``), which it documents as matching torchvision's.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types
from pathlib import Path

import cv2
import numpy as np

try:
    import torchvision  # noqa: F401
except (ImportError, RuntimeError, OSError):
    for name in [n for n in sys.modules if n.startswith("torchvision")]:
        del sys.modules[name]
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")

import torch
from ultralytics import YOLO
from ultralytics.nn.modules import Classify, Conv

OUT = Path(__file__).resolve().parent.parent / "data" / "tasks"
FRAMES = {"wide": (320, 240), "tall": (180, 320), "square": (200, 200), "strip": (400, 120)}  # name: width, height
CLS_NAMES = ["good", "scratch", "dent", "stain", "crack"]
SEG_NAMES = ["scratch", "dent", "stain"]
CLS_IMGSZ, SEG_IMGSZ = 64, 160
ROI = (40, 30, 220, 200)  # x1, y1, x2, y2 of the "wide" frame: the classification of a region
# The probabilities the classifier is fitted to give each frame as ultralytics' predict feeds it; the
# tests name them: a best class that differs between frames, one under 0.5 (square), the rest above.
CLS_TARGETS = {
    "wide": [0.0618, 0.118, 0.0121, 0.00736, 0.80],
    "tall": [0.0914, 0.0206, 0.769, 0.119, 2.68e-05],
    "square": [0.0581, 0.423, 0.00531, 0.369, 0.145],
    "strip": [0.0404, 0.0542, 0.178, 0.722, 0.00537],
    "wide-roi": [0.119, 0.00838, 0.0211, 0.0178, 0.834],
}


def frame(name: str, width: int, height: int, seed: int) -> np.ndarray:
    """A BGR frame of gradients and filled shapes: detail at every scale, small as a PNG."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.stack(
        [
            127 + 100 * np.sin(x / (7 + seed)) * np.cos(y / 11),
            127 + 100 * np.cos((x + y) / (13 + seed)),
            (x * 255 / width + y * 128 / height) % 256,
        ],
        axis=-1,
    ).astype(np.uint8)
    for _ in range(12):
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        cx, cy = int(rng.integers(0, width)), int(rng.integers(0, height))
        if rng.random() < 0.5:
            cv2.circle(image, (cx, cy), int(rng.integers(5, max(6, min(width, height) // 4))), colour, -1)
        else:
            w, h = int(rng.integers(8, width // 3)), int(rng.integers(8, height // 3))
            cv2.rectangle(image, (cx, cy), (cx + w, cy + h), colour, -1)
    return image


def tiny_yaml(folder: Path, base: str, nc: int, width: float = 0.0625) -> Path:
    """``base`` (an ultralytics model yaml) at a fraction of its width: a small file, the same graph."""
    import yaml
    from ultralytics.utils import ROOT

    cfg = yaml.safe_load((ROOT / "cfg" / "models" / "v8" / base).read_text())
    cfg.pop("scales", None)
    cfg.update(nc=nc, depth_multiple=0.33, width_multiple=width)
    path = folder / base.replace(".yaml", "-tiny.yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def input_sensitive(model: torch.nn.Module, seed: int, images: list[np.ndarray], imgsz: int) -> None:
    """Random batch-norm gains and biases, each layer normalised by its statistics over ``images``
    (as training would leave them), so that activations keep the input's variation through the
    depth; then the classifier's linear layer fitted so that ultralytics' predict gives each of
    ``images`` its `CLS_TARGETS` probabilities (least squares with the smallest weights: other
    frames get other scores).

    Normalised by random statistics instead, the pooled features varied by 1e-5 of their size
    between frames, and the weights that read them amplified floating-point rounding: the same
    export gave probabilities 1e-3 apart on two CPUs (AVX-512 and AVX2 kernels)."""
    from PIL import Image
    from ultralytics.data.augment import classify_transforms

    transform = classify_transforms(imgsz)  # what predict feeds a classifier: resize, centre crop
    batch = torch.stack([transform(Image.fromarray(cv2.cvtColor(image, cv2.COLOR_BGR2RGB))) for image in images])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.copy_(1.6 + 0.4 * torch.rand(module.weight.shape, generator=gen))
                module.bias.copy_(0.2 * torch.randn(module.bias.shape, generator=gen))
                module.reset_running_stats()
                module.momentum = None  # the running statistics become those of the one batch
        model.train()
        model(batch)
        model.eval()
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        pooled: list[torch.Tensor] = []
        hook = linear.register_forward_pre_hook(lambda _, args: pooled.append(args[0].detach().clone()))
        model(batch)
        hook.remove()
        features = torch.cat([pooled[0], torch.ones(len(images), 1)], dim=1).double()
        logits = torch.tensor(list(CLS_TARGETS.values()), dtype=torch.float64).log()
        fitted = torch.linalg.pinv(features) @ logits  # (features + 1, classes)
        linear.weight.copy_(fitted[:-1].T)
        linear.bias.copy_(fitted[-1])


def export(yaml_path: Path, names: list[str], imgsz: int, seed: int, images: list[np.ndarray]) -> Path:
    torch.manual_seed(seed)
    yolo = YOLO(str(yaml_path))
    yolo.model.names = dict(enumerate(names))
    head = yolo.model.model[-1]
    if isinstance(head, Classify):  # 128 hidden channels rather than 1280: a tenth of the file
        head.conv = Conv(head.conv.conv.in_channels, 128, 1, 1)
        head.linear = torch.nn.Linear(128, len(names))
    input_sensitive(yolo.model, seed, images, imgsz)
    return Path(yolo.export(format="onnx", imgsz=imgsz, simplify=True))


def main(tasks: set[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    frames = {}
    for i, (name, (w, h)) in enumerate(FRAMES.items()):
        image, path = frame(name, w, h, i + 1), OUT / f"{name}.png"
        stored = cv2.imread(str(path))
        if stored is None or stored.shape != image.shape or (stored != image).any():  # else left as it is
            cv2.imwrite(str(path), image)
        frames[name] = cv2.imread(str(path))
    home = Path.cwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        if "cls" in tasks:
            classify_reference(Path(tmp), frames)
        if "seg" in tasks:
            seg = export_seg(tiny_yaml(Path(tmp), "yolov8-seg.yaml", len(SEG_NAMES), 0.03125), list(frames.values()))
            (OUT / "seg.onnx").write_bytes(seg.read_bytes())
        os.chdir(home)
    if "seg" in tasks:
        segment_reference(frames)


def classify_reference(tmp: Path, frames: dict[str, np.ndarray]) -> None:
    """``cls.onnx`` and ultralytics' predict of it on each frame and on a region of one (``cls.json``)."""
    x1, y1, x2, y2 = ROI
    runs = {**frames, "wide-roi": np.ascontiguousarray(frames["wide"][y1:y2, x1:x2])}
    assert list(runs) == list(CLS_TARGETS)  # fitted in this order
    cls = export(tiny_yaml(tmp, "yolov8-cls.yaml", len(CLS_NAMES)), CLS_NAMES, CLS_IMGSZ, 1, list(runs.values()))
    (OUT / "cls.onnx").write_bytes(cls.read_bytes())
    model = YOLO(str(OUT / "cls.onnx"), task="classify")
    reference = {}
    for name, image in runs.items():
        probs = model.predict(image, imgsz=CLS_IMGSZ, verbose=False)[0].probs
        reference[name] = {"probs": probs.data.tolist(), "top5": probs.top5}
    (OUT / "cls.json").write_text(json.dumps({"imgsz": CLS_IMGSZ, "roi": ROI, "frames": reference}, indent=1) + "\n")
    for name, result in reference.items():
        print("cls", name, result["top5"], [round(p, 3) for p in result["probs"]])


def export_seg(yaml_path: Path, images: list[np.ndarray]) -> Path:
    """A segmentation export whose class scores pass 0.25 at about 0.3 % of the candidates: a few
    detections per frame, which ones depending on the frame."""
    torch.manual_seed(2)
    yolo = YOLO(str(yaml_path))
    yolo.model.names = dict(enumerate(SEG_NAMES))
    model = yolo.model.eval()
    head = model.model[-1]
    for branches in (head.cv2, head.cv3, head.cv4):  # 16 hidden channels, not 64: a quarter of the file
        for i, branch in enumerate(branches):
            c_in, c_out = branch[0].conv.in_channels, branch[-1].out_channels
            branches[i] = torch.nn.Sequential(Conv(c_in, 16, 3), Conv(16, 16, 3), torch.nn.Conv2d(16, c_out, 1))
    model.eval()  # the new layers too: batch statistics would make every frame alike
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.copy_(1.6 + 0.4 * torch.rand(module.weight.shape, generator=gen))
                module.bias.copy_(0.2 * torch.randn(module.bias.shape, generator=gen))
        # Each scale's class layer reads its features' deviations from their mean over the frames, so
        # that its logits follow the input (about N(-3.7, 1): a few candidates above 0.25 per frame).
        # The mask coefficients too (centred, unit spread), so that a mask is a shape inside its box.
        finals = [branch[-1] for branch in (*head.cv3, *head.cv4)]
        seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(finals))}
        hooks = [
            layer.register_forward_pre_hook(lambda _, args, i=i: seen[i].append(args[0].detach().clone()))
            for i, layer in enumerate(finals)
        ]
        for image in images:
            rgb = cv2.resize(image, (SEG_IMGSZ, SEG_IMGSZ), interpolation=cv2.INTER_AREA)[..., ::-1]
            model(torch.from_numpy(rgb.copy()).permute(2, 0, 1)[None].float() / 255)
        for hook in hooks:
            hook.remove()
        for i, layer in enumerate(finals):
            features = torch.cat([f.permute(0, 2, 3, 1).reshape(-1, f.shape[1]) for f in seen[i]])
            mean, std = features.mean(0), features.std(0) + 1e-6
            weight = torch.randn(layer.weight.shape[:2], generator=gen) / std / features.shape[1] ** 0.5
            layer.weight.copy_(weight[:, :, None, None])
            is_class = i < len(head.cv3)
            layer.bias.copy_((-3.7 if is_class else 0.0) - weight @ mean)
    return Path(yolo.export(format="onnx", imgsz=SEG_IMGSZ, simplify=True))


def segment_reference(frames: dict[str, np.ndarray]) -> None:
    """ultralytics' predict of ``seg.onnx`` on each frame: boxes, classes, scores, the masks at the
    input size, mapped to the frame (``ops.scale_masks``), at the frame size with ``retina_masks``,
    and the polygons (``masks.xy``); masks bit-packed."""
    from ultralytics.utils import ops

    vision = sys.modules.get("torchvision")
    if vision is not None and not vision.extension._has_ops():  # its kernels did not load: ultralytics' own NMS
        from ultralytics.utils.nms import TorchNMS

        vision.ops.nms = TorchNMS.nms
    model = YOLO(str(OUT / "seg.onnx"), task="segment")
    stored: dict[str, np.ndarray] = {}
    for name, image in frames.items():
        result = model.predict(image, imgsz=SEG_IMGSZ, verbose=False)[0]
        retina = model.predict(image, imgsz=SEG_IMGSZ, verbose=False, retina_masks=True)[0]
        n = len(result.boxes)
        stored[f"{name}/xyxy"] = result.boxes.xyxy.numpy()
        stored[f"{name}/conf"] = result.boxes.conf.numpy()
        stored[f"{name}/cls"] = result.boxes.cls.numpy().astype(np.int32)
        if n:
            masks = result.masks.data
            framed = ops.scale_masks(masks[None].float(), image.shape[:2])[0] > 0.5
            stored[f"{name}/frame_masks"] = np.packbits(framed.numpy(), axis=-1)
            stored[f"{name}/retina_masks"] = np.packbits(retina.masks.data.numpy().astype(bool), axis=-1)
            for i, polygon in enumerate(result.masks.xy):
                stored[f"{name}/polygon{i}"] = polygon
        print("seg", name, n, result.boxes.cls.tolist(), [round(c, 2) for c in result.boxes.conf.tolist()])
    np.savez_compressed(OUT / "seg.npz", imgsz=SEG_IMGSZ, **stored)


if __name__ == "__main__":
    main(set(sys.argv[1:]) or {"cls", "seg"})
