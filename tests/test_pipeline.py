"""The per-frame path: right answers, and no large allocations once it is planned."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from onnx_models import colour_probe, solid_frame

from edged.config import ModelConfig, RuntimeConfig
from edged.model import load_model
from edged.pipeline import FramePipeline


@pytest.mark.parametrize(
    ("head", "layout", "metadata"),
    [
        ("yolov8", "nchw", None),
        ("yolov8", "nhwc", None),
        ("yolov5", "nchw", None),
        ("end2end", "nchw", {"args": "{'nms': True}"}),
    ],
)
def test_every_head_and_layout_gives_the_same_boxes(tmp_path: Path, head: str, layout: str, metadata: dict | None) -> None:
    model = load_model(
        ModelConfig(path=colour_probe(tmp_path / "m.onnx", head=head, layout=layout, metadata=metadata)), RuntimeConfig()
    )
    plan = FramePipeline(model, 128, 96, "bgr")
    detections, times = plan.process(solid_frame((0, 0, 255)))
    assert detections.xyxy.tolist() == [[48.0, 20.0, 80.0, 44.0]]
    assert detections.class_ids.tolist() == [0] and model.label(0) == "red"
    assert detections.scores[0] == pytest.approx(0.75 + 0.25 * 114 / 255, abs=1e-4)
    assert min(times.preprocess_ms, times.inference_ms, times.decode_ms) > 0


def test_an_rgb_source_needs_no_swap(tmp_path: Path) -> None:
    model = load_model(ModelConfig(path=colour_probe(tmp_path / "m.onnx")), RuntimeConfig())
    plan = FramePipeline(model, 128, 96, "rgb")
    detections, _ = plan.process(solid_frame((255, 0, 0)))  # (255, 0, 0) is red in RGB order
    assert detections.class_ids.tolist() == [0]


def test_steady_state_allocates_only_the_small_result(tmp_path: Path) -> None:
    model = load_model(ModelConfig(path=colour_probe(tmp_path / "m.onnx", size=320)), RuntimeConfig())
    plan = FramePipeline(model, 1280, 720, "bgr")
    frame = np.random.default_rng(0).integers(0, 256, (720, 1280, 3), np.uint8)
    for _ in range(5):
        plan.process(frame)
    tracemalloc.start()
    try:
        baseline = tracemalloc.take_snapshot()
        for _ in range(200):
            plan.process(frame)
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(baseline, "filename"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The input tensor alone is 1.2 MB; a per-frame copy of it or of the frame would show here.
    assert peak < 256 * 1024, peak
    assert grown < 16 * 1024, grown  # nothing accumulates over 200 frames
