"""The per-frame path: right answers, and no large allocations once it is planned."""

from __future__ import annotations

import logging
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from onnx_models import colour_probe, solid_frame

from edged.config import ModelConfig, RuntimeConfig
from edged.model import load_model
from edged.pipeline import MAX_PLANS, FramePath, FramePipeline, Processed, Rejected
from edged.sources import Frame


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


def test_two_plans_on_one_model_each_give_their_own_frames_boxes(tmp_path: Path) -> None:
    """Each plan binds its own buffers: building a second one must not redirect the first."""
    model = load_model(ModelConfig(path=colour_probe(tmp_path / "m.onnx")), RuntimeConfig())
    red_plan = FramePipeline(model, 128, 96, "bgr")
    blue_plan = FramePipeline(model, 128, 96, "bgr")
    red, _ = red_plan.process(solid_frame((0, 0, 255)))
    assert red.class_ids.tolist() == [0]
    blue, _ = blue_plan.process(solid_frame((255, 0, 0)))
    assert blue.class_ids.tolist() == [1]
    again, _ = red_plan.process(solid_frame((0, 0, 255)))
    assert again.class_ids.tolist() == [0]
    assert red_plan.output is not blue_plan.output


def _frame(image: np.ndarray, frame_id: int = 0) -> Frame:
    return Frame(image, frame_id, 0, 0, "bgr")


def test_the_path_processes_checked_frames_and_builds_their_message(tmp_path: Path) -> None:
    model = load_model(ModelConfig(path=colour_probe(tmp_path / "m.onnx")), RuntimeConfig())
    path = FramePath(model, "cam7", "bgr")
    done = path.run(_frame(solid_frame((0, 0, 255)), frame_id=42))
    assert isinstance(done, Processed)
    msg = path.message(done, seq=3, thermal_state="ok")
    assert (msg.camera_id, msg.seq, msg.frame_id, msg.thermal_state) == ("cam7", 3, 42, "ok")
    assert [d.label for d in msg.detections] == ["red"] and msg.detections[0].box == (48.0, 20.0, 80.0, 44.0)
    assert msg.frame_size == (128, 96) and msg.model == model.info


def test_the_path_rejects_a_frame_unlike_the_first_then_replans_after_a_lasting_change(tmp_path: Path) -> None:
    model = load_model(ModelConfig(path=colour_probe(tmp_path / "m.onnx")), RuntimeConfig())
    path = FramePath(model, "cam0", "bgr")
    assert isinstance(path.run(_frame(solid_frame((0, 0, 255)))), Processed)
    bigger = np.zeros((120, 160, 3), np.uint8)
    outcomes = [path.run(_frame(bigger, i)) for i in range(5)]
    assert [o.reason for o in outcomes[:4] if isinstance(o, Rejected)] == ["bad_frame_size"] * 4
    assert isinstance(outcomes[4], Processed) and outcomes[4].plan.spec.width == 160
    wrong_order = Frame(bigger, 9, 0, 0, "rgb")
    rejected = path.run(wrong_order)
    assert isinstance(rejected, Rejected) and rejected.reason == "bad_frame_channel_order"


def test_a_source_whose_sizes_vary_gets_each_frame_through_a_plan_of_its_own_size(tmp_path: Path) -> None:
    model = load_model(ModelConfig(path=colour_probe(tmp_path / "m.onnx")), RuntimeConfig())
    path = FramePath(model, "cam0", "bgr", sizes_vary=True)
    # The probe's box (input pixels 24,18-40,30) through each size's own letterbox.
    expected = {
        (128, 96): [48.0, 20.0, 80.0, 44.0],
        (256, 192): [96.0, 40.0, 160.0, 88.0],
        (160, 90): [60.0, 10.0, 100.0, 40.0],
    }
    for i, (w, h) in enumerate([(128, 96), (256, 192), (160, 90), (256, 192), (128, 96)] * 2):
        done = path.run(_frame(solid_frame((0, 0, 255), w, h), i))
        assert isinstance(done, Processed), done
        assert done.plan.spec.width == w and done.detections.xyxy.tolist() == [expected[(w, h)]]
        assert path.message(done, seq=i, thermal_state="ok").frame_size == (w, h)
    rejected = path.run(Frame(solid_frame((0, 0, 255), 64, 48), 99, 0, 0, "rgb"))  # the rest of the contract holds
    assert isinstance(rejected, Rejected) and rejected.reason == "bad_frame_channel_order"


def test_plans_per_size_are_bounded_and_the_least_recently_used_goes_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = load_model(ModelConfig(path=colour_probe(tmp_path / "m.onnx")), RuntimeConfig())
    path = FramePath(model, "cam0", "bgr", sizes_vary=True)
    sizes = [(64 + 16 * i, 48 + 12 * i) for i in range(MAX_PLANS + 1)]

    def plan_of(size: tuple[int, int]) -> FramePipeline:
        done = path.run(_frame(np.zeros((size[1], size[0], 3), np.uint8)))
        assert isinstance(done, Processed), done
        return done.plan

    first = {size: plan_of(size) for size in sizes[:MAX_PLANS]}
    assert plan_of(sizes[0]) is first[sizes[0]]  # used again: now the most recent
    with caplog.at_level(logging.WARNING):
        plan_of(sizes[MAX_PLANS])  # one size too many: sizes[1], the least recently used, goes
    assert f"more than {MAX_PLANS} frame sizes" in caplog.text
    for size in [sizes[0], *sizes[2:MAX_PLANS]]:
        assert plan_of(size) is first[size]
    assert plan_of(sizes[1]) is not first[sizes[1]]  # planned again
    assert caplog.text.count("more than") == 1  # said once, not per eviction
