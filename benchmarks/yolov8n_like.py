"""A YOLOv8n-sized detector built with onnx.helper, so edged can be timed without trained weights.

The graph follows YOLOv8n layer for layer: Conv blocks with batch norm folded into the bias and
SiLU written as Sigmoid x Mul (as ultralytics exports it), C2f stages, SPPF, the top-down/bottom-up
neck and the decoupled DFL head at strides 8/16/32 with 80 sigmoid class scores, emitting the
ultralytics ``[1, 84, 8400]`` head at 640x640 (about 8.7 GFLOPs). Weights are random, so inference
costs what a real YOLOv8n costs while the outputs mean nothing.

Random class scores would put either none or thousands of candidates over the threshold, and
decode + NMS timings would be meaningless. The head is therefore calibrated: one run on a
scene measures the raw class logits, then the class branch is scaled and biased so that exactly
``candidates`` anchors score at or above ``conf`` on that scene (a similar number on others).

Writes the model (once: it is cached under its parameters) and prints its path, so that

    edged bench --model "$(python benchmarks/yolov8n_like.py)" --spinning off

(and likewise for each ``runtime.spinning`` setting) reproduces the YOLOv8n-sized figures of
BENCHMARKS.md. Needs the onnx package.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnx
import onnxruntime as ort
from graph_cost import graph_cost

from edged.geometry import BoxMap
from edged.preprocess import LETTERBOX_FILL
from edged.sources.scenes import SceneGenerator

BUILDER_VERSION = 1  # part of the cache name: bump when the graph changes
CACHE_DIR = Path(tempfile.gettempdir()) / "edged-bench"
STRIDES = (8, 16, 32)
REG_MAX = 16
NUM_CLASSES = 80
_SILU_GAIN = 1.7  # keeps activations near unit scale through the random stack
_BOX_LOGIT_STD = 1.5
_CLS_LOGIT_STD = 2.0


class _Graph:
    """Accumulates nodes and initialisers; tracks each tensor's channel count."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.channels: dict[str, int] = {}
        self._n = 0

    def _name(self, kind: str) -> str:
        self._n += 1
        return f"{kind}_{self._n}"

    def const(self, value: np.ndarray, kind: str = "c") -> str:
        name = self._name(kind)
        self.inits.append(onnx.numpy_helper.from_array(value, name))
        return name

    def node(self, op: str, inputs: list[str], channels: int | None = None, *, out: str | None = None, **attrs: Any) -> str:
        out = out or self._name(op.lower())
        self.nodes.append(onnx.helper.make_node(op, inputs, [out], **attrs))
        if channels is not None:
            self.channels[out] = channels
        return out

    def conv(
        self, x: str, c_out: int, k: int = 1, s: int = 1, *, act: bool = True, scale: float = 1.0, bias: float | None = None
    ) -> str:
        """Conv with folded batch norm (a bias), then SiLU unless ``act`` is False."""
        c_in = self.channels[x]
        std = (_SILU_GAIN if act else 1.0) / math.sqrt(c_in * k * k)
        w = (self.rng.standard_normal((c_out, c_in, k, k)) * std * scale).astype(np.float32)
        b = self.rng.normal(0.0, 0.1, c_out) if bias is None else np.full(c_out, bias)
        y = self.node(
            "Conv",
            [x, self.const(w, "w"), self.const(b.astype(np.float32), "b")],
            c_out,
            kernel_shape=[k, k],
            strides=[s, s],
            pads=[k // 2] * 4,
        )
        if not act:
            return y
        return self.node("Mul", [y, self.node("Sigmoid", [y])], c_out)

    def c2f(self, x: str, c_out: int, n: int, shortcut: bool) -> str:
        c = c_out // 2
        parts = list(self.split(self.conv(x, 2 * c, 1), 2))
        for _ in range(n):
            z = self.conv(self.conv(parts[-1], c, 3), c, 3)
            parts.append(self.node("Add", [parts[-1], z], c) if shortcut else z)
        return self.conv(self.concat(parts), c_out, 1)

    def sppf(self, x: str, c_out: int) -> str:
        y = self.conv(x, self.channels[x] // 2, 1)
        parts = [y]
        for _ in range(3):
            parts.append(
                self.node("MaxPool", [parts[-1]], self.channels[y], kernel_shape=[5, 5], strides=[1, 1], pads=[2, 2, 2, 2])
            )
        return self.conv(self.concat(parts), c_out, 1)

    def split(self, x: str, parts: int) -> tuple[str, ...]:
        """Equal parts along axis 1."""
        outs = tuple(self._name("split") for _ in range(parts))
        self.nodes.append(onnx.helper.make_node("Split", [x], list(outs), axis=1, num_outputs=parts))
        if x in self.channels:
            for o in outs:
                self.channels[o] = self.channels[x] // parts
        return outs

    def concat(self, xs: list[str]) -> str:
        return self.node("Concat", xs, sum(self.channels[x] for x in xs), axis=1)

    def upsample(self, x: str) -> str:
        scales = self.const(np.array([1, 1, 2, 2], np.float32), "scales")
        return self.node("Resize", [x, "", scales], self.channels[x], mode="nearest")


def _backbone_and_neck(g: _Graph, x: str) -> list[str]:
    """YOLOv8n (depth 0.33, width 0.25): returns the P3, P4, P5 feature maps."""
    x = g.conv(g.conv(x, 16, 3, 2), 32, 3, 2)
    x = g.c2f(x, 32, 1, True)
    p3 = g.c2f(g.conv(x, 64, 3, 2), 64, 2, True)
    p4 = g.c2f(g.conv(p3, 128, 3, 2), 128, 2, True)
    p5 = g.sppf(g.c2f(g.conv(p4, 256, 3, 2), 256, 1, True), 256)
    t4 = g.c2f(g.concat([g.upsample(p5), p4]), 128, 1, False)
    n3 = g.c2f(g.concat([g.upsample(t4), p3]), 64, 1, False)
    n4 = g.c2f(g.concat([g.conv(n3, 64, 3, 2), t4]), 128, 1, False)
    n5 = g.c2f(g.concat([g.conv(n4, 128, 3, 2), p5]), 256, 1, False)
    return [n3, n4, n5]


def _anchors(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Grid-cell centres [1, 2, A] in stride units and the stride of each anchor [1, 1, A]."""
    points, strides = [], []
    for s in STRIDES:
        n = size // s
        ys, xs = np.mgrid[0:n, 0:n].astype(np.float32) + 0.5
        points.append(np.stack([xs.ravel(), ys.ravel()]))
        strides.append(np.full(n * n, s, np.float32))
    return np.concatenate(points, 1)[None], np.concatenate(strides)[None, None]


def _head(
    g: _Graph, feats: list[str], size: int, box_scale: float, cls_scale: float, cls_bias: float
) -> tuple[str, str, str]:
    """Decoupled box (DFL) and class branches -> (output [1, 4+nc, A], raw box, raw class logits)."""
    box_parts, cls_parts = [], []
    for f in feats:
        box = g.conv(g.conv(g.conv(f, 64, 3), 64, 3), 4 * REG_MAX, act=False, scale=box_scale, bias=0.0)
        cls = g.conv(g.conv(g.conv(f, 80, 3), 80, 3), NUM_CLASSES, act=False, scale=cls_scale, bias=cls_bias)
        box_parts.append(g.node("Reshape", [box, g.const(np.array([1, 4 * REG_MAX, -1], np.int64))]))
        cls_parts.append(g.node("Reshape", [cls, g.const(np.array([1, NUM_CLASSES, -1], np.int64))]))
    box_raw = g.node("Concat", box_parts, axis=2)
    cls_raw = g.node("Concat", cls_parts, axis=2)
    dist = g.node("Reshape", [box_raw, g.const(np.array([1, 4, REG_MAX, -1], np.int64))])
    prob = g.node("Softmax", [dist], axis=2)
    proj = g.const(np.arange(REG_MAX, dtype=np.float32).reshape(1, 1, REG_MAX, 1))
    ltrb = g.node("ReduceSum", [g.node("Mul", [prob, proj]), g.const(np.array([2], np.int64))], keepdims=0)
    lt, rb = g.split(ltrb, 2)
    anchors, strides = _anchors(size)
    a = g.const(anchors, "anchors")
    x1y1, x2y2 = g.node("Sub", [a, lt]), g.node("Add", [a, rb])
    centre = g.node("Mul", [g.node("Add", [x1y1, x2y2]), g.const(np.array(0.5, np.float32))])
    wh = g.node("Sub", [x2y2, x1y1])
    xywh = g.node("Mul", [g.node("Concat", [centre, wh], axis=1), g.const(strides, "strides")])
    out = g.node("Concat", [xywh, g.node("Sigmoid", [cls_raw])], axis=1, out="output0")
    return out, box_raw, cls_raw


def _calibration_input(size: int) -> np.ndarray:
    """Scene 0 letterboxed exactly as edged does it: RGB, /255, NCHW float32."""
    frame = SceneGenerator(1280, 720, seed=0).render(0).image
    m = BoxMap.letterbox(1280, 720, size, size)
    canvas = np.full((size, size, 3), LETTERBOX_FILL, np.uint8)
    canvas[m.pad_y : m.pad_y + m.resized_h, m.pad_x : m.pad_x + m.resized_w] = cv2.resize(
        frame, (m.resized_w, m.resized_h), interpolation=cv2.INTER_LINEAR
    )
    return np.ascontiguousarray(canvas[..., ::-1].transpose(2, 0, 1)[None], np.float32) / 255.0


def _model(size: int, seed: int, box_scale: float, cls_scale: float, cls_bias: float, raw_outputs: bool) -> Any:
    g = _Graph(np.random.default_rng(seed))
    g.channels["images"] = 3
    out, box_raw, cls_raw = _head(g, _backbone_and_neck(g, "images"), size, box_scale, cls_scale, cls_bias)
    n = sum((size // s) ** 2 for s in STRIDES)
    f32 = onnx.TensorProto.FLOAT
    outputs = [onnx.helper.make_tensor_value_info(out, f32, [1, 4 + NUM_CLASSES, n])]
    if raw_outputs:
        outputs += [
            onnx.helper.make_tensor_value_info(box_raw, f32, [1, 4 * REG_MAX, n]),
            onnx.helper.make_tensor_value_info(cls_raw, f32, [1, NUM_CLASSES, n]),
        ]
    graph = onnx.helper.make_graph(
        g.nodes,
        "yolov8n_like",
        [onnx.helper.make_tensor_value_info("images", f32, [1, 3, size, size])],
        outputs,
        initializer=g.inits,
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.helper.set_model_props(
        model,
        {
            "description": "edged timing model: YOLOv8n layout, random weights, calibrated head",
            "names": repr({i: f"class{i}" for i in range(NUM_CLASSES)}),
            "stride": str(max(STRIDES)),
            "imgsz": f"[{size}, {size}]",
            "task": "detect",
            "color_order": "rgb",
            "layout": "nchw",
            "batch": "1",
        },
    )
    return model


def build_yolov8n_like(path: Path, *, size: int = 640, candidates: int = 64, conf: float = 0.25, seed: int = 0) -> Path:
    """Write the calibrated timing model to ``path``; ``size`` must be a multiple of 32."""
    if size < 32 or size % 32:
        raise ValueError(f"size must be a positive multiple of 32, got {size}")
    probe = _model(size, seed, 1.0, 1.0, 0.0, raw_outputs=True)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    _, box_raw, cls_raw = session.run(None, {"images": _calibration_input(size)})
    cls_scale = _CLS_LOGIT_STD / float(cls_raw.std())
    best = np.sort(cls_raw[0].max(axis=0)) * cls_scale
    k = min(max(candidates, 1), best.size - 1)
    # Halfway between the k-th and (k+1)-th best anchor: float noise cannot move either across.
    cls_bias = math.log(conf / (1.0 - conf)) - float(best[-k] + best[-k - 1]) / 2.0
    model = _model(size, seed, _BOX_LOGIT_STD / float(box_raw.std()), cls_scale, cls_bias, raw_outputs=False)
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    onnx.save(model, str(partial))
    partial.replace(path)
    return path


def cached_yolov8n(cache_dir: Path, *, size: int = 640, candidates: int = 64, conf: float = 0.25) -> Path:
    """The timing model from ``cache_dir``, built on first use."""
    conf_tag = f"{conf:g}".replace(".", "p")
    path = cache_dir / f"yolov8n-like-{size}-c{candidates}-conf{conf_tag}-v{BUILDER_VERSION}.onnx"
    if not path.is_file():
        build_yolov8n_like(path, size=size, candidates=candidates, conf=conf)
    return path


def conv_count(path: Path) -> int:
    """Convolutions in the graph (YOLOv8n has 63: 57 in its Conv blocks, 6 final head convs)."""
    return sum(node.op_type == "Conv" for node in onnx.load(str(path)).graph.node)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=640, help="input size, a multiple of 32 (default 640)")
    parser.add_argument(
        "--candidates", type=int, default=64, help="anchors at or above conf on the bench frame (default 64)"
    )
    parser.add_argument("--conf", type=float, default=0.25, help="the conf they are calibrated to (default 0.25)")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help=f"where the model is kept (default {CACHE_DIR})")
    parser.add_argument("--stats", action="store_true", help="also print GFLOPs, parameters and convolutions (to stderr)")
    args = parser.parse_args(argv)
    if args.size < 32 or args.size % 32:
        parser.error(f"--size must be a positive multiple of 32, got {args.size}")
    path = cached_yolov8n(args.cache_dir, size=args.size, candidates=args.candidates, conf=args.conf)
    if args.stats:
        gflops, params = graph_cost(path)
        print(f"{gflops:.2f} GFLOPs, {params / 1e6:.2f} M parameters, {conv_count(path)} convolutions", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
