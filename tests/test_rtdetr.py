"""Tests for edged.heads.rtdetr: ultralytics' RT-DETR export served as ultralytics' RTDETRPredictor serves it.

The reference below is that predictor's order of operations written out in numpy and OpenCV
(stretch the frame to the input, BGR to RGB, divide by 255; boxes cx cy w h as fractions of the
input to corners, scores above conf, the model's first ``max_det``, times the frame size), on a
small ONNX model with RT-DETR's output layout and metadata. The one difference is edged's:
boxes are clipped to the frame, and a box left without area there is dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path

import cv2
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edged.config import ModelConfig, RuntimeConfig
from edged.contract import build_contract
from edged.decode import Decoder
from edged.errors import ContractError, HeadError
from edged.geometry import BoxMap
from edged.heads import registry
from edged.heads.registry import HEADS, detect_head
from edged.heads.rtdetr import RtDetrHead
from edged.model import load_model
from edged.pipeline import FramePipeline

NC = 3
QUERIES = 300
NAMES = {"names": str({i: f"class{i}" for i in range(NC)})}
# What ultralytics writes into an RT-DETR export (values trimmed to the keys edged reads).
RTDETR_META = {
    **NAMES,
    "author": "Ultralytics",
    "description": "Ultralytics rtdetr-l model",
    "task": "detect",
    "head": "RTDETRDecoder",
    "end2end": "False",
    "stride": "32",
    "imgsz": "[64, 96]",
    "args": "{'batch': 1, 'half': False, 'dynamic': False, 'nms': False}",
}
PLAIN_META = {key: value for key, value in RTDETR_META.items() if key != "head"}


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name + "_v"))


def rtdetr_like(path: Path, *, metadata: Mapping[str, str] = RTDETR_META, input_hw: tuple[int, int] = (64, 96)) -> Path:
    """A model with RT-DETR's output: [1, 300, 6] of cx cy w h (fractions of the input), score, class,
    sorted by score as its top-k leaves them.

    A random projection of the frame's 8x8 average colours sets every box and score, so the
    output depends on the frame as a real detector's does; boxes up to half the input wide cross
    every edge of it.
    """
    rng = np.random.default_rng(0)
    height, width = input_hw
    cells = 3 * 8 * 8
    nodes = [
        helper.make_node(
            "AveragePool", ["images"], ["pooled"], kernel_shape=[height // 8, width // 8], strides=[height // 8, width // 8]
        ),
        _const("flat", np.array([1, cells], np.int64)),
        helper.make_node("Reshape", ["pooled", "flat"], ["features"]),
        _const("weights", rng.normal(0, 4.0 / np.sqrt(cells), (cells, QUERIES * 5)).astype(np.float32)),
        helper.make_node("MatMul", ["features", "weights"], ["projected"]),
        _const("bias", rng.normal(0, 1.5, QUERIES * 5).astype(np.float32)),
        helper.make_node("Add", ["projected", "bias"], ["raw"]),
        _const("by_query", np.array([QUERIES, 5], np.int64)),
        helper.make_node("Reshape", ["raw", "by_query"], ["logits"]),
        helper.make_node("Sigmoid", ["logits"], ["unit"]),
        _const("spans", np.array([[1.2, 1.2, 0.5, 0.5, 1.0]], np.float32)),
        _const("shifts", np.array([[-0.1, -0.1, 0.0, 0.0, 0.0]], np.float32)),
        helper.make_node("Mul", ["unit", "spans"], ["spanned"]),
        helper.make_node("Add", ["spanned", "shifts"], ["boxes_scores"]),
        _const("classes", rng.integers(0, NC, (QUERIES, 1)).astype(np.float32)),
        helper.make_node("Concat", ["boxes_scores", "classes"], ["rows"], axis=1),
        _const("score_col", np.array([4], np.int64)),
        helper.make_node("Gather", ["rows", "score_col"], ["score2d"], axis=1),
        _const("by_row", np.array([QUERIES], np.int64)),
        helper.make_node("Reshape", ["score2d", "by_row"], ["scores"]),
        _const("k", np.array([QUERIES], np.int64)),
        helper.make_node("TopK", ["scores", "k"], ["_", "order"], axis=0, largest=1, sorted=1),
        helper.make_node("Gather", ["rows", "order"], ["sorted_rows"], axis=0),
        _const("out_shape", np.array([1, QUERIES, 6], np.int64)),
        helper.make_node("Reshape", ["sorted_rows", "out_shape"], ["output0"]),
    ]
    graph = helper.make_graph(
        nodes,
        "rtdetr_like",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, height, width])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, QUERIES, 6])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    helper.set_model_props(model, dict(metadata))
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def reference(path: Path, frame: np.ndarray, conf: float, max_det: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ultralytics' RT-DETR predict on a BGR frame, then edged's clip to the frame: (xyxy, scores, classes)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    _, _, height, width = session.get_inputs()[0].shape
    frame_h, frame_w = frame.shape[:2]
    stretched = (
        frame
        if (frame_h, frame_w) == (height, width)
        else cv2.resize(frame, (width, height), interpolation=cv2.INTER_LINEAR)
    )
    tensor = np.ascontiguousarray(stretched[..., ::-1].transpose(2, 0, 1)[None]).astype(np.float32) / 255
    pred = session.run(None, {"images": tensor})[0][0]
    cx, cy, w, h, score, cls = pred.T
    xyxy = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)
    kept = np.flatnonzero(score > conf)[:max_det]
    xyxy, score, cls = xyxy[kept], score[kept], cls[kept].astype(np.int32)
    xyxy[:, [0, 2]] = (xyxy[:, [0, 2]] * frame_w).clip(0, frame_w)
    xyxy[:, [1, 3]] = (xyxy[:, [1, 3]] * frame_h).clip(0, frame_h)
    area = (xyxy[:, 2] > xyxy[:, 0]) & (xyxy[:, 3] > xyxy[:, 1])
    return xyxy[area], score[area], cls[area]


def frame(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth colour blobs: an image whose average colours differ from cell to cell."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (6, 9, 3), dtype=np.uint8)
    return cv2.resize(small, (width, height), interpolation=cv2.INTER_CUBIC)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rtdetr_like(tmp_path_factory.mktemp("rtdetr") / "rtdetr.onnx")


@pytest.mark.parametrize(("width", "height"), [(1280, 720), (720, 1280), (96, 64), (1000, 333)])
@pytest.mark.parametrize(("conf", "max_det"), [(0.25, 300), (0.5, 20)])
def test_boxes_are_ultralytics_rtdetr_predict_clipped(
    model_path: Path, width: int, height: int, conf: float, max_det: int
) -> None:
    model = load_model(ModelConfig(path=model_path, conf=conf, max_det=max_det), RuntimeConfig())
    assert (model.head, model.num_classes, model.contract.resize) == ("rtdetr", NC, "stretch")
    plan = FramePipeline(model, width, height, "bgr")
    overhanging = 0
    for seed in range(3):
        image = frame(width, height, seed)
        det, _ = plan.process(image)
        xyxy, scores, classes = reference(model_path, image, conf, max_det)
        assert len(det) == len(scores) > 0
        # Pixels: ultralytics multiplies a fraction by the frame size, edged divides it by the inverse.
        np.testing.assert_allclose(det.xyxy, xyxy, atol=1e-3)
        np.testing.assert_array_equal(det.scores, scores)
        assert det.class_ids.tolist() == classes.tolist()
        overhanging += int(np.sum((xyxy == 0) | (xyxy == [width, height, width, height])))
    assert overhanging > 0  # boxes crossing the frame's edges were among them


def test_an_rtdetr_export_is_never_read_as_end2end() -> None:
    # The same output without the head metadata is an end2end head; the metadata alone tells them apart.
    assert detect_head([[1, QUERIES, 6]], RTDETR_META) == ("rtdetr", NC)
    assert detect_head([["batch", QUERIES, 6]], RTDETR_META) == ("rtdetr", NC)
    assert detect_head([[1, QUERIES, 6]], PLAIN_META) == ("end2end", NC)


def test_an_rtdetr_export_without_names_is_refused() -> None:
    meta = {key: value for key, value in RTDETR_META.items() if key != "names"}
    with pytest.raises(HeadError, match=r"RT-DETR head, but 'names' metadata is missing"):
        detect_head([[1, QUERIES, 6]], meta)


CASES: list[tuple[list[list[int | str | None]], Mapping[str, str]]] = [
    ([[1, QUERIES, 6]], RTDETR_META),
    ([["batch", QUERIES, 6]], RTDETR_META),
    ([[1, QUERIES, 6]], PLAIN_META),
    ([[1, QUERIES, 6]], {"head": "RTDETRDecoder"}),
    ([[1, 7, 8400]], RTDETR_META),
]


def _outcome(shapes: list[list[int | str | None]], metadata: Mapping[str, str]) -> tuple[str, int] | str:
    try:
        return detect_head(shapes, metadata)
    except HeadError as e:
        return str(e)


@pytest.mark.parametrize("order", list(itertools.permutations(HEADS)))
def test_no_other_format_claims_an_rtdetr_output(order: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    registered = [_outcome(*case) for case in CASES]
    monkeypatch.setattr(registry, "HEADS", {name: HEADS[name] for name in order})
    assert [_outcome(*case) for case in CASES] == registered


def test_the_configured_head_must_be_the_detected_one(model_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ContractError, match=r"model.head = 'end2end' but .* are a 'rtdetr' head"):
        load_model(ModelConfig(path=model_path, head="end2end"), RuntimeConfig())
    plain = rtdetr_like(tmp_path / "plain.onnx", metadata=PLAIN_META)
    with pytest.raises(ContractError, match=r"model.head = 'rtdetr' but .* are a 'end2end' head"):
        load_model(ModelConfig(path=plain, head="rtdetr"), RuntimeConfig())


def _contract(**cfg: object) -> str:
    model_cfg = ModelConfig(path=Path("m.onnx"), **cfg)
    return build_contract([("images", [1, 3, 640, 640], "tensor(float)")], RTDETR_META, model_cfg, RtDetrHead).resize


def test_rtdetr_is_stretched_unless_the_config_asks_for_a_letterbox() -> None:
    assert _contract() == "stretch"
    assert _contract(resize="stretch") == "stretch"
    with pytest.raises(ContractError) as info:
        _contract(resize="letterbox")
    assert all(part in str(info.value) for part in ("model.resize = 'letterbox'", "rtdetr", "'stretch'"))


def test_other_heads_take_the_configured_resize() -> None:
    cfg = ModelConfig(path=Path("m.onnx"), resize="stretch")
    for head in (HEADS["yolov8"], HEADS["end2end"], None):
        assert build_contract([("images", [1, 3, 640, 640], "tensor(float)")], {}, cfg, head).resize == "stretch"


def rtdetr_tensor(rows: list[tuple[float, float, float, float, float, float]], n: int = 8) -> np.ndarray:
    """[1, n, 6]: cx cy w h as fractions of the input, score, class; zero rows as padding."""
    out = np.zeros((1, n, 6), dtype=np.float32)
    out[0, : len(rows)] = rows
    return out


STRETCH = BoxMap.stretch(1280, 960, 640, 640)


def test_decode_scales_fractions_by_the_frame_and_clips() -> None:
    out = rtdetr_tensor(
        [
            (0.5, 0.5, 0.25, 0.5, 0.9, 1),  # 1280 x 960 frame: x 480..800, y 240..720
            (0.0, 1.0, 0.2, 0.2, 0.8, 0),  # centred on the bottom-left corner: clipped to its quarter
            (1.2, 0.5, 0.2, 0.2, 0.7, 2),  # wholly right of the frame: no area once clipped, dropped
        ]
    )
    det = Decoder("rtdetr", out.shape, NC).decode(out, STRETCH)
    np.testing.assert_allclose(det.xyxy, [[480, 240, 800, 720], [0, 864, 128, 960]], rtol=1e-6)
    np.testing.assert_allclose(det.scores, [0.9, 0.8])
    assert det.class_ids.tolist() == [1, 0]


def test_decode_keeps_the_models_order_above_conf_without_nms() -> None:
    box = (0.5, 0.5, 0.2, 0.2)
    out = rtdetr_tensor(
        [
            (*box, 0.9, 0),
            (*box, 0.8, 0),  # the same box and class again: no NMS in an RT-DETR head
            (*box, 0.7, 5),  # no such class
            (*box, 0.25, 1),  # at conf, not above it
            (*box, 0.6, 2),
        ]
    )
    det = Decoder("rtdetr", out.shape, NC, conf=0.25, iou=0.1).decode(out, STRETCH)
    np.testing.assert_allclose(det.scores, [0.9, 0.8, 0.6])
    assert det.class_ids.tolist() == [0, 0, 2]
    assert len(Decoder("rtdetr", out.shape, NC, max_det=2).decode(out, STRETCH)) == 2
