"""edged's boxes against ultralytics' predict, on real ONNX models and frames with objects at every border.

The reference (`ultralytics_reference`) is ultralytics' own order of operations written out in
numpy and OpenCV: its letterbox makes the tensor, ONNX Runtime runs the model on it, and its
threshold, class-offset NMS in input space, ``max_det``, scaling and clipping make the boxes.
edged must publish the same boxes: same class, IoU >= 0.99, score within 2e-3, none missing and
none extra, except the ones clipping leaves with zero area, which edged drops. The models
(`onnx_models.border_detector`) crowd overlapping candidates across the input's edges and the
letterbox's content edges, where suppressing clipped boxes instead would decide differently.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx_models import border_detector
from ultralytics_reference import Boxes, differences, letterbox, predict

from edged.config import ModelConfig, RuntimeConfig
from edged.decode import Decoder, Detections
from edged.geometry import BoxMap
from edged.model import load_model
from edged.pipeline import FramePipeline

HEADS = ("yolov8", "yolov5", "end2end")
METADATA = {
    "yolov8": {"task": "detect"},
    "yolov5": {},
    "end2end": {"task": "detect", "end2end": "True"},
}
FRAMES = [(1280, 720), (720, 1280), (640, 640), (1000, 333)]  # width, height
INPUTS = [(320, 320), (256, 384)]  # height, width: a square and a rectangular export
Setting = tuple[float, float, int, bool]  # conf, iou, max_det, agnostic
# The daemon's thresholds, predict's, val's, and a max_det that binds.
SETTINGS: list[Setting] = [
    (0.25, 0.45, 300, False),
    (0.25, 0.7, 300, False),
    (0.001, 0.7, 300, False),
    (0.25, 0.45, 15, True),
]
NUM_CLASSES = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, tuple[int, int]], Path]:
    folder = tmp_path_factory.mktemp("parity")
    return {
        (head, hw): border_detector(
            folder / f"{head}_{hw[0]}x{hw[1]}.onnx", head=head, input_hw=hw, num_classes=NUM_CLASSES, metadata=METADATA[head]
        )
        for head in HEADS
        for hw in INPUTS
    }


def border_frame(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A noisy BGR frame with a solid object touching each of its four borders."""
    rng = np.random.default_rng(seed)
    frame = rng.integers(0, 256, (height, width, 3), np.uint8)
    w, h = width // 4, height // 4
    for x, y in ((0, height // 3), (width - w, height // 2), (width // 3, 0), (width // 2, height - h)):
        frame[y : y + h, x : x + w] = rng.integers(0, 256, 3, np.uint8)
    return frame


def reference(
    model: Path, head: str, frame: np.ndarray, input_hw: tuple[int, int], setting: Setting
) -> tuple[np.ndarray, Boxes]:
    """The model's output on ultralytics' tensor of ``frame``, and ultralytics' boxes from it."""
    conf, iou, max_det, agnostic = setting
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    output = session.run(None, {"images": letterbox(frame, input_hw)})[0]
    boxes = predict(
        output, head, input_hw=input_hw, frame_hw=frame.shape[:2], conf=conf, iou=iou, max_det=max_det, agnostic=agnostic
    )
    return output, boxes


def as_boxes(det: Detections) -> Boxes:
    return Boxes(det.xyxy.copy(), det.scores.copy(), det.class_ids.astype(np.int64))


def assert_parity(got: Boxes, want: Boxes) -> None:
    """``got`` are ultralytics' boxes ``want``, less the ones clipping flattened."""
    shown = want.with_area()
    missing, extra = differences(got, shown)
    assert not missing and not extra, (
        f"{len(missing)} of ultralytics' {len(shown.scores)} boxes missing: {shown.xyxy[missing].tolist()}, "
        f"{len(extra)} extra: {got.xyxy[extra].tolist()}"
    )


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "conf{}-iou{}-max{}{}".format(*s[:3], "-agnostic" * s[3]))
@pytest.mark.parametrize("input_hw", INPUTS, ids=lambda hw: f"in{hw[0]}x{hw[1]}")
@pytest.mark.parametrize("frame_wh", FRAMES, ids=lambda wh: f"{wh[0]}x{wh[1]}")
@pytest.mark.parametrize("head", HEADS)
def test_decode_equals_ultralytics(
    models: dict[tuple[str, tuple[int, int]], Path],
    head: str,
    frame_wh: tuple[int, int],
    input_hw: tuple[int, int],
    setting: Setting,
) -> None:
    frame = border_frame(*frame_wh)
    output, want = reference(models[head, input_hw], head, frame, input_hw, setting)
    conf, iou, max_det, agnostic = setting
    decoder = Decoder(head, output.shape, NUM_CLASSES, conf=conf, iou=iou, max_det=max_det, agnostic=agnostic)
    box_map = BoxMap.letterbox(*frame_wh, input_hw[1], input_hw[0])
    assert len(want.with_area().scores) >= 3  # a scene with boxes to compare
    assert_parity(as_boxes(decoder.decode(output, box_map)), want)


@pytest.mark.parametrize("frame_wh", FRAMES, ids=lambda wh: f"{wh[0]}x{wh[1]}")
@pytest.mark.parametrize("head", HEADS)
def test_pipeline_equals_ultralytics(
    models: dict[tuple[str, tuple[int, int]], Path], head: str, frame_wh: tuple[int, int]
) -> None:
    # edged's own path end to end: its letterbox, ONNX Runtime through IOBinding, its decode.
    input_hw, setting = INPUTS[1], SETTINGS[1]
    conf, iou, max_det, agnostic = setting
    cfg = ModelConfig(path=models[head, input_hw], conf=conf, iou=iou, max_det=max_det, agnostic_nms=agnostic)
    plan = FramePipeline(load_model(cfg, RuntimeConfig()), *frame_wh, "bgr")
    frame = border_frame(*frame_wh, seed=1)
    _, want = reference(cfg.path, head, frame, input_hw, setting)
    detections, _ = plan.process(frame)
    assert_parity(as_boxes(detections), want)


@pytest.mark.parametrize("head", ["yolov8", "yolov5"])
def test_one_class_models(tmp_path: Path, head: str) -> None:
    path = border_detector(tmp_path / "one.onnx", head=head, num_classes=1, metadata=METADATA[head])
    cfg = ModelConfig(path=path, conf=0.25, iou=0.7, max_det=300)
    model = load_model(cfg, RuntimeConfig())
    assert (model.head, model.num_classes) == (head, 1)
    frame = border_frame(1280, 720)
    _, want = reference(path, head, frame, (320, 320), (0.25, 0.7, 300, False))
    detections, _ = FramePipeline(model, 1280, 720, "bgr").process(frame)
    assert_parity(as_boxes(detections), want)


def test_more_candidates_than_ultralytics_lets_into_nms() -> None:
    # A P2 head at 640 has 34,000 candidates; ultralytics lets the 30,000 best into NMS. Here 150
    # tight clusters of 200 hold the 30,000 best and 20 more clusters rank below the cut: NMS
    # would keep one box of each, but ultralytics never looks at them.
    rng = np.random.default_rng(0)
    members = np.repeat(np.arange(170), 200)
    centres = rng.uniform(20, 620, (170, 2))
    out = np.zeros((1, 4 + NUM_CLASSES, members.size), np.float32)
    out[0, :2] = (centres[members] + rng.normal(0, 0.5, (members.size, 2))).T
    out[0, 2:4] = 30 + rng.normal(0, 0.5, (2, members.size))
    out[0, 4] = np.where(members < 150, rng.uniform(0.5, 0.99, members.size), rng.uniform(0.01, 0.4, members.size))
    box_map = BoxMap.letterbox(640, 640, 640, 640)
    got = Decoder("yolov8", out.shape, NUM_CLASSES, conf=0.001, iou=0.7, max_det=300).decode(out, box_map)
    want = predict(out, "yolov8", input_hw=(640, 640), frame_hw=(640, 640), conf=0.001, iou=0.7, max_det=300)
    assert len(want.scores) > 100 and want.scores.min() >= 0.5
    assert_parity(as_boxes(got), want)
