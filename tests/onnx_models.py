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

PROBE_BOX = (32.0, 24.0, 16.0, 12.0)  # cx, cy, w, h in input pixels of a 64x64 model
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


def failing_probe(path: Path) -> Path:
    """The colour probe that raises inside ONNX Runtime on bright frames (mean above 0.5).

    A data-dependent Reshape to [7, -1] cannot divide the input's 3 * 64 * 64 values, which is
    the kind of run-time error a provider throws; dark frames run normally.
    """
    probe = onnx.load(str(colour_probe(path)))
    graph = probe.graph
    graph.node.extend(
        [
            helper.make_node("ReduceMean", ["x"], ["fail_brightness"], keepdims=0),
            _const("fail_half", np.array(0.5, np.float32)),
            helper.make_node("Greater", ["fail_brightness", "fail_half"], ["fail_bright"]),
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
