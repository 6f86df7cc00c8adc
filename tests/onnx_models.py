"""Small real ONNX models whose outputs are known for a given input.

The "colour probe" reports one fixed box whose class scores are the mean of the model's first
and last input channels (red and blue for an RGB model). Feeding it a pure red or blue frame
therefore tells a test exactly which class must come out, which catches a channel swap, a
layout mix-up or a wrong normalisation end to end, and the fixed box checks the letterbox
mapping back to frame pixels.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edged.engines import InferenceEngine

PROBE_BOX = (32.0, 24.0, 16.0, 12.0)  # cx, cy, w, h in input pixels of a 64x64 model


def probe_box(engine: InferenceEngine) -> tuple[float, ...]:
    """The probe's box (cx, cy, w, h) as ``engine`` runs it on a red input."""
    tensor = np.zeros((1, 3, 64, 64), np.float32)
    tensor[0, 0] = 1.0
    binding = engine.bind(tensor)
    binding.run()
    return tuple(float(v) for v in binding.outputs[0][0, :4, 0])


def damage_on_disk(path: Path, damage: str) -> None:
    """A model cache of the probe as a power cut (or a failing card) may leave it: ``"cut short"``, or
    ``"zeros"`` where the probe's box was."""
    data = path.read_bytes()
    if damage == "cut short":
        path.write_bytes(data[: len(data) // 2])
        return
    box = np.array([PROBE_BOX], np.float32).tobytes()
    assert data.count(box) == 1
    path.write_bytes(data.replace(box, bytes(len(box))))


LABELS = ("red", "blue")
CANDIDATES = 8  # the probe plus all-zero rows, so the head shape is unambiguous

_ONNX_TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.uint8: TensorProto.UINT8}


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name + "_v"))


def colour_probe(
    path: Path,
    *,
    layout: str = "nchw",
    head: str = "yolov8",
    batch: int | str = 1,
    size: int = 64,
    dtype: type[np.generic] = np.float32,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write the probe model to ``path`` and return it."""
    shape = [batch, 3, size, size] if layout == "nchw" else [batch, size, size, 3]
    spatial = [2, 3] if layout == "nchw" else [1, 2]
    nodes = [
        helper.make_node("Cast", ["images"], ["x"], to=TensorProto.FLOAT),
        _const("axes", np.array(spatial, np.int64)),
        helper.make_node("ReduceMean", ["x", "axes"], ["means4"], keepdims=1),
        _const("flat_shape", np.array([1, 3], np.int64)),
        helper.make_node("Reshape", ["means4", "flat_shape"], ["means"]),
        _const("first_last", np.array([0, 2], np.int64)),
        helper.make_node("Gather", ["means", "first_last"], ["scores"], axis=1),
        _const("box", np.array([PROBE_BOX], np.float32)),
    ]
    nodes += _head_nodes(head)
    out_shape = {"yolov8": [1, 6, CANDIDATES], "yolov5": [1, CANDIDATES, 7], "end2end": [1, CANDIDATES, 6]}[head]
    graph = helper.make_graph(
        nodes,
        "colour_probe",
        [helper.make_tensor_value_info("images", _ONNX_TYPES[dtype], shape)],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, out_shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    meta = {"names": str(dict(enumerate(LABELS)))}
    meta.update(metadata or {})
    helper.set_model_props(model, meta)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _head_nodes(head: str) -> list[onnx.NodeProto]:
    """Turn box [1,4] and scores [1,2] into the head layout, plus all-zero candidates."""
    if head == "yolov8":  # [1, 4+nc, N]: candidate 0 is the probe, candidate 1 scores 0
        return [
            helper.make_node("Concat", ["box", "scores"], ["row"], axis=1),
            _const("zero_row", np.zeros((CANDIDATES - 1, 6), np.float32)),
            helper.make_node("Concat", ["row", "zero_row"], ["rows"], axis=0),
            helper.make_node("Transpose", ["rows"], ["t"], perm=[1, 0]),
            _const("out_shape", np.array([1, 6, CANDIDATES], np.int64)),
            helper.make_node("Reshape", ["t", "out_shape"], ["output0"]),
        ]
    if head == "yolov5":  # [1, N, 5+nc] with objectness 1
        return [
            _const("obj", np.ones((1, 1), np.float32)),
            helper.make_node("Concat", ["box", "obj", "scores"], ["row"], axis=1),
            _const("zero_row", np.zeros((CANDIDATES - 1, 7), np.float32)),
            helper.make_node("Concat", ["row", "zero_row"], ["rows"], axis=0),
            _const("out_shape", np.array([1, CANDIDATES, 7], np.int64)),
            helper.make_node("Reshape", ["rows", "out_shape"], ["output0"]),
        ]
    # end2end [1, K, 6]: x1 y1 x2 y2 score class; the red score as class 0
    cx, cy, w, h = PROBE_BOX
    return [
        _const("xyxy", np.array([[cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]], np.float32)),
        _const("red_idx", np.array([0], np.int64)),
        helper.make_node("Gather", ["scores", "red_idx"], ["red"], axis=1),
        _const("cls", np.zeros((1, 1), np.float32)),
        helper.make_node("Concat", ["xyxy", "red", "cls"], ["row"], axis=1),
        _const("zero_row", np.zeros((CANDIDATES - 1, 6), np.float32)),
        helper.make_node("Concat", ["row", "zero_row"], ["rows"], axis=0),
        _const("out_shape", np.array([1, CANDIDATES, 6], np.int64)),
        helper.make_node("Reshape", ["rows", "out_shape"], ["output0"]),
    ]


def dynamic_probe(path: Path, *, metadata: Mapping[str, str] | None = None, dtype: type[np.generic] = np.float32) -> Path:
    """The colour probe as ultralytics' ``dynamic=True`` exports: input ``[batch, 3, height, width]``.

    It runs at any input size; its box stays where it is in input pixels.
    """
    model = onnx.load(str(colour_probe(path, metadata=metadata, dtype=dtype)))
    dims = model.graph.input[0].type.tensor_type.shape.dim
    for axis, name in ((0, "batch"), (2, "height"), (3, "width")):
        dims[axis].dim_param = name
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


SCENE_LABELS = ("scratch", "crack", "dust")


def fixed_scene(path: Path, candidates: list[tuple[float, float, float, float, int, float]]) -> Path:
    """A 64x64 yolov8 model that finds the same ``candidates`` (cx, cy, w, h in input pixels,
    class, score) in every frame, with the classes of `SCENE_LABELS`: a scene whose detections
    a test knows before any frame is seen."""
    nc = len(SCENE_LABELS)
    out = np.zeros((1, 4 + nc, max(len(candidates), 16)), np.float32)  # zero rows: more candidates than features
    for i, (cx, cy, w, h, cls, score) in enumerate(candidates):
        out[0, :4, i] = (cx, cy, w, h)
        out[0, 4 + cls, i] = score
    nodes = [
        helper.make_node("ReduceMean", ["images"], ["mean"], keepdims=0),
        _const("zero", np.zeros((), np.float32)),
        helper.make_node("Mul", ["mean", "zero"], ["nothing"]),  # the input is read, the output never changes
        _const("scene", out),
        helper.make_node("Add", ["scene", "nothing"], ["output0"]),
    ]
    graph = helper.make_graph(
        nodes,
        "fixed_scene",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 64, 64])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, list(out.shape))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    helper.set_model_props(model, {"names": str(dict(enumerate(SCENE_LABELS)))})
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def solid_frame(bgr: tuple[int, int, int], width: int = 128, height: int = 96) -> np.ndarray:
    frame = np.empty((height, width, 3), np.uint8)
    frame[:] = bgr
    return frame


def _save_with_side_branch(probe: onnx.ModelProto, zero: str, path: Path) -> Path:
    """Add the scalar ``zero`` (computed by nodes already appended) to the probe's output.

    The sum keeps the output unchanged but makes ONNX Runtime evaluate the side branch on
    every run, which is how the variants below stall or fail on demand.
    """
    for node in probe.graph.node:
        for i, name in enumerate(node.output):
            if name == "output0":
                node.output[i] = "output_raw"
    probe.graph.node.append(helper.make_node("Add", ["output_raw", zero], ["output0"]))
    onnx.checker.check_model(probe)
    onnx.save(probe, str(path))
    return path


def stalling_probe(path: Path, iterations_when_bright: int = 10**12) -> Path:
    """The colour probe behind a Loop whose trip count is how far the input's mean lies above
    0.5, times a huge number.

    A black frame, or the letterbox grey (0.45) the engine's warm-up run sees, runs zero
    iterations; a bright frame wedges inference inside ONNX Runtime for hours, which is exactly
    what a hung accelerator looks like to the daemon.
    """
    probe = onnx.load(str(colour_probe(path)))
    graph = probe.graph
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["acc_in", "one"], ["acc_out"])],
        "spin",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, []),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, []),
        ],
        initializer=[numpy_helper.from_array(np.array(1.0, np.float32), "one")],
    )
    graph.node.extend(
        [
            helper.make_node("ReduceMean", ["x"], ["brightness"], keepdims=0),
            _const("half", np.array(0.5, np.float32)),
            helper.make_node("Sub", ["brightness", "half"], ["above_half"]),
            helper.make_node("Relu", ["above_half"], ["excess"]),
            _const("spin_scale", np.array(float(iterations_when_bright), np.float32)),
            helper.make_node("Mul", ["excess", "spin_scale"], ["spins_f"]),
            helper.make_node("Cast", ["spins_f"], ["spins"], to=TensorProto.INT64),
            _const("cond", np.array(True)),
            _const("acc0", np.array(0.0, np.float32)),
            helper.make_node("Loop", ["spins", "cond", "acc0"], ["acc"], body=body),
            _const("acc_scale", np.array(0.0, np.float32)),
            helper.make_node("Mul", ["acc", "acc_scale"], ["zero"]),
        ]
    )
    return _save_with_side_branch(probe, "zero", path)


def slow_loading_probe(path: Path, additions: int = 7000) -> Path:
    """The colour probe beside a chain of ``additions`` scalar additions that end multiplied by
    zero: the output is unchanged and each run costs milliseconds, but ONNX Runtime takes about
    half a second to build the session (7,000 nodes), as a real detector's load does."""
    probe = onnx.load(str(colour_probe(path)))
    nodes = [helper.make_node("ReduceMean", ["x"], ["chain0"], keepdims=0), _const("step", np.array(1.0, np.float32))]
    nodes += [helper.make_node("Add", [f"chain{i}", "step"], [f"chain{i + 1}"]) for i in range(additions)]
    nodes += [
        _const("nought", np.array(0.0, np.float32)),
        helper.make_node("Mul", [f"chain{additions}", "nought"], ["zero"]),
    ]
    probe.graph.node.extend(nodes)
    return _save_with_side_branch(probe, "zero", path)


def failing_probe(path: Path, brighter_than: float = 0.5) -> Path:
    """The colour probe that raises inside ONNX Runtime on bright frames (mean above ``brighter_than``).

    A data-dependent Reshape to [7, -1] cannot divide the input's 3 * 64 * 64 values, which is
    the kind of run-time error a provider throws; dark frames run normally. Below 0 it fails on
    every run, its warm-up included, yet loads: ONNX Runtime cannot see the failure coming.
    """
    probe = onnx.load(str(colour_probe(path)))
    graph = probe.graph
    graph.node.extend(
        [
            helper.make_node("ReduceMean", ["x"], ["fail_brightness"], keepdims=0),
            _const("fail_limit", np.array(brighter_than, np.float32)),
            helper.make_node("Greater", ["fail_brightness", "fail_limit"], ["fail_bright"]),
            helper.make_node("Cast", ["fail_bright"], ["fail_bright_i"], to=TensorProto.INT64),
            _const("fail_six", np.array(6, np.int64)),
            helper.make_node("Mul", ["fail_bright_i", "fail_six"], ["fail_extra"]),
            _const("fail_one_i", np.array(1, np.int64)),
            helper.make_node("Add", ["fail_extra", "fail_one_i"], ["fail_rows"]),
            _const("fail_minus_one", np.array([-1], np.int64)),
            _const("fail_axis0", np.array([0], np.int64)),
            helper.make_node("Unsqueeze", ["fail_rows", "fail_axis0"], ["fail_rows1"]),
            helper.make_node("Concat", ["fail_rows1", "fail_minus_one"], ["fail_target"], axis=0),
            helper.make_node("Reshape", ["x", "fail_target"], ["fail_reshaped"]),
            helper.make_node("ReduceMax", ["fail_reshaped"], ["fail_peak"], keepdims=0),
            _const("fail_nothing", np.array(0.0, np.float32)),
            helper.make_node("Mul", ["fail_peak", "fail_nothing"], ["fail_zero"]),
        ]
    )
    return _save_with_side_branch(probe, "fail_zero", path)


def nan_probe(path: Path) -> Path:
    """The colour probe whose every output value is NaN on bright frames (mean above 0.5).

    The side branch is the square root of minus one on a bright frame and of zero otherwise, as a
    broken or overflowing model gives NaN on some inputs: dark frames, and the letterbox grey
    `edged check` first runs, come out as usual.
    """
    probe = onnx.load(str(colour_probe(path)))
    probe.graph.node.extend(
        [
            helper.make_node("ReduceMean", ["x"], ["nan_brightness"], keepdims=0),
            _const("nan_half", np.array(0.5, np.float32)),
            helper.make_node("Greater", ["nan_brightness", "nan_half"], ["nan_bright"]),
            helper.make_node("Cast", ["nan_bright"], ["nan_bright_f"], to=TensorProto.FLOAT),
            helper.make_node("Neg", ["nan_bright_f"], ["nan_minus"]),
            helper.make_node("Sqrt", ["nan_minus"], ["nan_zero"]),
        ]
    )
    return _save_with_side_branch(probe, "nan_zero", path)


def border_detector(
    path: Path,
    *,
    head: str = "yolov8",
    input_hw: tuple[int, int] = (320, 320),
    num_classes: int = 3,
    seed: int = 0,
    objects: int = 40,
    per_object: int = 10,
    top_k: int = 100,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """A detector whose candidates crowd around objects strewn over and across every edge.

    Each of ``objects`` objects gets ``per_object`` jittered candidate boxes that overlap each
    other heavily (IoU 0.3-0.9), of its class and now and then of a rival class; the objects lie
    all over the input and up to a tenth beyond it, so many candidates cross the input's edges and
    the content edges of any letterbox. A random projection of the frame's 16x16 average colours
    moves every box by a few pixels and every score a little, so the output depends on the frame
    the way a real detector's does. ``head`` picks the output layout: ``yolov8`` [1, 4+nc, N],
    ``yolov5`` [1, N, 5+nc] (objectness first) or ``end2end`` [1, top_k, 6] (the ``top_k`` best
    candidates by score, best first, boxes x1 y1 x2 y2, as a one-to-one head exports them).
    """
    rng = np.random.default_rng(seed)
    height, width = input_hw
    extent = np.array([width, height], np.float64)
    n_obj = objects * per_object
    n = n_obj + 64  # plus background candidates that rarely pass
    centre = rng.uniform(-0.1, 1.1, (objects, 2)) * extent
    size = rng.uniform(0.08, 0.4, (objects, 2)) * extent
    cxcy = np.repeat(centre, per_object, 0) + rng.normal(0, 0.05, (n_obj, 2)) * np.repeat(size, per_object, 0)
    wh = np.repeat(size, per_object, 0) * np.exp(rng.normal(0, 0.12, (n_obj, 2)))
    cxcy = np.concatenate([cxcy, rng.uniform(0, 1, (64, 2)) * extent])
    wh = np.concatenate([wh, rng.uniform(0.05, 0.3, (64, 2)) * extent])
    obj_class = np.repeat(rng.integers(0, num_classes, objects), per_object)
    logits = rng.uniform(-6.0, -2.0, (num_classes, n))
    logits[obj_class, np.arange(n_obj)] = rng.uniform(-1.5, 2.5, n_obj)
    rival = rng.random(n_obj) < 0.3
    rival_class = (obj_class + rng.integers(1, num_classes, n_obj)) % num_classes if num_classes > 1 else obj_class
    logits[rival_class[rival], np.flatnonzero(rival)] = rng.uniform(-1.5, 1.5, int(rival.sum()))
    logits[:, n_obj:] = rng.uniform(-5.0, -0.5, (num_classes, 64))
    if head == "yolov5":  # objectness: high for object candidates, the class probabilities as above
        objectness = np.concatenate([rng.uniform(0.0, 3.0, n_obj), rng.uniform(-4.0, 0.0, 64)])
        logits = np.concatenate([objectness[None], logits])
    rows = 4 + logits.shape[0]
    grid = 16
    bias = np.concatenate([np.zeros((4, n)), logits]).astype(np.float32)
    nodes = [
        helper.make_node(
            "AveragePool",
            ["images"],
            ["pooled"],
            kernel_shape=[height // grid, width // grid],
            strides=[height // grid, width // grid],
        ),
        _const("pooled_shape", np.array([3, grid * grid], np.int64)),
        helper.make_node("Reshape", ["pooled", "pooled_shape"], ["cells"]),
        _const("spread", (rng.normal(0, 3.0, (grid * grid, n)) / grid).astype(np.float32)),
        helper.make_node("MatMul", ["cells", "spread"], ["features"]),
        _const("mix", rng.normal(0, 0.5, (rows, 3)).astype(np.float32)),
        helper.make_node("MatMul", ["mix", "features"], ["mixed"]),
        _const("bias", bias),
        helper.make_node("Add", ["mixed", "bias"], ["raw"]),
        *_rows("raw", "raw_xy", 0, 2),
        helper.make_node("Tanh", ["raw_xy"], ["tanh_xy"]),
        _const("shift", np.array(6.0, np.float32)),
        helper.make_node("Mul", ["tanh_xy", "shift"], ["moved"]),
        _const("anchor_xy", cxcy.T.astype(np.float32)),
        helper.make_node("Add", ["moved", "anchor_xy"], ["cxcy"]),
        *_rows("raw", "raw_wh", 2, 4),
        helper.make_node("Tanh", ["raw_wh"], ["tanh_wh"]),
        _const("stretch", np.array(0.2, np.float32)),
        helper.make_node("Mul", ["tanh_wh", "stretch"], ["log_gain"]),
        helper.make_node("Exp", ["log_gain"], ["gain"]),
        _const("anchor_wh", wh.T.astype(np.float32)),
        helper.make_node("Mul", ["gain", "anchor_wh"], ["wh"]),
        *_rows("raw", "raw_scores", 4, rows),
        helper.make_node("Sigmoid", ["raw_scores"], ["probs"]),
    ]
    nodes += _border_head_nodes(head, n, rows, top_k)
    out_shape = {"yolov8": [1, rows, n], "yolov5": [1, n, rows], "end2end": [1, top_k, 6]}[head]
    graph = helper.make_graph(
        nodes,
        "border_detector",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, height, width])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, out_shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    meta = {"names": str({i: f"class{i}" for i in range(num_classes)})}
    meta.update(metadata or {})
    helper.set_model_props(model, meta)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _rows(source: str, name: str, start: int, end: int) -> list[onnx.NodeProto]:
    """``name = source[start:end]`` along axis 0."""
    return [
        _const(name + "_starts", np.array([start], np.int64)),
        _const(name + "_ends", np.array([end], np.int64)),
        _const(name + "_axes", np.array([0], np.int64)),
        helper.make_node("Slice", [source, name + "_starts", name + "_ends", name + "_axes"], [name]),
    ]


def _border_head_nodes(head: str, n: int, rows: int, top_k: int) -> list[onnx.NodeProto]:
    """Rows cx cy (2, N), w h (2, N) and sigmoid scores (rows-4, N) -> ``output0`` in the head's layout."""
    if head == "yolov8":
        return [
            helper.make_node("Concat", ["cxcy", "wh", "probs"], ["stacked"], axis=0),
            _const("out_shape", np.array([1, rows, n], np.int64)),
            helper.make_node("Reshape", ["stacked", "out_shape"], ["output0"]),
        ]
    if head == "yolov5":
        return [
            helper.make_node("Concat", ["cxcy", "wh", "probs"], ["stacked"], axis=0),
            helper.make_node("Transpose", ["stacked"], ["by_candidate"], perm=[1, 0]),
            _const("out_shape", np.array([1, n, rows], np.int64)),
            helper.make_node("Reshape", ["by_candidate", "out_shape"], ["output0"]),
        ]
    return [
        _const("half", np.array(0.5, np.float32)),
        helper.make_node("Mul", ["wh", "half"], ["half_wh"]),
        helper.make_node("Sub", ["cxcy", "half_wh"], ["x1y1"]),
        helper.make_node("Add", ["cxcy", "half_wh"], ["x2y2"]),
        _const("class_axis", np.array([0], np.int64)),
        helper.make_node("ReduceMax", ["probs", "class_axis"], ["best"], keepdims=1),
        helper.make_node("ArgMax", ["probs"], ["best_class_i"], axis=0, keepdims=1),
        helper.make_node("Cast", ["best_class_i"], ["best_class"], to=TensorProto.FLOAT),
        helper.make_node("Concat", ["x1y1", "x2y2", "best", "best_class"], ["stacked"], axis=0),
        helper.make_node("Transpose", ["stacked"], ["by_candidate"], perm=[1, 0]),
        _const("flat", np.array([n], np.int64)),
        helper.make_node("Reshape", ["best", "flat"], ["best_flat"]),
        _const("k", np.array([top_k], np.int64)),
        helper.make_node("TopK", ["best_flat", "k"], ["top_scores", "top_index"], axis=0, largest=1, sorted=1),
        helper.make_node("Gather", ["by_candidate", "top_index"], ["top_rows"], axis=0),
        _const("out_shape", np.array([1, top_k, 6], np.int64)),
        helper.make_node("Reshape", ["top_rows", "out_shape"], ["output0"]),
    ]


def reversed_classes(path: Path) -> Path:
    """``tests/data/tasks/cls.onnx`` with its scores handed out in reverse class order, under the same
    class names: a classifier that disagrees with it."""
    model = onnx.load(Path(__file__).parent / "data" / "tasks" / "cls.onnx")
    last = model.graph.node[-1]
    last.output[0] = "in_order"
    model.graph.initializer.append(numpy_helper.from_array(np.arange(4, -1, -1, dtype=np.int64), "reverse"))
    model.graph.node.append(helper.make_node("Gather", ["in_order", "reverse"], ["output0"], axis=1))
    onnx.save(model, path)
    return path
