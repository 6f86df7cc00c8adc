"""Train edged's demo defect detector on generated scenes and export it as a yolov8-style ONNX.

Owns the recipe behind ``models/demo.onnx``: which scenes are used (training seeds 1..8, so the
default seed 0 and everything from 1000 up stay held out), the letterboxed 320x320 cache, the
optimiser schedule with an EMA of the weights, the ONNX export with ultralytics metadata, and a
final held-out evaluation. Needs the optional ``torch`` extra (CPU wheel); nothing under
``edged/`` imports torch.

    python models/train.py --epochs 8 --scenes 12000 --out models/demo.onnx --seed 0

``--task segment`` trains the yolov8-seg variant instead (32 prototypes at stride 4, instance masks
from the scenes' painted pixels) and exports ``output0`` [1, 4+nc+32, N] plus ``output1``
[1, 32, S/4, S/4] with ``task=segment``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import onnx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from net import PROTO_STRIDE, STRIDES, Detector, ExportHead, TaskAlignedLoss, anchor_points

from edged import __version__
from edged.config import ModelConfig, RuntimeConfig
from edged.contract import InputContract
from edged.model import load_model
from edged.preprocess import Preprocessor
from edged.sources.scenes import CLASS_NAMES, SceneGenerator
from edged.tools.evaluate import evaluate, scene_samples

SIZE = 320
TRAIN_SEEDS = tuple(range(1, 9))
FRAME_SIZES = ((1280, 720),) * 8 + ((640, 480), (1024, 1024))
MAX_OBJECTS = 8
MASK_COEFFICIENTS = 32


def letterboxers() -> dict[tuple[int, int], Preprocessor]:
    """The daemon's own preprocess, asked for uint8 RGB HWC: exactly the pixels edged feeds."""
    contract = InputContract(
        "images", (1, SIZE, SIZE, 3), np.uint8, "nhwc", "rgb", "letterbox", 1.0, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    )
    return {(w, h): Preprocessor(contract, w, h) for w, h in set(FRAME_SIZES)}


def build_cache(count: int, masks: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Letterboxed RGB inputs (count, S, S, 3), padded boxes (count, G, 4) and classes, and with
    `masks` each object's mask on the prototype cells (count, G, S/4, S/4) as uint8 0 or 255."""
    gens = {(w, h, s): SceneGenerator(w, h, seed=s) for w, h in set(FRAME_SIZES) for s in TRAIN_SEEDS}
    pres = letterboxers()
    images = np.empty((count, SIZE, SIZE, 3), np.uint8)
    boxes = np.zeros((count, MAX_OBJECTS, 4), np.float32)
    classes = np.full((count, MAX_OBJECTS), -1, np.int64)
    cells = SIZE // PROTO_STRIDE
    cover = np.zeros((count, MAX_OBJECTS, cells, cells), np.uint8) if masks else None
    for j in range(count):
        w, h = FRAME_SIZES[j % len(FRAME_SIZES)]
        scene = gens[(w, h, TRAIN_SEEDS[j % len(TRAIN_SEEDS)])].render(j // len(TRAIN_SEEDS), masks=masks)
        pre = pres[(w, h)]
        images[j], bm = pre(scene.image)[0], pre.box_map
        n = len(scene.boxes)
        boxes[j, :n] = scene.boxes * bm.scale_x + np.array([bm.pad_x, bm.pad_y] * 2, np.float32)
        classes[j, :n] = scene.class_ids
        if cover is not None and scene.masks is not None:
            rw, rh = round(bm.resized_w / PROTO_STRIDE), round(bm.resized_h / PROTO_STRIDE)
            px, py = round(bm.pad_x / PROTO_STRIDE), round(bm.pad_y / PROTO_STRIDE)
            for k, mask in enumerate(scene.masks):
                small = cv2.resize(mask.astype(np.uint8) * 255, (rw, rh), interpolation=cv2.INTER_AREA)
                # Binary at half the instance's own peak coverage: a 3-pixel scratch covers a fifth
                # of a cell at most, and an averaged target would teach it a mask below the 0.5
                # that process_mask keeps, i.e. none.
                small = np.where(small.astype(np.int32) * 2 >= max(int(small.max()), 1), 255, 0).astype(np.uint8)
                cover[j, k, py : py + rh, px : px + rw] = small[: cells - py, : cells - px]
    return images, boxes, classes, cover


def augment(x: torch.Tensor, boxes: torch.Tensor, gen: torch.Generator, masks: torch.Tensor | None = None) -> None:
    """In place: per-sample horizontal/vertical flips (of masks too) and a brightness/contrast jitter."""
    n = x.shape[0]
    for dim, lo, hi in ((3, 0, 2), (2, 1, 3)):
        flip = torch.rand(n, generator=gen) < 0.5
        x[flip] = x[flip].flip(dim)
        if masks is not None:
            masks[flip] = masks[flip].flip(dim)
        b = boxes[flip]
        b[..., [lo, hi]] = SIZE - b[..., [hi, lo]]
        boxes[flip] = b
    gain = 0.75 + 0.5 * torch.rand(n, 1, 1, 1, generator=gen)
    bias = 0.08 * (torch.rand(n, 1, 1, 1, generator=gen) - 0.5)
    x.mul_(gain).add_(bias).clamp_(0, 1)


class Ema:
    """Exponential moving average of weights with a warm-up ramp (as ultralytics' ModelEMA)."""

    def __init__(self, model: Detector, decay: float = 0.9995, tau: float = 400) -> None:
        self.model = copy.deepcopy(model).eval()
        self.decay, self.tau, self.updates = decay, tau, 0
        for p in self.model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: Detector) -> None:
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / self.tau))
        src = model.state_dict()
        for k, v in self.model.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(d).add_(src[k].detach(), alpha=1 - d)


def train(args: argparse.Namespace) -> Ema:
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    segment = args.task == "segment"
    images, boxes, classes, cover = build_cache(args.scenes, masks=segment)
    print(f"cache: {len(images)} scenes in {time.perf_counter() - start:.0f} s", flush=True)
    model = Detector(len(CLASS_NAMES), act=args.act, masks=MASK_COEFFICIENTS if segment else 0)
    model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    points, strides = anchor_points(SIZE)
    criterion = TaskAlignedLoss(points, strides, len(CLASS_NAMES))
    decay = [p for p in model.parameters() if p.ndim > 1]
    other = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 5e-4}, {"params": other, "weight_decay": 0.0}], lr=args.lr)
    steps_per_epoch = len(images) // args.batch
    total, warmup = steps_per_epoch * args.epochs, min(300, steps_per_epoch)
    ema = Ema(model)
    step = 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(images), generator=gen)
        for k in range(steps_per_epoch):
            idx = order[k * args.batch : (k + 1) * args.batch].numpy()
            x = torch.from_numpy(images[idx]).permute(0, 3, 1, 2).float().div_(255)
            b, c = torch.from_numpy(boxes[idx]), torch.from_numpy(classes[idx])
            m = None if cover is None else torch.from_numpy(cover[idx]).float().div_(255)
            augment(x, b, gen, m)
            lr = args.lr * min(1.0, (step + 1) / warmup) * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * step / total)))
            for group in opt.param_groups:
                group["lr"] = lr
            dist, logits, *seg = model(x.contiguous(memory_format=torch.channels_last))
            loss, stats = criterion(dist, logits, b, c, c >= 0, None if m is None else (seg[0], seg[1], m))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            ema.update(model)
            step += 1
            if step % 50 == 0:
                print(
                    f"epoch {epoch} step {step}/{total} lr {lr:.5f} loss {loss.item():.3f} "
                    + " ".join(f"{k} {v:.3f}" for k, v in stats.items())
                    + f" t {time.perf_counter() - start:.0f}s",
                    flush=True,
                )
    return ema


def export(model: Detector, out: Path, meta: dict[str, str]) -> None:
    """ONNX with input ``images`` [1,3,S,S] and output ``output0`` [1, 4+nc, N] (a segmentation
    model's [1, 4+nc+32, N] and ``output1`` [1, 32, S/4, S/4]), plus metadata."""
    wrapper = ExportHead(copy.deepcopy(model).float().eval(), SIZE).eval()
    dummy = torch.zeros(1, 3, SIZE, SIZE)
    torch.onnx.export(
        wrapper,
        (dummy,),
        str(out),
        input_names=["images"],
        output_names=["output0", "output1"] if model.masks else ["output0"],
        opset_version=17,
        dynamo=False,
        do_constant_folding=True,
    )
    proto = onnx.load(str(out))
    del proto.metadata_props[:]
    for key, value in meta.items():
        proto.metadata_props.add(key=key, value=value)
    onnx.checker.check_model(proto)
    onnx.save(proto, str(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--scenes", type=int, default=12000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--act",
        choices=("silu", "relu"),
        default="silu",
        help="activation after every conv (silu: the shipped model; relu: the INT8 experiment)",
    )
    ap.add_argument(
        "--task", choices=("detect", "segment"), default="detect", help="segment: the yolov8-seg variant with masks"
    )
    ap.add_argument("--out", type=Path, default=Path("models/demo.onnx"))
    ap.add_argument("--eval-count", type=int, default=500)
    args = ap.parse_args()
    start = time.perf_counter()
    ema = train(args)
    minutes = (time.perf_counter() - start) / 60
    params = sum(p.numel() for p in ema.model.parameters())
    meta = {
        "description": "edged demo defect detector (scratch/spot/crack) trained on edged.sources.scenes",
        "version": __version__,
        "names": repr(dict(enumerate(CLASS_NAMES))),
        "stride": str(max(STRIDES)),
        "imgsz": f"[{SIZE}, {SIZE}]",
        "task": args.task,
        "color_order": "rgb",
        "layout": "nchw",
        "batch": "1",
    }
    export(ema.model, args.out, meta)
    args.out.with_suffix(".labels").write_text("\n".join(CLASS_NAMES) + "\n")
    print(
        json.dumps({"train_minutes": round(minutes, 1), "parameters": params, "onnx_bytes": args.out.stat().st_size}),
        flush=True,
    )
    if args.eval_count:
        model = load_model(ModelConfig(path=args.out, conf=0.001, iou=0.6, max_det=100), RuntimeConfig())
        total, samples = scene_samples(args.eval_count, seed=0, width=1280, height=720, outlines=model.task == "segment")
        report = evaluate(model, samples, total, report_conf=0.25)
        print(json.dumps(report.to_dict(), indent=2), flush=True)


if __name__ == "__main__":
    main()
