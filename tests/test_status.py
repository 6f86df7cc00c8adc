"""The status message and STATUS= line, built from one snapshot of the running parts."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from edged.capture import CaptureStats
from edged.messages import MemoryReadings, ModelInfo
from edged.output import OutputReport
from edged.stats import RunStats
from edged.status import Snapshot, summary_line

MODEL = ModelInfo(name="probe", sha256="ab" * 32, provider="CPUExecutionProvider")


def _snapshot(rate_cap: float | None = None) -> Snapshot:
    stats = RunStats()
    stats.record(1.0, 2.0, 0.5, 4.0)
    stats.drops = Counter({"bad_frame_size": 2})
    capture = CaptureStats(
        state="lost",
        frames_captured=10,
        frames_decoded=8,
        dropped={"stale_slow": 3, "rate_capped": 5, "not_requested": 0},
        read_errors=1,
        unreadable=0,
        reconnects=2,
        size_changes=0,
        last_error="gone",
        last_progress_ns=0,
        alive=True,
    )
    return Snapshot(
        "cam3", stats, capture, rate_cap, None, MODEL, "probe@abababababab", (OutputReport(drops={"publish_full": 4}),)
    )


def test_drops_gather_every_cause_from_every_part() -> None:
    assert _snapshot().drops() == {
        "bad_frame_size": 2,
        "stale_slow": 3,
        "rate_capped": 5,
        "not_requested": 0,
        "read_error": 1,
        "publish_full": 4,
    }


def test_images_a_source_could_not_read_are_among_the_drops() -> None:
    # An image folder's unreadable images: "skipped, logged and counted", and the count is here.
    snapshot = _snapshot()
    counted = replace(snapshot, capture=replace(snapshot.capture, unreadable=2)).drops()
    assert counted["unreadable_image"] == 2
    assert "unreadable_image" not in snapshot.drops()  # a camera that skips none does not show the cause


def test_the_message_says_what_the_parts_say() -> None:
    msg = _snapshot(rate_cap=7.456).message(seq=5)
    assert (msg.camera_id, msg.seq, msg.source_state, msg.frames_processed) == ("cam3", 5, "lost", 1)
    assert msg.rate_cap_fps == 7.46 and msg.thermal is None and msg.model == MODEL
    assert msg.latency["inference"].p50_ms == 2.0
    assert msg.capture is not None
    assert (msg.capture.frames_captured, msg.capture.frames_decoded, msg.capture.reconnects) == (10, 8, 2)
    assert msg.capture.last_error == "gone"


def test_the_status_line_names_camera_cap_thermal_and_model() -> None:
    assert _snapshot().line() == "0.0 fps | camera lost | thermal off | 1 frames | model probe@abababababab"
    assert " cap 7.5fps " in _snapshot(rate_cap=7.456).line()


def test_the_status_line_of_several_cameras_names_each_and_sums_the_frames() -> None:
    lost = _snapshot()
    ok = replace(_snapshot(), camera_id="side", capture=replace(lost.capture, state="ok"))
    assert summary_line([lost]) == lost.line()  # one camera: its own line, as before
    assert summary_line([lost, ok]) == (
        "2 cameras: cam3 0.0 fps lost, side 0.0 fps ok | thermal off | 2 frames | model probe@abababababab"
    )


def test_the_status_line_ends_with_what_withholds_the_watchdog_pings() -> None:
    lost = _snapshot()
    ok = replace(_snapshot(), camera_id="side", capture=replace(lost.capture, state="ok"))
    hung = "a frame of camera cam3 has been in inference for 9.0 s: a hung model or provider"
    assert summary_line([lost, ok], hung) == (
        "2 cameras: cam3 0.0 fps lost, side 0.0 fps ok | thermal off | 2 frames | model probe@abababababab"
        f" | unhealthy: {hung}"
    )
    assert summary_line([lost], hung) == f"{lost.line()} | unhealthy: {hung}"


def test_the_status_line_says_memory_only_while_near_its_limit() -> None:
    mib = 2**20
    near = MemoryReadings(limit_bytes=512 * mib, used_bytes=486 * mib, cgroup_bytes=500 * mib, oom_kills=0)
    lost = replace(_snapshot(), memory=near)
    assert lost.line() == (
        "0.0 fps | camera lost | thermal off | memory 95 % of its 512 MiB limit | 1 frames | model probe@abababababab"
    )
    ok = replace(lost, camera_id="side", capture=replace(lost.capture, state="ok"))
    assert " | thermal off | memory 95 % of its 512 MiB limit | 2 frames | " in summary_line([lost, ok])
    below = replace(lost, memory=near.model_copy(update={"used_bytes": 460 * mib}))  # under 90 %: not said
    assert below.line() == _snapshot().line()
