"""Inference lanes on a real model: each camera's frame through its own path, on the loop's thread
with one lane and on lane threads with more; results collected in the order they finish."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from onnx_models import colour_probe, failing_probe, solid_frame, stalling_probe
from waiting import wait_for

from edged.camera import Camera
from edged.capture import Capture
from edged.config import ModelConfig, RuntimeConfig
from edged.errors import ModelError
from edged.lanes import Lanes
from edged.model import LoadedModel, load_model
from edged.pipeline import FramePath, Processed
from edged.settings.sources import SyntheticSourceConfig
from edged.sources.base import Frame
from edged.sources.registry import open_source

RED, BLUE, WHITE = (0, 0, 255), (255, 0, 0), (255, 255, 255)


def _camera(model: LoadedModel, name: str) -> Camera:
    """A camera whose capture is never started: the lanes only run its path."""
    cfg = SyntheticSourceConfig(camera_id=name)
    return Camera(cfg, Capture(lambda: open_source(cfg), name), FramePath(model, name, "bgr"), 0.0)


def _frame(colour: tuple[int, int, int], frame_id: int) -> Frame:
    return Frame(solid_frame(colour), frame_id, 0, 0, "bgr")


@pytest.fixture
def model(tmp_path: Path) -> LoadedModel:
    return load_model(ModelConfig(path=colour_probe(tmp_path / "probe.onnx")), RuntimeConfig())


def test_one_lane_runs_the_frame_on_the_callers_thread_and_holds_the_camera_until_collected(model: LoadedModel) -> None:
    wake = threading.Event()
    lanes = Lanes(1, wake)
    red = _camera(model, "red")
    threads = threading.active_count()
    lanes.submit(red, _frame(RED, 7))
    assert threading.active_count() == threads  # no lane thread: the result is here already
    assert lanes.carrying(red) and lanes.idle == 0
    [(camera, outcome)] = lanes.collect()
    assert camera is red and isinstance(outcome, Processed)
    assert outcome.frame.frame_id == 7 and outcome.result.class_ids.tolist() == [0]
    assert not lanes.carrying(red) and lanes.idle == 1 and lanes.collect() == []
    lanes.close()


def test_two_lanes_run_two_cameras_each_through_its_own_path(model: LoadedModel) -> None:
    wake = threading.Event()
    lanes = Lanes(2, wake)
    red, blue = _camera(model, "red"), _camera(model, "blue")
    try:
        lanes.submit(red, _frame(RED, 1))
        lanes.submit(blue, _frame(BLUE, 2))
        assert lanes.idle == 0 and lanes.carrying(red) and lanes.carrying(blue)
        assert wake.wait(30)  # set when a lane finishes a frame
        results = dict(lanes.drain(30))
        assert set(results) == {red, blue}
        got = {camera.id: outcome for camera, outcome in results.items()}
        assert all(isinstance(outcome, Processed) for outcome in got.values())
        assert got["red"].frame.frame_id == 1 and got["red"].result.class_ids.tolist() == [0]
        assert got["blue"].frame.frame_id == 2 and got["blue"].result.class_ids.tolist() == [1]
        assert lanes.idle == 2 and lanes.inferring() == {}
    finally:
        lanes.close()


def test_an_error_on_a_lane_is_raised_alone_and_the_results_beside_it_come_with_the_next_collect(
    tmp_path: Path, model: LoadedModel
) -> None:
    """A model that loads but fails on every run, its warm-up included, cannot plan a frame size:
    the ModelError the daemon turns into exit 78 must reach the loop's thread, once, and the other
    camera's result must not be lost with it (the daemon publishes it as it stops)."""
    broken = load_model(ModelConfig(path=failing_probe(tmp_path / "broken.onnx", brighter_than=-1.0)), RuntimeConfig())
    wake = threading.Event()
    lanes = Lanes(2, wake)
    failing, good = _camera(broken, "failing"), _camera(model, "good")
    try:
        lanes.submit(failing, _frame(RED, 0))
        lanes.submit(good, _frame(BLUE, 1))
        with pytest.raises(ModelError, match="fails on its first run"):
            lanes.drain(30)  # both frames done, whichever finished first
        assert not lanes.carrying(failing) and lanes.carrying(good)
        [(camera, outcome)] = lanes.collect()
        assert camera is good and isinstance(outcome, Processed) and outcome.frame.frame_id == 1
        assert lanes.idle == 2 and lanes.collect() == []
    finally:
        lanes.close()


def test_a_frame_that_outlasts_a_reload_stays_on_its_thread_and_keeps_its_camera_off_the_new_lanes(
    tmp_path: Path, model: LoadedModel
) -> None:
    """A reload goes from two lanes to one while a camera's frame is still in inference (seconds
    here, for ever on a hung accelerator): the wait for it is bounded, the camera the reload makes
    again (same id) is not handed a second run, the one new lane is free for the other cameras,
    the watchdog still sees the frame, and its result comes out later with the camera it was taken for."""
    slow_model = load_model(
        ModelConfig(path=stalling_probe(tmp_path / "slow.onnx", iterations_when_bright=3 * 10**6)), RuntimeConfig()
    )
    wake = threading.Event()
    lanes = Lanes(2, wake)
    slow = _camera(slow_model, "slow")
    try:
        lanes.submit(slow, _frame(WHITE, 3))
        assert wait_for(lambda: "slow" in lanes.inferring(), timeout_s=30)
        assert lanes.drain(0.1) == []
        lanes.resize(1)
        again, red = _camera(slow_model, "slow"), _camera(model, "red")
        assert lanes.carrying(again) and "slow" in lanes.inferring() and lanes.idle == 1
        lanes.submit(red, _frame(RED, 4))  # on this thread, at once: the slow frame takes no lane
        [(camera, outcome)] = lanes.collect()
        assert camera is red and isinstance(outcome, Processed) and outcome.frame.frame_id == 4
        [(camera, outcome)] = lanes.drain(120)
        assert camera is slow and isinstance(outcome, Processed) and outcome.frame.frame_id == 3
        assert lanes.idle == 1 and not lanes.carrying(again) and lanes.inferring() == {}
    finally:
        lanes.close()
