"""The picamera2 source against a fake picamera2 at the import boundary (tests/fakes/picamera2).

The fake mirrors picamera2 0.3.36 (raspberrypi/picamera2 at 3e6dff0): its docstring lists the
behaviour edged relies on. It is on ``sys.path`` only inside these tests.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError
from waiting import wait_for

from edged.capture import Capture
from edged.config import Settings
from edged.errors import EXIT_CONFIG, ConfigError, MissingDependency, SourceError
from edged.settings.sources import Picamera2SourceConfig
from edged.sources.picamera2 import Picamera2Source
from edged.sources.registry import config_problems, open_source

FAKES = Path(__file__).parent / "fakes"
SCENE = (200, 120, 40)  # R, G, B: three different values, so any channel swap shows


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The fake picamera2 importable as ``picamera2``, with no camera yet; gone again after the test."""
    for name in ("picamera2", "libcamera"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(FAKES))
    import picamera2

    picamera2.SENSORS.clear()
    yield picamera2
    for name in ("picamera2", "libcamera"):
        sys.modules.pop(name, None)


def sensor(fake: ModuleType, **options: Any) -> Any:
    s = fake.Sensor(colour=SCENE, **options)
    fake.SENSORS.append(s)
    return s


def config(**keys: Any) -> Picamera2SourceConfig:
    return Picamera2SourceConfig(**({"width": 100, "height": 64, "fps": 100.0} | keys))


@pytest.fixture
def captures() -> Iterator[list[Capture]]:
    started: list[Capture] = []
    yield started
    for capture in started:
        capture.stop()


def start(captures: list[Capture], cfg: Picamera2SourceConfig) -> Capture:
    capture = Capture(lambda: open_source(cfg), cfg.camera_id, backoff_initial_s=0.05, backoff_max_s=0.1)
    captures.append(capture)
    capture.start()
    return capture


# ---- configuration -----------------------------------------------------------------------------


def test_config_defaults_and_controls_table() -> None:
    cfg = Settings.model_validate(
        {"model": {"path": "m.onnx"}, "source": {"type": "picamera2", "controls": {"ExposureTime": 8000, "AfMode": 2}}}
    ).source[0]
    assert isinstance(cfg, Picamera2SourceConfig)
    assert (cfg.camera, cfg.width, cfg.height, cfg.fps, cfg.buffer_count) == (0, 1280, 720, 30.0, 4)
    assert cfg.controls == {"ExposureTime": 8000, "AfMode": 2}


@pytest.mark.parametrize("name", ["FrameDurationLimits", "FrameRate"])
def test_frame_rate_controls_belong_to_fps(name: str) -> None:
    with pytest.raises(ValidationError, match=f"{name} is set from source.fps"):
        Picamera2SourceConfig(controls={name: [33333, 33333]})


def test_missing_picamera2_refused_when_config_loads_with_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "picamera2", None)  # import picamera2 raises ImportError
    (problem,) = config_problems(config())
    assert "python3-picamera2" in problem and "--system-site-packages" in problem
    with pytest.raises(MissingDependency) as e:
        Picamera2Source(config()).open()
    assert e.value.exit_code == EXIT_CONFIG


def test_present_picamera2_is_no_problem(fake: ModuleType) -> None:
    assert config_problems(config()) == []


# ---- opening -------------------------------------------------------------------------------------


def test_open_configures_main_stream_rate_buffers_flips_and_controls(fake: ModuleType) -> None:
    cam = sensor(fake)
    source = Picamera2Source(
        config(buffer_count=5, fps=50.0, hflip=True, controls={"ExposureTime": 8000, "AnalogueGain": 2.0})
    )
    source.open()
    try:
        assert cam.config["main"]["size"] == (100, 64)
        assert cam.config["main"]["format"] == "RGB888"  # BGR in memory
        assert cam.config["buffer_count"] == 5
        assert cam.config["controls"]["FrameDurationLimits"] == (20000, 20000)
        transform = cam.config["transform"]
        assert (transform.hflip, transform.vflip) == (True, False)
        assert cam.set_controls == {"ExposureTime": 8000, "AnalogueGain": 2.0}
    finally:
        source.close()
        source.close()  # closing twice is safe
    assert cam.open_count == 0


def test_unknown_control_is_a_config_error_naming_valid_ones_and_releases_the_camera(fake: ModuleType) -> None:
    cam = sensor(fake)
    source = Picamera2Source(config(controls={"Exposure": 8000}))
    with pytest.raises(ConfigError) as e:
        source.open()
    assert e.value.exit_code == EXIT_CONFIG
    assert "no control Exposure" in str(e.value) and "ExposureTime" in str(e.value) and "AfMode" in str(e.value)
    assert cam.open_count == 0


def test_missing_camera_index_lists_what_libcamera_sees(fake: ModuleType) -> None:
    sensor(fake, model="imx477")
    with pytest.raises(SourceError, match=r"no Raspberry Pi camera 1: libcamera lists 0: imx477"):
        Picamera2Source(config(camera=1)).open()


def test_busy_camera_and_failing_start_are_source_errors_that_release_it(fake: ModuleType) -> None:
    cam = sensor(fake)
    cam.busy = True
    with pytest.raises(SourceError, match="cannot open Raspberry Pi camera 0: Camera __init__"):
        Picamera2Source(config()).open()
    cam.busy = False
    cam.fail_start = "Failed to start camera: Device or resource busy"
    with pytest.raises(SourceError, match="cannot start Raspberry Pi camera 0: Failed to start"):
        Picamera2Source(config()).open()
    assert cam.open_count == 0


# ---- reading ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("order", "fmt", "expected"), [("bgr", "RGB888", SCENE[::-1]), ("rgb", "BGR888", SCENE)])
def test_colour_order_follows_channel_order(
    fake: ModuleType, captures: list[Capture], order: str, fmt: str, expected: Any
) -> None:
    cam = sensor(fake)
    capture = start(captures, config(channel_order=order))
    frame = capture.take(5.0)
    assert frame is not None
    assert cam.config["main"]["format"] == fmt
    assert frame.channel_order == order
    assert frame.image.shape == (64, 100, 3)
    assert tuple(frame.image[10, 50]) == expected
    assert tuple(frame.image[-1, -1]) == expected


def test_read_copies_a_strided_view_into_out_once_and_releases_the_request(fake: ModuleType) -> None:
    cam = sensor(fake)
    source = Picamera2Source(config())
    source.open()
    try:
        assert cam.config["main"]["stride"] > 100 * 3  # padded rows: the view is not contiguous
        out = np.zeros((64, 100, 3), np.uint8)
        assert source.read(out) is out
        assert tuple(out[1, 0]) == SCENE[::-1]
        assert cam.outstanding == 0
        other = source.read(np.zeros((32, 32, 3), np.uint8))  # a slot of another size: a new array
        assert other.shape == (64, 100, 3) and other.flags.c_contiguous
        assert cam.outstanding == 0
    finally:
        source.close()


def test_capture_time_is_the_sensor_timestamp(fake: ModuleType, captures: list[Capture]) -> None:
    # A frame completes 200 ms after its exposure: stamping it when read would make it look 200 ms younger.
    sensor(fake, latency_s=0.2)
    capture = start(captures, config(fps=50.0))
    frame = capture.take(5.0)
    assert frame is not None
    cam = fake.SENSORS[0]
    stamp = next(s for s in cam.handed if cam.index_of(s) % 256 == frame.image[0, 0, 0])
    assert stamp <= frame.t_capture_ns < stamp + 100_000_000
    assert time.monotonic_ns() - frame.t_capture_ns >= 200_000_000


def test_a_frame_queued_before_a_pause_is_dropped_for_a_fresh_one(fake: ModuleType) -> None:
    cam = sensor(fake)
    source = Picamera2Source(config())
    source.open()
    try:
        source.read(None)
        cam.leave_queued(age_s=2.0)
        called = time.monotonic_ns()
        image = source.read(None)
        stale, fresh = cam.handed[-2:]
        assert called - stale >= 2_000_000_000  # what picamera2 handed first, released unused
        assert fresh - cam.exposure_us * 1000 >= called  # exposed after the read began
        assert image[0, 0, 0] == cam.index_of(fresh) % 256
        assert cam.outstanding == 0
        assert source.frame_age_ns() < 1_000_000_000
    finally:
        source.close()


def test_a_recent_queued_frame_is_taken_as_is(fake: ModuleType) -> None:
    cam = sensor(fake)
    source = Picamera2Source(config())
    source.open()
    try:
        cam.leave_queued(age_s=0.01)
        source.read(None)
        assert len(cam.handed) == 1  # the queued request, taken as the newest frame
    finally:
        source.close()


def test_camera_gone_mid_stream_is_lost_then_back_with_frame_ids_going_on(fake: ModuleType, captures: list[Capture]) -> None:
    cam = sensor(fake)
    capture = start(captures, config())
    before = capture.take(5.0)
    assert before is not None
    cam.unplug()
    assert wait_for(lambda: capture.state == "lost", timeout_s=10.0)
    assert "delivered no frame" in (capture.stats().last_error or "")
    cam.plug()
    assert wait_for(lambda: capture.state == "ok", timeout_s=10.0)
    after = capture.take(5.0)
    assert after is not None and after.frame_id > before.frame_id
    assert capture.stats().reconnects >= 1


def test_camera_that_fails_to_start_is_retried_until_it_starts(fake: ModuleType, captures: list[Capture]) -> None:
    cam = sensor(fake)
    cam.fail_start = "Failed to start camera"
    capture = start(captures, config())
    assert wait_for(lambda: capture.stats().read_errors == 0 and capture.state == "lost", timeout_s=5.0)
    assert "Failed to start camera" in (capture.stats().last_error or "")
    cam.fail_start = None
    assert capture.take(5.0) is not None
    assert capture.state == "ok"
    capture.stop()
    assert cam.open_count == 0


def test_an_unknown_control_stops_capture_with_the_config_error_not_a_retry_loop(
    fake: ModuleType, captures: list[Capture]
) -> None:
    cam = sensor(fake)
    capture = start(captures, config(controls={"Exposure": 8000}))
    assert capture.take(5.0) is None  # the ring closes at once: no frame, no retry
    assert isinstance(capture.fatal, ConfigError) and capture.fatal.exit_code == EXIT_CONFIG
    assert capture.stats().reconnects == 0 and cam.open_count == 0
