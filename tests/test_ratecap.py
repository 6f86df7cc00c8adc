"""The frame-rate cap, on an exact clock: max_fps, the camera's measured rate, the thermal factor."""

from __future__ import annotations

import pytest

from edged.ratecap import RateCap


class Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def test_uncapped_without_max_fps_or_throttling() -> None:
    cap = RateCap(0.0, Clock())
    assert cap.fps is None
    assert cap.update(frames_captured=0, rate_factor=1.0) is None
    assert cap.wait_s(started_s=10.0, now_s=10.0) == 0.0


def test_max_fps_caps_and_the_wait_fills_the_frame_interval() -> None:
    cap = RateCap(5.0, Clock())
    assert cap.update(frames_captured=0, rate_factor=1.0) == 5.0
    assert cap.wait_s(started_s=10.0, now_s=10.05) == pytest.approx(0.15)
    assert cap.wait_s(started_s=10.0, now_s=10.5) == 0.0  # a slow frame waits for nothing


def test_throttling_scales_the_cameras_measured_rate_when_no_max_fps() -> None:
    clock = Clock()
    cap = RateCap(0.0, clock)
    clock.ns = 3_000_000_000
    cap.update(frames_captured=90, rate_factor=1.0)  # 30 fps measured over three seconds
    assert cap.source_fps == pytest.approx(30.0)
    assert cap.update(frames_captured=90, rate_factor=0.5) == pytest.approx(15.0)
    assert cap.update(frames_captured=90, rate_factor=1.0) is None  # cooled down: uncapped again


def test_throttling_scales_max_fps_when_set() -> None:
    cap = RateCap(10.0, Clock())
    assert cap.update(frames_captured=0, rate_factor=0.25) == pytest.approx(2.5)


def test_the_cameras_rate_is_measured_over_at_least_two_seconds() -> None:
    clock = Clock()
    cap = RateCap(0.0, clock)
    clock.ns = 1_000_000_000
    cap.update(frames_captured=33, rate_factor=1.0)
    assert cap.source_fps == 0.0  # a frame or two at a second's edges is a tenth of its count
    clock.ns = 2_100_000_000
    cap.update(frames_captured=63, rate_factor=1.0)
    assert cap.source_fps == pytest.approx(30.0)
