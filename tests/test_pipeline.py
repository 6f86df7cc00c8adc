"""The per-frame path: right answers, and no large allocations once it is planned."""

from __future__ import annotations

import logging
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from allocations import NumpyAllocations
from onnx_models import colour_probe, fixed_scene, solid_frame

from edged.config import ModelConfig, RuntimeConfig, Settings, TriggerConfig, load_config
from edged.errors import ConfigError, ModelError
from edged.model import load_model
from edged.pipeline import (
    MAX_PLANS,
    PLAN_PIXELS,
    FramePath,
    FramePipeline,
    Processed,
    Rejected,
    frame_path,
    planned,
    verdict_message,
)
from edged.settings.inspect import InspectConfig
from edged.settings.sources import SyntheticSourceConfig
from edged.sources.base import Frame
from edged.verdict import Inspector

TASKS = Path(__file__).parent / "data" / "tasks"

# In a 64x64 input; a 128x96 frame maps x * 2, (y - 8) * 2. Centres in the frame's fractions:
SCENE = [
    (16.0, 20.0, 8.0, 8.0, 0, 0.9),  # scratch at (0.25, 0.25), 16x16 px
    (48.0, 20.0, 8.0, 8.0, 1, 0.5),  # crack at (0.75, 0.25)
    (16.0, 44.0, 8.0, 8.0, 2, 0.3),  # dust at (0.25, 0.75)
    (48.0, 44.0, 2.0, 2.0, 0, 0.35),  # a small scratch at (0.75, 0.75)
]


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


def test_inspection_applies_thresholds_and_zones_and_puts_the_verdict_in_the_messages(tmp_path: Path) -> None:
    model = load_model(ModelConfig(path=fixed_scene(tmp_path / "m.onnx", SCENE)), RuntimeConfig())
    plain = FramePath(model, "cam0", "bgr")
    done = plain.run(_frame(solid_frame((0, 0, 0))))
    assert isinstance(done, Processed) and done.inspected is None
    msg = plain.message(done, seq=0, thermal_state="ok")
    assert [d.label for d in msg.detections] == ["scratch", "crack", "scratch", "dust"]  # by score
    assert msg.verdict is None and msg.verdict_latency_ms is None and verdict_message(msg, 0) is None
    assert {d.zone for d in msg.detections} == {None} and {d.threshold for d in msg.detections} == {None}
    assert plain.verdict_record(done, None) is None  # nothing for the metrics or the page to count

    cfg = InspectConfig(
        class_conf={"crack": 0.6},
        zones={"left": [(0, 0), (0.5, 0), (0.5, 1), (0, 1)]},
        ng_classes=["scratch", "crack"],
        min_area={"scratch": 0.01},
    )
    inspected = FramePath(model, "cam0", "bgr", Inspector(cfg, model.labels, model.num_classes, 0.25, 100))
    done = inspected.run(_frame(solid_frame((0, 0, 0)), frame_id=7))
    assert isinstance(done, Processed)
    msg = inspected.message(done, seq=4, thermal_state="ok", part_id="A-17")
    # The crack is under its 0.6, the small scratch outside the zone: scratch and dust are left.
    assert [(d.label, d.zone, d.threshold) for d in msg.detections] == [("scratch", "left", 0.25), ("dust", "left", 0.25)]
    assert msg.detections[0].box == (24.0, 16.0, 40.0, 32.0)
    assert msg.verdict == "ng" and msg.part_id == "A-17"
    assert [(r.detection, r.label, r.zone) for r in msg.reasons] == [(0, "scratch", "left")]
    assert msg.verdict_latency_ms is not None and msg.verdict_latency_ms > 0
    verdict = verdict_message(msg, 9)
    assert verdict is not None
    assert (verdict.seq, verdict.frame_id, verdict.part_id, verdict.verdict) == (9, 7, "A-17", "ng")
    assert verdict.reasons == msg.reasons and verdict.verdict_latency_ms == msg.verdict_latency_ms
    record = inspected.verdict_record(done, "A-17")
    assert record is not None and (record.frame_id, record.part_id, record.verdict) == (7, "A-17", "ng")
    assert list(record.reasons) == msg.reasons and record.capture_time_ns == msg.capture_time_ns


TWO_CAMERAS = """
[model]
path = "m.onnx"
[inspect]
ng_classes = ["crack"]
[evidence]
save = "ng+near"
near_margin = 0.2
[[source]]
type = "synthetic"
camera_id = "top"
[source.inspect]
class_conf = { scratch = 0.95 }
ng_classes = ["scratch"]
[[source]]
type = "synthetic"
camera_id = "side"
[source.evidence]
save = "ng"
"""


def test_each_camera_gets_its_own_inspection_and_near_misses_from_one_model(tmp_path: Path) -> None:
    """The same frame: the top camera (scratch NG, at 0.95) passes it, the side camera ([inspect]: crack NG) fails it."""
    fixed_scene(tmp_path / "m.onnx", SCENE)
    (tmp_path / "edged.toml").write_text(TWO_CAMERAS)
    settings = load_config(tmp_path / "edged.toml")
    model = load_model(settings.model, settings.runtime)
    top, side = (frame_path(settings, model, cfg) for cfg in settings.source)
    frame = _frame(solid_frame((0, 0, 0)))
    verdicts = {}
    for path in (top, side):
        done = path.run(frame)
        assert isinstance(done, Processed)
        msg = path.message(done, seq=0, thermal_state="ok")
        verdicts[msg.camera_id] = (msg.verdict, [d.label for d in msg.detections], [r.label for r in msg.reasons])
    assert verdicts == {
        "top": ("ok", ["crack", "dust"], []),  # no scratch reaches its 0.95 here, and only a scratch is NG
        "side": ("ng", ["scratch", "crack", "scratch", "dust"], ["crack"]),
    }
    assert (top.near_margin, side.near_margin) == (0.2, None)  # the side camera saves NG frames only


def test_a_class_the_model_lacks_in_one_cameras_inspection_names_that_camera(tmp_path: Path) -> None:
    fixed_scene(tmp_path / "m.onnx", SCENE)
    (tmp_path / "edged.toml").write_text(TWO_CAMERAS.replace('ng_classes = ["scratch"]', 'ng_classes = ["dent"]'))
    settings = load_config(tmp_path / "edged.toml")
    model = load_model(settings.model, settings.runtime)
    frame_path(settings, model, settings.source[1])
    with pytest.raises(ConfigError) as info:
        frame_path(settings, model, settings.source[0])
    assert info.value.exit_code == 78
    assert info.value.problems == [
        "inspect.ng_classes: 'dent' is not a class of the model (its classes: scratch, crack, dust) (camera top)"
    ]


@pytest.mark.parametrize("match", ["centre", "overlap"])
@pytest.mark.parametrize("near_margin", [None, 0.15])
def test_an_inspected_frame_creates_no_arrays_from_contract_check_to_verdict(
    tmp_path: Path, match: str, near_margin: float | None
) -> None:
    counter = NumpyAllocations.get()
    assert counter is not None
    model = load_model(ModelConfig(path=fixed_scene(tmp_path / "m.onnx", SCENE)), RuntimeConfig())
    cfg = InspectConfig(
        class_conf={"crack": 0.6},
        zones={"left": [(0, 0), (0.5, 0), (0.5, 1), (0, 1)], "high": [(0, 0), (1, 0), (1, 0.5)]},
        match=match,
        min_area={"scratch": 0.01},
    )
    inspector = Inspector(cfg, model.labels, model.num_classes, 0.25, 100)
    path = FramePath(model, "cam0", "bgr", inspector, near_margin=near_margin)
    frame = _frame(solid_frame((0, 0, 0)))
    first = path.run(frame)
    assert isinstance(first, Processed)
    near = first.result.near
    # With a margin, the crack (0.5 under its 0.6, in zone "high") is a near miss.
    assert (near.class_ids.tolist() if near is not None else None) == (None if near_margin is None else [1])
    for _ in range(3):
        path.run(frame)
    with counter.counting():
        before = counter.buffers
        for _ in range(10):
            done = path.run(frame)
            assert isinstance(done, Processed)
            record = path.verdict_record(done, None)  # what the metrics count and the page lists
        assert counter.buffers == before
    assert done.inspected is not None and done.inspected.verdict == "ng"
    assert record is not None and record.verdict == "ng" and [r.label for r in record.reasons] == ["scratch", "dust"]


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
        assert done.plan.spec.width == w and done.result.xyxy.tolist() == [expected[(w, h)]]
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


def test_plans_of_varying_sizes_are_kept_for_one_largest_frame_of_pixels_in_all(tmp_path: Path) -> None:
    # An anomaly or segmentation plan holds frame-sized buffers: four plans of 8K-sized images held 3.2 GB.
    model = load_model(ModelConfig(path=colour_probe(tmp_path / "m.onnx")), RuntimeConfig())
    path = FramePath(model, "cam0", "bgr", sizes_vary=True)
    tall, wide, small = (3840, 4320), (4320, 3840), (128, 96)
    assert tall[0] * tall[1] + wide[0] * wide[1] == PLAN_PIXELS

    def plan_of(size: tuple[int, int]) -> FramePipeline:
        done = path.run(_frame(np.zeros((size[1], size[0], 3), np.uint8)))
        assert isinstance(done, Processed), done
        return done.plan

    first = {size: plan_of(size) for size in (tall, wide)}  # together as many pixels as kept: both stay
    assert plan_of(tall) is first[tall] and plan_of(wide) is first[wide]
    kept_small = plan_of(small)  # a few more: tall, the least recently used, goes
    assert plan_of(wide) is first[wide] and plan_of(small) is kept_small
    assert plan_of(tall) is not first[tall]


def test_an_image_whose_masks_would_pass_the_budget_is_rejected_while_a_camera_of_that_size_stops(
    tmp_path: Path,
) -> None:
    # 600 masks of a 1920x1080 frame need 1.2 GiB: an image of that size is skipped, the folder's others
    # carry on (before: its ModelError stopped the daemon with exit 78, which systemd does not restart).
    model = load_model(ModelConfig(path=TASKS / "seg.onnx", max_masks=600), RuntimeConfig())
    path = FramePath(model, "cam0", "bgr", sizes_vary=True)
    small = np.zeros((320, 180, 3), np.uint8)
    large = Frame(np.zeros((1080, 1920, 3), np.uint8), 1, 0, 0, "bgr", "big.png")
    first = path.run(_frame(small))
    assert isinstance(first, Processed)
    rejected = path.run(large)
    assert isinstance(rejected, Rejected) and rejected.reason == "bad_frame_size", rejected
    assert rejected.detail.startswith("big.png: model.max_masks = 600 would need 1.2 GiB of mask buffers for 1920x1080")
    again = path.run(_frame(small, 2))
    assert isinstance(again, Processed) and again.plan is first.plan
    with pytest.raises(ModelError, match=r"model\.max_masks = 600"):
        FramePath(model, "cam1", "bgr").run(large)  # every frame of a camera is that size


def test_a_camera_in_request_mode_gives_verdicts_without_inspect_and_a_free_one_none(tmp_path: Path) -> None:
    cfg = ModelConfig(path=fixed_scene(tmp_path / "m.onnx", [(16.0, 20.0, 8.0, 8.0, 0, 0.9)]))
    top, side = SyntheticSourceConfig(camera_id="top"), SyntheticSourceConfig(camera_id="side", trigger="free")
    settings = Settings(model=cfg, source=(top, side), trigger=TriggerConfig(mode="request"))
    model = load_model(cfg, RuntimeConfig())
    asked = frame_path(settings, model, top).run(_frame(np.full((96, 128, 3), 90, np.uint8)))
    assert isinstance(asked, Processed) and asked.inspected is not None and asked.inspected.verdict == "ng"
    assert frame_path(settings, model, side).inspector is None


@pytest.mark.unit
def test_a_tools_plan_is_kept_for_frames_of_its_size_and_order_and_made_anew_for_others(tmp_path: Path) -> None:
    model = load_model(ModelConfig(path=colour_probe(tmp_path / "m.onnx")), RuntimeConfig())
    small, large = np.zeros((96, 128, 3), np.uint8), np.zeros((120, 160, 3), np.uint8)
    first = planned(None, model, small)
    assert (first.spec.width, first.spec.height, first.spec.channel_order) == (128, 96, "bgr")
    assert planned(first, model, small) is first
    other = planned(first, model, large)
    assert other is not first and (other.spec.width, other.spec.height) == (160, 120)
    assert planned(other, model, large, "rgb").spec.channel_order == "rgb"
