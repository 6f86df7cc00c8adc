"""Readiness and the watchdog's idea of progress, on an exact clock."""

from __future__ import annotations

from dataclasses import replace

from edged.capture import CaptureStats
from edged.health import Health, Watched
from edged.messages import CaptureState

S = 1_000_000_000


class Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def _capture(state: CaptureState = "ok", *, alive: bool = True, last_progress_ns: int = 0) -> CaptureStats:
    return CaptureStats(
        state=state,
        frames_captured=0,
        frames_decoded=0,
        dropped={},
        read_errors=0,
        unreadable=0,
        reconnects=0,
        size_changes=0,
        last_error=None,
        last_progress_ns=last_progress_ns,
        alive=alive,
    )


def test_ready_is_announced_once_on_the_first_frame() -> None:
    health = Health(10.0, Clock())
    assert not health.should_announce(frame_processed=False, capture_state="starting")
    assert health.should_announce(frame_processed=True, capture_state="ok")
    assert not health.should_announce(frame_processed=True, capture_state="ok")


def test_a_camera_lost_before_any_frame_is_announced_ready() -> None:
    health = Health(10.0, Clock())
    assert health.should_announce(frame_processed=False, capture_state="lost")
    assert health.ready


def test_healthy_while_frames_flow_and_not_once_they_stop() -> None:
    clock = Clock()
    health = Health(10.0, clock)
    clock.ns = 9 * S
    health.loop_turned()
    assert health.healthy({"cam0": _capture()})
    clock.ns = 11 * S
    health.loop_turned()
    assert not health.healthy({"cam0": _capture()})  # the loop turns but no frame for 11 s
    health.frame_done()
    assert health.healthy({"cam0": _capture()})


def test_a_wedged_loop_is_unhealthy_whatever_the_camera_does() -> None:
    clock = Clock()
    health = Health(10.0, clock)
    clock.ns = 11 * S
    health.frame_done()
    assert not health.healthy({"cam0": _capture(last_progress_ns=11 * S)})


def test_a_live_reconnect_counts_as_progress_and_a_dead_capture_thread_does_not() -> None:
    clock = Clock()
    health = Health(10.0, clock)
    clock.ns = 30 * S
    health.loop_turned()
    lost = _capture("lost", last_progress_ns=25 * S)
    assert health.healthy({"cam0": lost})
    assert not health.healthy({"cam0": replace(lost, last_progress_ns=15 * S)})  # the reconnect itself is stuck
    assert not health.healthy({"cam0": replace(lost, alive=False)})
    assert health.healthy({"cam0": replace(_capture("ended", alive=False), last_progress_ns=0)}) is False
    health.frame_done()
    assert health.healthy({"cam0": _capture("ended", alive=False)})  # a finished file is not a dead thread


def test_the_problem_says_why_the_watchdog_would_not_ping() -> None:
    clock = Clock()
    health = Health(10.0, clock)
    assert health.problem({"cam0": _capture()}) is None
    clock.ns = 12 * S
    assert health.problem({"cam0": _capture()}) == "the loop has not turned for 12.0 s"
    health.loop_turned()
    assert health.problem({"cam0": _capture("lost", last_progress_ns=0)}) == "no frame processed for 12.0 s (camera lost)"
    assert health.problem({"cam0": _capture("lost", last_progress_ns=5 * S)}) is None  # the reconnect is alive
    health.frame_done()
    assert "capture thread of camera cam0 died" in str(health.problem({"cam0": _capture(alive=False)}))


def test_one_camera_progressing_keeps_the_watchdog_pinging_and_a_dead_one_does_not() -> None:
    clock = Clock()
    health = Health(10.0, clock)
    clock.ns = 30 * S
    health.loop_turned()
    health.frame_done()  # frames from "top" flow
    cameras = {"top": _capture(last_progress_ns=30 * S), "side": _capture("lost", last_progress_ns=0)}
    assert health.healthy(cameras)
    cameras["side"] = replace(cameras["side"], alive=False)
    assert health.problem(cameras) == "the capture thread of camera side died: only a restart brings the camera back"
    clock.ns = 45 * S
    health.loop_turned()
    both_stuck = {"top": _capture(last_progress_ns=0), "side": _capture("lost", last_progress_ns=0)}
    assert health.problem(both_stuck) == "no frame processed for 15.0 s (top ok, side lost)"


def test_a_frame_stuck_in_inference_on_a_lane_stops_the_pings_however_the_others_flow() -> None:
    clock = Clock()
    health = Health(10.0, clock)
    clock.ns = 15 * S
    health.loop_turned()
    health.frame_done()  # the other camera's frames keep coming
    cameras = {"top": _capture(), "side": _capture()}
    assert health.problem(cameras, {"side": 6 * S}) is None  # 9 s in inference: not yet
    assert health.problem(cameras, {"side": 4 * S, "top": 2 * S}) == (
        "a frame of camera top has been in inference for 13.0 s: a hung model or provider"
    )


def test_the_stall_clock_starts_when_the_loop_takes_over_not_before_the_models_load() -> None:
    """A slow board's start: the health is made, then the model loads for 30 s, then the loop is watched."""
    clock = Clock()
    health = Health(10.0, clock)
    clock.ns = 30 * S
    health.watch(Watched((), dict))
    assert health.problem({"cam0": _capture()}) is None
    clock.ns = 41 * S
    assert health.problem({"cam0": _capture()}) == "the loop has not turned for 11.0 s"
    health.watch(Watched((), dict))  # a reload's: the clock goes on
    assert health.problem({"cam0": _capture()}) == "the loop has not turned for 11.0 s"
