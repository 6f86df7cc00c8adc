"""The thermal policy acting on the running daemon: heat a Pi 4 sysfs tree, watch the rate fall."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from daemon import RunningDaemon, board_config, free_port

from edged.messages import DetectionsMessage, StatusMessage

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).parent / "fixtures" / "thermal" / "rpi4"
ZONE_TEMP = "sys/class/thermal/thermal_zone0/temp"
FPS = 20.0


def _rate(d: RunningDaemon, seconds: float, captured_after_ns: int = 0) -> tuple[float, StatusMessage | None]:
    """Detections per second over a window (of frames captured after ``captured_after_ns``, wall
    clock), and the last status seen in it."""
    count, status = 0, None
    for msg in d.messages(seconds):
        if isinstance(msg, DetectionsMessage):
            count += msg.capture_time_ns > captured_after_ns
        else:
            status = msg  # type: ignore[assignment]
    return count / seconds, status


def _captured_after(d: RunningDaemon, after_ns: int, count: int) -> list[int]:
    """The capture times of the first ``count`` detections messages of frames captured after ``after_ns``."""
    times = []
    for msg in d.messages(30):
        if isinstance(msg, DetectionsMessage) and msg.capture_time_ns > after_ns:
            times.append(msg.capture_time_ns)
            if len(times) == count:
                return times
    raise AssertionError(f"only {len(times)} frames captured after the cap in 30 s:\n{d.log()}")


def _wait_state(d: RunningDaemon, state: str) -> StatusMessage:
    return d.wait_status(lambda s: s.thermal is not None and s.thermal.state == state, timeout=10)


def test_heating_lowers_the_published_rate_pauses_then_recovers(tmp_path: Path) -> None:
    root = tmp_path / "board"
    shutil.copytree(FIXTURE, root)
    heat = root / ZONE_TEMP
    heat.write_text("52000\n")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = board_config(tmp_path, root, endpoint, fps=FPS)
    d = RunningDaemon(config, endpoint)
    try:
        # Each step waits for what the daemon says and does, never for a rate a busy machine could
        # halve: a loaded board only measures its camera slower, so every rate bound is an upper one.
        ok = _wait_state(d, "ok")
        assert ok.thermal and ok.thermal.board == "raspberrypi" and ok.rate_cap_fps is None
        d.collect("detections", 5)

        heat.write_text("75000\n")  # Pi 4: warm from 70 C, half the camera's measured rate
        # The cap is half the camera's rate, which is measured over two seconds: in the daemon's
        # first moments a warm state may come before the rate, and the cap with the next status.
        warm = d.wait_status(lambda s: s.thermal is not None and s.thermal.state == "warm" and s.rate_cap_fps is not None)
        assert warm.rate_cap_fps is not None and 0 < warm.rate_cap_fps <= FPS / 2 * 1.2 + 1, warm.rate_cap_fps
        # Capped, not stopped. The cap follows the camera's measured rate, which a busy machine lowers
        # and raises again, so the bound is the highest it can be, half the file's 20 fps; and the rate
        # is read off the frames' capture times, as a subscriber that lags reads a backlog in a burst.
        frames = _captured_after(d, warm.time_ns + 500_000_000, 8)
        capped = (len(frames) - 1) * 1e9 / (frames[-1] - frames[0])
        assert capped <= FPS / 2 * 1.2 + 1, (capped, warm.rate_cap_fps)

        heat.write_text("90000\n")  # critical: inference pauses, status goes on
        critical = _wait_state(d, "critical")
        # A frame already on its way through the model when the state turned is still published:
        # none captured after the critical status is.
        late, status = _rate(d, 1.5, captured_after_ns=critical.time_ns)
        assert late == 0.0
        assert status is not None and status.thermal and status.thermal.state == "critical"
        assert "paused" in d.log() or "critical" in d.log()

        heat.write_text("50000\n")  # cooled well below every threshold
        recovered = _wait_state(d, "ok")
        assert recovered.rate_cap_fps is None
        d.collect("detections", 5)  # frames flow again
    finally:
        d.close()
