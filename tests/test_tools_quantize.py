"""``edged quantize`` on a small conv detector built with onnx.helper: contract, QDQ, float head."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import subprocess
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from daemon import edged_command, run_cli
from onnx import TensorProto, helper, numpy_helper
from onnx_models import colour_probe, reversed_classes

from edged.cli import SUBCOMMANDS
from edged.config import ModelConfig, RuntimeConfig
from edged.engines import file_sha256
from edged.errors import EXIT_CONFIG, EXIT_DATA, EXIT_FAILURE, EXIT_USAGE, DataError, QuantizeError, UsageError
from edged.files import write_with
from edged.model import LoadedModel, load_model
from edged.preprocess import Preprocessor
from edged.sources.scenes import CLASS_NAMES
from edged.tools import quantize as q
from edged.tools.evaluate import EvalSample, folder_samples, scene_samples

TASKS = Path(__file__).parent / "data" / "tasks"
DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.onnx"

pytestmark = pytest.mark.tools

SIZE, STRIDE, NC = 64, 8, 3  # three classes, as the generated scenes
CELLS = SIZE // STRIDE
DECODE_OPS = {"Softplus", "Sigmoid", "Sub", "Add", "Div", "Concat"}


def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float = 1.0) -> onnx.TensorProto:
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    value = rng.normal(0, scale * np.sqrt(2 / fan_in), shape).astype(np.float32)
    return numpy_helper.from_array(value, name)


def _backbone(rng: np.random.Generator) -> tuple[list[onnx.TensorProto], list[onnx.NodeProto], str]:
    """Three stride-2 Conv+Relu layers: [1, 3, 64, 64] -> [1, 16, 8, 8]."""
    inits, nodes, x, c_in = [], [], "images", 3
    for i, c_out in enumerate((8, 16, 16)):
        inits += [_init(rng, f"w{i}", (c_out, c_in, 3, 3)), _init(rng, f"b{i}", (c_out,), 0.1)]
        nodes += [
            helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], f"conv{i}", strides=[2, 2], pads=[1] * 4),
            helper.make_node("Relu", [f"c{i}"], [f"r{i}"], f"relu{i}"),
        ]
        x, c_in = f"r{i}", c_out
    return inits, nodes, x


def _save(path: Path, nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], out_channels: int) -> Path:
    graph = helper.make_graph(
        nodes,
        path.stem,
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, out_channels, CELLS * CELLS])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    # The generated scenes' classes: scored on them, a model of other classes is refused.
    helper.set_model_props(model, {"names": str(dict(enumerate(CLASS_NAMES[:NC])))})
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def tiny_detector(path: Path, *, with_decode: bool = True) -> Path:
    """The backbone, box and class 1x1 convs, then a yolov8 decode to [1, 4+nc, N]; without the
    decode the class conv's flattened output is the model's output."""
    rng = np.random.default_rng(7)
    inits, nodes, x = _backbone(rng)
    grid = (np.stack(np.meshgrid(np.arange(CELLS), np.arange(CELLS)), 0).reshape(1, 2, -1) + 0.5) * STRIDE
    inits += [
        _init(rng, "wb", (4, 16, 1, 1)),
        _init(rng, "wc", (NC, 16, 1, 1)),
        numpy_helper.from_array(np.array([1, -1, CELLS * CELLS], np.int64), "flat"),
        numpy_helper.from_array(grid.astype(np.float32), "points"),
        numpy_helper.from_array(np.array(STRIDE, np.float32), "stride"),
        numpy_helper.from_array(np.array(2, np.float32), "two"),
    ]
    nodes += [
        helper.make_node("Conv", [x, "wc"], ["cls4"], "cls_conv"),
        helper.make_node("Reshape", ["cls4", "flat"], ["cls" if with_decode else "output0"], "cls_flat"),
    ]
    if not with_decode:
        return _save(path, nodes, inits, NC)
    nodes += [
        helper.make_node("Conv", [x, "wb"], ["box4"], "box_conv"),
        helper.make_node("Reshape", ["box4", "flat"], ["box"], "box_flat"),
        helper.make_node("Softplus", ["box"], ["sp"], "softplus"),
        helper.make_node("Mul", ["sp", "stride"], ["dist"], "dist"),
        helper.make_node("Split", ["dist"], ["lt", "rb"], "split", axis=1, num_outputs=2),
        helper.make_node("Sub", ["points", "lt"], ["x1y1"], "x1y1"),
        helper.make_node("Add", ["points", "rb"], ["x2y2"], "x2y2"),
        helper.make_node("Add", ["x1y1", "x2y2"], ["twice_c"], "twice_c"),
        helper.make_node("Div", ["twice_c", "two"], ["cxcy"], "cxcy"),
        helper.make_node("Sub", ["x2y2", "x1y1"], ["wh"], "wh"),
        helper.make_node("Sigmoid", ["cls"], ["scores"], "scores"),
        helper.make_node("Concat", ["cxcy", "wh", "scores"], ["output0"], "output", axis=1),
    ]
    return _save(path, nodes, inits, 4 + NC)


def dfl_detector(path: Path, bins: int = 4) -> Path:
    """An ultralytics-style DFL box branch: softmax over bins, then a fixed 1x1 Conv that takes
    the expectation, all on tensors shaped by the N candidates."""
    rng = np.random.default_rng(8)
    inits, nodes, x = _backbone(rng)
    n = CELLS * CELLS
    inits += [
        _init(rng, "wb", (4 * bins, 16, 1, 1)),
        _init(rng, "wc", (NC, 16, 1, 1)),
        numpy_helper.from_array(np.arange(bins, dtype=np.float32).reshape(1, bins, 1, 1), "proj"),
        numpy_helper.from_array(np.array([1, 4, bins, n], np.int64), "bins_shape"),
        numpy_helper.from_array(np.array([1, 4, n], np.int64), "box_shape"),
        numpy_helper.from_array(np.array([1, NC, n], np.int64), "cls_shape"),
    ]
    nodes += [
        helper.make_node("Conv", [x, "wb"], ["box4"], "box_conv"),
        helper.make_node("Reshape", ["box4", "bins_shape"], ["bins"], "dfl_reshape"),
        helper.make_node("Transpose", ["bins"], ["bins_t"], "dfl_transpose", perm=[0, 2, 1, 3]),
        helper.make_node("Softmax", ["bins_t"], ["prob"], "dfl_softmax", axis=1),
        helper.make_node("Conv", ["prob", "proj"], ["dist4"], "dfl_conv"),
        helper.make_node("Reshape", ["dist4", "box_shape"], ["dist"], "dist"),
        helper.make_node("Conv", [x, "wc"], ["cls4"], "cls_conv"),
        helper.make_node("Reshape", ["cls4", "cls_shape"], ["cls"], "cls_flat"),
        helper.make_node("Sigmoid", ["cls"], ["scores"], "scores"),
        helper.make_node("Concat", ["dist", "scores"], ["output0"], "output", axis=1),
    ]
    return _save(path, nodes, inits, 4 + NC)


def _load(path: Path) -> LoadedModel:
    return load_model(ModelConfig(path=path, conf=0.001), RuntimeConfig())


def _frames(model: LoadedModel, count: int, seed: int) -> q.CalibrationFrames:
    total, frames = scene_samples(count, seed, 320, 240)
    return q.CalibrationFrames(model.contract, frames, total)


def _interface(path: Path) -> list[tuple[str, object, str]]:
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [(a.name, a.shape, a.type) for a in (*s.get_inputs(), *s.get_outputs())]


def _quantised_tensors(model: onnx.ModelProto) -> set[str]:
    return {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One FP32 model quantised three ways (the default; head quantised too; stem quantised too,
    taking pixels), shared by the tests."""
    root = tmp_path_factory.mktemp("quantize")
    fp32 = tiny_detector(root / "tiny.onnx")
    model = _load(fp32)
    heads = {}
    for exclude in (True, False):
        out = root / f"tiny.{'head' if exclude else 'all'}.int8.onnx"
        heads[exclude] = q.quantize(fp32, out, _frames(model, 12, 1), exclude_head=exclude, pixel_input=1 / 255)
    pixels = q.quantize(fp32, root / "tiny.pixels.int8.onnx", _frames(model, 12, 1), float_stem=False, pixel_input=1 / 255)
    return {
        "fp32": fp32,
        "model": model,
        "default": heads[True],
        "no_head": heads[False],
        "pixels": pixels,
        "int8": root / "tiny.head.int8.onnx",
        "int8_all": root / "tiny.all.int8.onnx",
        "int8_pixels": root / "tiny.pixels.int8.onnx",
    }


def test_quantised_model_keeps_the_contract_and_is_qdq(built: dict[str, Any]) -> None:
    assert not built["default"].pixel_input  # the float stem reads the float input
    assert _interface(built["int8"]) == _interface(built["fp32"])
    assert _interface(built["int8"])[0] == ("images", [1, 3, SIZE, SIZE], "tensor(float)")
    ops = {n.op_type for n in onnx.load(str(built["int8"])).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= ops
    quantised = q.load_quantised(built["int8"], built["model"])  # loads as the daemon would
    assert quantised.num_classes == NC and quantised.head == "yolov8"


def test_weights_are_int8_per_channel(built: dict[str, Any]) -> None:
    graph = onnx.load(str(built["int8"])).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    conv_weights = [
        n.input[0]
        for n in graph.node
        if n.op_type == "DequantizeLinear" and inits.get(n.input[0]) is not None and inits[n.input[0]].ndim == 4
    ]
    assert len(conv_weights) == 4  # the fifth, conv0, reads the image and stays float
    assert all(inits[w].dtype == np.int8 for w in conv_weights)
    conv0 = next(n for n in graph.node if n.name == "conv0")
    assert conv0.op_type == "Conv" and inits[conv0.input[1]].dtype == np.float32
    scales = [n.input[1] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in conv_weights]
    assert all(inits[s].size > 1 for s in scales)  # one scale per output channel


def test_head_nodes_are_found_and_stay_float(built: dict[str, Any]) -> None:
    head = built["default"].head
    assert DECODE_OPS <= set(head.nodes.values())
    assert "Conv" not in head.nodes.values() and "Relu" not in head.nodes.values()
    assert {"softplus", "dist", "split", "x1y1", "cxcy", "wh", "scores", "output"} <= set(head.nodes)
    graph = onnx.load(str(built["int8"])).graph
    kept = {n.name: n for n in graph.node if n.name in head.nodes}
    assert {name: n.op_type for name, n in kept.items()} == head.nodes  # still float ops, same names
    head_outputs = {t for n in kept.values() for t in n.output}
    assert not head_outputs & _quantised_tensors(onnx.load(str(built["int8"])))
    # Without the exclusion the same tensors are quantised: the check above can fail.
    assert head_outputs & _quantised_tensors(onnx.load(str(built["int8_all"])))
    assert built["no_head"].head.nodes == {}


def test_the_convolutions_reading_the_image_are_the_stem(built: dict[str, Any]) -> None:
    assert built["default"].stem.nodes == {"conv0": "Conv"} and "slower than float" in built["default"].stem.reason
    assert built["pixels"].stem.nodes == {}
    for path, weights in ((built["int8"], "float"), (built["int8_pixels"], "DequantizeLinear")):
        graph = onnx.load(str(path)).graph
        producers = {t: n.op_type for n in graph.node for t in n.output}
        conv0 = next(n for n in graph.node if n.name == "conv0")
        assert producers.get(conv0.input[1], "float") == weights  # int8 weights reach a Conv through a DQ
    model = onnx.load(str(built["fp32"]))
    assert q.find_stem(model).nodes == {"conv0": "Conv"}
    # Models of IR version 3 also list every weight among the graph inputs.
    model.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in model.graph.initializer)
    assert q.find_stem(model).nodes == {"conv0": "Conv"}


def test_outputs_stay_close_to_fp32(built: dict[str, Any]) -> None:
    fp32, int8 = (ort.InferenceSession(str(built[k]), providers=["CPUExecutionProvider"]) for k in ("fp32", "int8"))
    contract = built["model"].contract
    _, frames = scene_samples(6, 1000, 320, 240)  # scenes calibration never saw
    plan = Preprocessor(contract, 320, 240)
    everything = ort.InferenceSession(str(built["int8_all"]), providers=["CPUExecutionProvider"])
    for frame in frames:
        x = {"images": plan(frame.image).copy()}
        a, b = fp32.run(None, x)[0][0], int8.run(None, x)[0][0]
        span = float(a[:4].max() - a[:4].min())  # box coordinates cover ~57 input pixels
        assert np.abs(a[:4] - b[:4]).max() < 0.01 * span
        assert np.abs(a[4:] - b[4:]).max() < 0.02  # scores, 0..1
        # With the head quantised too, scores share one uint8 scale with pixel coordinates.
        assert np.abs(a[4:] - everything.run(None, x)[0][0][4:]).max() > 0.05


def test_pixel_input_model_takes_uint8_pixels_and_matches_fp32(built: dict[str, Any]) -> None:
    assert built["pixels"].pixel_input
    path = built["int8_pixels"]
    assert _interface(path)[0] == ("images", [1, 3, SIZE, SIZE], "tensor(uint8)")
    assert _interface(path)[1:] == _interface(built["fp32"])[1:]
    graph = onnx.load(str(path)).graph
    readers = [n for n in graph.node if "images" in n.input]
    assert [n.op_type for n in readers] == ["DequantizeLinear"]  # no QuantizeLinear left on the input
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    assert inits[readers[0].input[1]] == np.float32(1 / 255) and inits[readers[0].input[2]] == 0
    quantised = q.load_quantised(path, built["model"], pixel_input=True)
    assert quantised.contract.dtype is np.uint8
    assert quantised.contract.describe().endswith(
        "uint8 nchw rgb letterbox pixels as they are (the model normalises inside)"
    )
    fp32 = ort.InferenceSession(str(built["fp32"]), providers=["CPUExecutionProvider"])
    pixels = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    float_plan, pixel_plan = Preprocessor(built["model"].contract, 320, 240), Preprocessor(quantised.contract, 320, 240)
    _, frames = scene_samples(4, 1000, 320, 240)
    for frame in frames:
        a = fp32.run(None, {"images": float_plan(frame.image)})[0][0]
        b = pixels.run(None, {"images": pixel_plan(frame.image)})[0][0]
        assert np.abs(a[:4] - b[:4]).max() < 0.01 * float(a[:4].max() - a[:4].min())
        assert np.abs(a[4:] - b[4:]).max() < 0.02


def test_pixel_input_needs_a_plain_scale_and_an_input_only_quantised(built: dict[str, Any]) -> None:
    contract = built["model"].contract
    assert q.pixel_scale(contract) == pytest.approx(1 / 255)
    assert q.pixel_scale(replace(contract, mean=(0.485, 0.456, 0.406))) is None
    assert q.pixel_scale(replace(contract, std=(0.229, 0.224, 0.225))) is None
    model = onnx.load(str(built["fp32"]))
    assert not q.read_pixels(model, "images")  # the float input feeds a Conv: left as it is
    assert model == onnx.load(str(built["fp32"]))


def test_unfamiliar_graphs_exclude_nothing_without_crashing(tmp_path: Path) -> None:
    probe = q.find_head(onnx.load(str(colour_probe(tmp_path / "probe.onnx"))))
    assert probe.nodes == {} and "excluding nothing" in probe.reason
    conv_out = q.find_head(onnx.load(str(tiny_detector(tmp_path / "bare.onnx", with_decode=False))))
    assert set(conv_out.nodes) == {"cls_flat"}  # only the reshape after the last conv
    dfl = q.find_head(onnx.shape_inference.infer_shapes(onnx.load(str(dfl_detector(tmp_path / "dfl.onnx")))))
    assert {"dfl_reshape", "dfl_transpose", "dfl_softmax", "dfl_conv", "dist", "scores", "output"} <= set(dfl.nodes)
    assert not {"conv0", "conv1", "conv2", "box_conv", "cls_conv"} & set(dfl.nodes)
    assert "candidate axis" in dfl.reason
    bare = onnx.load(str(tiny_detector(tmp_path / "tiny.onnx")))
    del bare.graph.value_info[:]
    bare.graph.output[0].type.tensor_type.shape.dim[2].dim_param = "N"  # no shapes, symbolic N
    assert DECODE_OPS <= set(q.find_head(bare).nodes.values())


def test_chunks_divide_the_frame_count() -> None:
    assert [q.chunk_size(n) for n in (200, 12, 13, 1, 500)] == [10, 12, 13, 1, 10]


def test_cli_rejects_a_missing_or_corrupt_model(tmp_path: Path) -> None:
    missing = run_cli("quantize", "--model", str(tmp_path / "nope.onnx"), "--out", str(tmp_path / "o.onnx"))
    assert missing.returncode == EXIT_CONFIG and "does not exist" in missing.stderr
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"not a model")
    bad = run_cli("quantize", "--model", str(corrupt), "--out", str(tmp_path / "o.onnx"))
    assert bad.returncode == EXIT_CONFIG and "quantize failed" in bad.stderr
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.unit
def test_verdicts_are_compared_under_the_configured_cameras_inspection(tmp_path: Path) -> None:
    # Its [source.inspect] keys over [inspect], as the daemon judges: [inspect] alone lacked the
    # camera's mm_per_px, and the comparison failed (exit 78) after the calibration.
    config = tmp_path / "edged.toml"
    config.write_text(
        '[[source]]\ntype = "synthetic"\ncamera_id = "a"\n\n[[source]]\ntype = "synthetic"\ncamera_id = "b"\n\n'
        f'[source.inspect]\nmm_per_px = 0.05\n\n[model]\npath = "{TASKS / "seg.onnx"}"\nconf = 0.4\n\n'
        "[inspect]\nmax_area_mm2 = { spot = 1.0 }\n"
    )
    first, conf = q._inspection(config, None)
    second, _ = q._inspection(config, "b")
    assert first is not None and second is not None and conf == 0.4
    assert (first.mm_per_px, second.mm_per_px, second.max_area_mm2) == (None, 0.05, {"spot": 1.0})
    with pytest.raises(UsageError, match="the configuration's cameras are a, b"):
        q._inspection(config, "c")
    with pytest.raises(UsageError, match="give the configuration too"):
        q._inspection(None, "a")


def test_an_anomaly_model_is_refused_before_any_work(tmp_path: Path) -> None:
    # Before: it was calibrated, then failed inside onnxruntime's shape inference with a TypeError. Then
    # it was refused as a usage error (exit 2), though no option makes quantize serve it: the model must change.
    out = tmp_path / "o.onnx"
    padim = TASKS.parent / "anomaly" / "padim.onnx"
    anomaly = run_cli("quantize", "--model", str(padim), "--out", str(out))
    assert anomaly.returncode == EXIT_CONFIG, anomaly.stderr
    served = "edged quantize serves detection, segmentation and classification models only"
    assert f"--model {padim} is an anomaly model, and {served}" in anomaly.stderr
    assert "give --model a detection, segmentation or classification model" in anomaly.stderr
    assert "calibrating" not in anomaly.stderr and not out.exists()
    help_text = next(text for name, _, text, _ in SUBCOMMANDS if name == "quantize")
    assert "78 for an unusable model or data (an anomaly model included)" in help_text


def test_a_classifier_is_compared_by_its_best_class_and_its_verdicts(tmp_path: Path) -> None:
    # Before: the comparison was of boxes, and failed after the calibration and the timing.
    out, report, config = tmp_path / "o.onnx", tmp_path / "report.json", tmp_path / "edged.toml"
    config.write_text(
        f'[model]\npath = "{TASKS / "cls.onnx"}"\n\n[inspect]\nng_classes = ["scratch", "dent", "stain", "crack"]\n'
    )
    made = run_cli(
        "quantize",
        "--model",
        str(TASKS / "cls.onnx"),
        "--out",
        str(out),
        "--eval-scenes",
        "6",
        "--calib-scenes",
        "2",
        "--latency-frames",
        "0",
        "--config",
        str(config),
        "--report",
        str(report),
    )
    assert made.returncode == 0 and out.is_file(), made.stderr
    assert "a classifier's softmax" in made.stdout
    agreed = json.loads(report.read_text())["accuracy"]["agreement"]
    # This small test classifier tells scenes apart by pooled features a few thousandths apart,
    # under one INT8 step: its best class changes on most scenes, which the report is there to say.
    assert agreed["images"] == 6 and 0.0 <= agreed["top1_agree"] <= 1.0 and agreed["verdicts_agree"] is not None
    assert f"agreement with FP32's best class on 6 image(s): {100 * agreed['top1_agree']:.1f} %" in made.stdout


@pytest.mark.unit
def test_class_agreement_names_the_images_whose_best_class_or_verdict_changes(tmp_path: Path) -> None:
    from edged.settings.inspect import InspectConfig
    from edged.tools.agreement import class_agreement

    reference = load_model(ModelConfig(path=TASKS / "cls.onnx"), RuntimeConfig())
    reversed_ = load_model(ModelConfig(path=reversed_classes(tmp_path / "reversed.onnx")), RuntimeConfig())
    images = [TASKS / name for name in ("square.png", "wide.png", "tall.png", "strip.png")]

    def samples() -> Iterator[EvalSample]:
        empty = np.zeros((0, 4), np.float32), np.zeros(0, np.int64), ()
        return (EvalSample(p.name, cv2.imread(str(p)), *empty) for p in images)

    inspect = InspectConfig(ng_classes=["scratch", "dent", "stain", "crack"])
    same = class_agreement(reference, reference, samples(), inspect=inspect)
    assert (same.top1_agree, same.changed, same.verdicts_agree, same.flipped) == (1.0, [], 1.0, [])
    other = class_agreement(reference, reversed_, samples(), inspect=inspect)
    assert other.top1_agree < 1.0 and other.changed and set(other.changed) <= {p.name for p in images}
    assert other.verdicts_agree is not None and len(other.flipped) == round(4 * (1 - other.verdicts_agree))


def test_unloadable_result_fails_with_a_message(
    built: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(src: Path, dst: Path, frames: q.CalibrationFrames, **_: object) -> q.Quantised:
        dst.write_bytes(b"truncated")
        return q.Quantised(q.FloatNodes({}, "test"), q.FloatNodes({}, "test"), pixel_input=False)

    monkeypatch.setattr(q, "quantize", broken)
    out = tmp_path / "x.onnx"
    with pytest.raises(QuantizeError, match=f"the quantised model {re.escape(str(out))} does not load") as raised:
        q.run_quantize(_run_args(built["fp32"], out))
    assert raised.value.exit_code == EXIT_FAILURE
    assert list(tmp_path.iterdir()) == []  # nothing at --out for a deploy to take, and no part file left


def _run_args(model: Path, out: Path, report: Path | None = None) -> argparse.Namespace:
    """`run_quantize`'s arguments as the command line gives them: two calibration scenes, no comparison."""
    return argparse.Namespace(
        model=model,
        out=out,
        calib_images=None,
        calib_scenes=2,
        seed=1,
        method="minmax",
        exclude_head=True,
        reduce_range=False,
        float_stem=True,
        threads=0,
        eval_scenes=0,
        eval_seed=0,
        latency_frames=0,
        data=None,
        config=None,
        camera=None,
        report=report,
    )


def test_the_report_describes_the_model_this_run_wrote_when_another_run_replaces_it_at_out(
    built: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two runs writing one --out each move their model there whole, and the last wins; but each
    # run loaded --out after its move to hash and measure it, so the first run's report could
    # describe the other run's model.
    out, report = tmp_path / "tiny.int8.onnx", tmp_path / "report.json"
    moved: list[str] = []

    def then_another_run_moves_its_model_there(path: Path, write: Callable[[Path], object]) -> None:
        write_with(path, write)
        if path == out:
            moved.append(file_sha256(out))
            other = tmp_path / ".other.part.onnx"
            other.write_bytes(built["int8_all"].read_bytes())
            os.replace(other, out)

    monkeypatch.setattr(q, "write_with", then_another_run_moves_its_model_there)
    assert q.run_quantize(_run_args(built["fp32"], out, report), io.StringIO()) == 0
    assert moved and file_sha256(out) == file_sha256(built["int8_all"]) != moved[0]
    assert json.loads(report.read_text())["int8_sha256"] == moved[0]


def test_cli_writes_the_report(built: dict[str, Any], tmp_path: Path) -> None:
    out, report = tmp_path / "tiny.int8.onnx", tmp_path / "report.json"
    result = run_cli(
        "quantize",
        "--model",
        str(built["fp32"]),
        "--out",
        str(out),
        "--calib-scenes",
        "8",
        "--eval-scenes",
        "3",
        "--latency-frames",
        "5",
        "--threads",
        "1",
        "--report",
        str(report),
    )
    assert result.returncode == 0, result.stderr
    assert "kept in float" in result.stdout and "softplus (Softplus)" in result.stdout
    assert "mAP@0.5" in result.stdout and "ms per frame" in result.stdout
    doc = json.loads(report.read_text())
    assert "input: float32, as the original: the float stem reads it" in result.stdout
    assert "ms inference" in result.stdout
    assert doc["quantization"] == {
        "format": "QDQ",
        "weights": "int8 per-channel",
        "activations": "uint8",
        "input": "images [1, 3, 64, 64] float32 nchw rgb letterbox scale=0.00392157 "
        "mean=[0.0, 0.0, 0.0] std=[1.0, 1.0, 1.0]",
        "reduce_range": False,
        "calibration_method": "percentile",
        "calibration_data": "scenes seed=1 n=8",
    }
    assert DECODE_OPS <= set(doc["excluded_nodes"].values()) and doc["excluded_nodes"]["conv0"] == "Conv"
    assert doc["exclusion_reason"].keys() == {"head", "stem"}
    latency = doc["latency"]
    assert latency["frames"] == 5 and latency["fp32_median_ms"] > 0 and latency["int8_median_ms"] > 0
    assert latency["intra_op_threads"] == 1
    assert latency["speedup"] == pytest.approx(latency["fp32_median_ms"] / latency["int8_median_ms"])
    assert 0 < latency["int8_inference_median_ms"] < latency["int8_median_ms"]
    assert latency["inference_speedup"] == pytest.approx(
        latency["fp32_inference_median_ms"] / latency["int8_inference_median_ms"]
    )
    accuracy = doc["accuracy"]
    assert accuracy["data"] == "scenes seed=0 n=3"
    assert {"map50", "map50_95", "precision", "recall"} <= accuracy["fp32"].keys() & accuracy["int8"].keys()
    assert accuracy["map50_delta_points"] == pytest.approx(100 * (accuracy["int8"]["map50"] - accuracy["fp32"]["map50"]))
    assert doc["model_sha256"] != doc["int8_sha256"] and "cpu" in doc["machine"]


def test_cli_no_float_stem_takes_uint8_pixels(built: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "tiny.int8.onnx"
    result = run_cli(
        "quantize",
        "--model",
        str(built["fp32"]),
        "--out",
        str(out),
        "--calib-scenes",
        "4",
        "--eval-scenes",
        "0",
        "--latency-frames",
        "0",
        "--no-float-stem",
    )
    assert result.returncode == 0, result.stderr
    assert "input: uint8 pixels" in result.stdout and "quantised too (--no-float-stem)" in result.stdout
    assert _interface(out)[0] == ("images", [1, 3, SIZE, SIZE], "tensor(uint8)")


def test_unnamed_nodes_are_named_so_the_head_can_be_excluded(tmp_path: Path) -> None:
    model = onnx.load(str(tiny_detector(tmp_path / "tiny.onnx")))
    for node in model.graph.node[:-2]:
        node.name = ""
    model.graph.node[0].name = "Conv_2"  # what node 2 (a Conv) would be named: a clash to avoid
    q.name_nodes(model)
    names = [n.name for n in model.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert {"Sigmoid", "Concat"} <= set(q.find_head(model).nodes.values())


def test_cli_refuses_a_negative_thread_count(built: dict[str, Any], tmp_path: Path) -> None:
    result = run_cli("quantize", "--model", str(built["fp32"]), "--out", str(tmp_path / "o.onnx"), "--threads", "-1")
    assert result.returncode == EXIT_USAGE and "--threads must be 0" in result.stderr


@pytest.mark.parametrize(
    ("out", "report", "named"),
    [
        ("model", None, "--out"),
        ("o.onnx", "model", "--report"),
        ("o.onnx", "o.onnx", "--report"),
        ("o.onnx", "config", "--report"),
    ],
)
def test_cli_refuses_to_write_over_its_own_inputs_or_outputs(
    built: dict[str, Any], tmp_path: Path, out: str, report: str | None, named: str
) -> None:
    # Only --out over --model was refused: the report replaced the INT8 model it had just written,
    # or the FP32 model, or the configuration.
    model = tmp_path / "tiny.onnx"
    model.write_bytes(built["fp32"].read_bytes())
    config = tmp_path / "edged.toml"
    config.write_text(f'[model]\npath = "{model}"\n')
    paths = {"model": model, "config": config}
    args = ["--out", str(paths.get(out, tmp_path / out)), "--config", str(config)]
    if report is not None:
        args += ["--report", str(paths.get(report, tmp_path / report))]
    before = {path: path.read_bytes() for path in paths.values()}
    result = run_cli("quantize", "--model", str(model), *args, "--calib-scenes", "2")
    assert result.returncode == EXIT_USAGE and f"{named} " in result.stderr, result.stderr
    assert "writing it would destroy it" in result.stderr and "calibrating" not in result.stderr
    assert {path: path.read_bytes() for path in paths.values()} == before and not (tmp_path / "o.onnx").exists()


def test_an_int8_model_is_refused_as_the_model_to_quantise(built: dict[str, Any], tmp_path: Path) -> None:
    # Quantised again, it failed at the end ("two nodes with same node name") and left the invalid model.
    out = tmp_path / "o.onnx"
    result = run_cli("quantize", "--model", str(built["int8"]), "--out", str(out))
    assert result.returncode == EXIT_USAGE and "is already quantised" in result.stderr, result.stderr
    assert not out.exists()


def test_an_unreadable_calibration_image_is_a_data_error_naming_it(built: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    cv2.imwrite(str(tmp_path / "images" / "a.png"), np.zeros((48, 64, 3), np.uint8))
    (tmp_path / "images" / "b.png").write_bytes(b"")
    total, samples = folder_samples(tmp_path / "images", NC)
    frames = q.CalibrationFrames(built["model"].contract, samples, total)
    with pytest.raises(DataError, match=r"images/b\.png") as raised:
        q.quantize(built["fp32"], tmp_path / "o.onnx", frames)
    assert raised.value.exit_code == EXIT_DATA


def test_calibration_progress_counts_the_frames_run_not_those_handed_out() -> None:
    model = _load(Path(__file__).resolve().parents[1] / "models" / "demo.onnx")
    total, samples = scene_samples(10, 0, 320, 240)
    out = io.StringIO()
    frames = q.CalibrationFrames(model.contract, samples, total, out)
    assert frames.get_next() is not None
    assert out.getvalue() == ""  # handed out, not yet run
    while frames.get_next() is not None:
        assert re.findall(r"^(\d+)/10 images", out.getvalue(), re.M)[-1] == str(frames.done - 1)
    lines = out.getvalue().splitlines()
    assert [line.split("/")[0] for line in lines] == [str(n) for n in range(1, 11)]
    assert lines[-1].startswith("10/10 images")


def _calibration_peak_mb(model: LoadedModel, sizes: list[int]) -> float:
    samples = (
        EvalSample("x", np.zeros((40 + extra, 64, 3), np.uint8), np.zeros((0, 4), np.float32), np.zeros(0, np.int64))
        for extra in sizes
    )
    frames = q.CalibrationFrames(model.contract, samples, len(sizes))
    tracemalloc.start()
    try:
        while frames.get_next() is not None:
            pass
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def test_calibration_images_of_many_sizes_do_not_each_keep_a_preprocessor() -> None:
    # A folder of crops has as many sizes as images: a preprocessor kept for each (1.8 MB for the demo
    # model) grew without bound.
    model = _load(Path(__file__).resolve().parents[1] / "models" / "demo.onnx")
    same, distinct = _calibration_peak_mb(model, [0] * 40), _calibration_peak_mb(model, list(range(40)))
    assert distinct < same + 10, (same, distinct)


def test_a_data_folder_without_images_is_said_before_quantising(built: dict[str, Any], tmp_path: Path) -> None:
    # --data is read only for the comparison after the quantisation: an empty or mistyped folder was
    # said after minutes of calibration, with the INT8 model already written.
    (tmp_path / "empty").mkdir()
    out = tmp_path / "o.onnx"
    result = run_cli(
        "quantize", "--model", str(built["fp32"]), "--out", str(out), "--calib-scenes", "2",
        "--data", str(tmp_path / "empty"), "--latency-frames", "0",
    )  # fmt: skip
    assert result.returncode == EXIT_DATA and "no images" in result.stderr, result.stderr
    assert not out.exists() and "calibrating" not in result.stderr


def test_calibration_images_are_taken_without_reading_their_labels(built: dict[str, Any], tmp_path: Path) -> None:
    # Calibration uses the pixels only: a label the comparison would refuse must not stop it.
    (tmp_path / "images").mkdir()
    cv2.imwrite(str(tmp_path / "images" / "a.png"), np.zeros((48, 64, 3), np.uint8))
    (tmp_path / "images" / "a.txt").write_text("9 0.5 0.5 0.2 0.2\n")
    result = run_cli(
        "quantize", "--model", str(built["fp32"]), "--out", str(tmp_path / "o.onnx"),
        "--calib-images", str(tmp_path / "images"), "--eval-scenes", "0", "--latency-frames", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("images", "warned"), [(1, True), (8, False)])
def test_calibrating_on_a_few_images_is_warned_of(built: dict[str, Any], tmp_path: Path, images: int, warned: bool) -> None:
    # One image made an INT8 model that lost 20 points of mAP@0.5:0.95, unsaid when nothing was compared.
    (tmp_path / "images").mkdir()
    for i in range(images):
        cv2.imwrite(str(tmp_path / "images" / f"{i}.png"), np.full((48, 64, 3), 20 * i, np.uint8))
    result = run_cli(
        "quantize", "--model", str(built["fp32"]), "--out", str(tmp_path / "o.onnx"),
        "--calib-images", str(tmp_path / "images"), "--eval-scenes", "0", "--latency-frames", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (f"warning: calibrating on {images} frame(s), fewer than 8" in result.stderr) == warned


@pytest.mark.parametrize(
    ("label", "inspect", "code", "message"),
    [
        ("0 nan 0.5 0.2 0.2\n", "", EXIT_DATA, "a.txt:1: coordinates are fractions"),
        ("0 0.5 0.5 0.2 0.2\n", '[inspect]\nng_classes = ["dent"]\n', EXIT_CONFIG, "'dent'"),
    ],
)
def test_a_bad_label_or_inspection_for_the_comparison_is_said_before_quantising(
    built: dict[str, Any], tmp_path: Path, label: str, inspect: str, code: int, message: str
) -> None:
    # Both were found by the comparison, after the calibration, with the INT8 model written.
    (tmp_path / "images").mkdir()
    cv2.imwrite(str(tmp_path / "images" / "a.png"), np.zeros((48, 64, 3), np.uint8))
    (tmp_path / "images" / "a.txt").write_text(label)
    config = tmp_path / "edged.toml"
    config.write_text(f'[model]\npath = "{built["fp32"]}"\n\n{inspect}')
    out = tmp_path / "o.onnx"
    result = run_cli(
        "quantize", "--model", str(built["fp32"]), "--out", str(out), "--calib-scenes", "2",
        "--data", str(tmp_path / "images"), "--config", str(config), "--latency-frames", "0",
    )  # fmt: skip
    assert result.returncode == code and message in result.stderr, result.stderr
    assert "calibrating" not in result.stderr and not out.exists()


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_stopped_while_quantising_it_leaves_no_file_behind(tmp_path: Path, signum: int, code: int) -> None:
    # SIGTERM left the prepared model and onnxruntime's augmented one in /tmp (3.4 MB each), and
    # Ctrl-C printed a traceback.
    temp, out = tmp_path / "tmp", tmp_path / "out"
    temp.mkdir()
    out.mkdir()
    command = edged_command(
        "quantize", "--model", str(DEMO), "--out", str(out / "demo.int8.onnx"), "--calib-scenes", "200",
        "--eval-scenes", "0", "--latency-frames", "0",
    )  # fmt: skip
    with subprocess.Popen(command, stderr=subprocess.PIPE, env={**os.environ, "TMPDIR": str(temp)}) as proc:
        assert proc.stderr is not None
        said = b""
        while b"/200 images" not in said:  # calibration has begun: the temporary models are written
            chunk = proc.stderr.read1(4096)
            assert chunk, said.decode()
            said += chunk
        proc.send_signal(signum)
        said += proc.stderr.read()
        assert proc.wait(timeout=60) == code, said.decode()
    left = {path.name for path in temp.iterdir()} - {".ses"}  # onnxruntime's own session id, kept for the next run
    assert b"Traceback" not in said and left == set() and list(out.iterdir()) == []
