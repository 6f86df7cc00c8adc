"""The capture thread with real threads and real sources; a failing camera is faked at the Source boundary."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import cv2
import numpy as np
import pytest

from edged.capture import LOW_NICENESS, Capture
from edged.config import CapturePriority, FileSource, SyntheticSource
from edged.errors import SourceError
from edged.scenes import SceneGenerator
from edged.sources import Frame
from edged.sources.files import VideoFileSource
from edged.sources.synthetic import SceneTruth, SyntheticSceneSource

SEED = 3
SW, SH = 96, 64


def synthetic(fps: float) -> SyntheticSceneSource:
    return SyntheticSceneSource(SyntheticSource(width=SW, height=SH, fps=fps, seed=SEED))


Starter = Callable[[Capture], Capture]


def wait_for(predicate: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


@pytest.fixture
def started() -> Iterator[Starter]:
    """Start captures and make sure every one is stopped, whatever the test does."""
    captures: list[Capture] = []

    def start(capture: Capture) -> Capture:
        captures.append(capture)
        capture.start()
        return capture

    yield start
    for capture in captures:
        capture.stop()


class FakeCamera:
    """The physical device behind fresh ``FakeSource`` objects: its state survives reconnects.

    Every frame is filled with its serial number (mod 256) so a test can check that a held slot
    was never overwritten.
    """

    def __init__(
        self,
        *,
        fps: float = 200.0,
        fail_at: int | None = None,
        failed_opens: int = 0,
        never_back: bool = False,
        resize_at: int | None = None,
        frames: int | None = None,
        read_block_s: float = 0.0,
    ) -> None:
        self.fps = fps
        self.fail_at = fail_at
        self.failed_opens = failed_opens
        self.never_back = never_back
        self.resize_at = resize_at
        self.frames = frames
        self.read_block_s = read_block_s
        self.served = 0
        self.decoded = 0
        self.open_times: list[float] = []
        self.closed = 0
        self.shape = (24, 32, 3)

    def source(self) -> FakeSource:
        return FakeSource(self)


class FakeSource:
    channel_order: Literal["bgr", "rgb"] = "bgr"

    def __init__(self, camera: FakeCamera) -> None:
        self.camera = camera

    def open(self) -> None:
        cam = self.camera
        cam.open_times.append(time.monotonic())
        if cam.never_back or (len(cam.open_times) > 1 and cam.failed_opens > 0):
            cam.failed_opens -= 1
            raise SourceError("fake camera is unplugged")

    def read(self, out: np.ndarray | None) -> np.ndarray | None:
        cam = self.camera
        time.sleep(cam.read_block_s)
        if cam.frames is not None and cam.served >= cam.frames:
            return None
        if cam.fail_at is not None and cam.served == cam.fail_at:
            cam.fail_at = None
            raise SourceError("fake camera stopped delivering frames")
        if cam.resize_at is not None and cam.served == cam.resize_at:
            cam.shape = (48, 40, 3)
        if out is None or out.shape != cam.shape:
            out = np.empty(cam.shape, np.uint8)
        out.fill(cam.served % 256)
        cam.served += 1
        return out

    def pace(self) -> float:
        return 1.0 / self.camera.fps

    def close(self) -> None:
        self.camera.closed += 1


class SplitFakeSource(FakeSource):
    """A camera whose reading is split like OpenCV's: ``grab`` takes a frame, ``retrieve`` decodes it."""

    def grab(self) -> bool:
        self._grabbed = self.camera.served
        self.camera.served += 1
        return True

    def retrieve(self, out: np.ndarray | None) -> np.ndarray:
        self.camera.decoded += 1
        if out is None or out.shape != self.camera.shape:
            out = np.empty(self.camera.shape, np.uint8)
        out.fill(self._grabbed % 256)
        return out


def split_camera(fps: float) -> tuple[FakeCamera, Callable[[], SplitFakeSource]]:
    camera = FakeCamera(fps=fps)
    return camera, lambda: SplitFakeSource(camera)


def take_all(capture: Capture, count: int) -> list[Frame]:
    """Take ``count`` FakeCamera frames, checking each one's pixels while its slot is held."""
    frames = []
    for _ in range(count):
        frame = capture.take(timeout_s=2.0)
        assert frame is not None
        assert int(frame.image[0, 0, 0]) == frame.frame_id % 256
        frames.append(frame)
    return frames


# ---- latest-frame semantics ----------------------------------------------------------------------


def test_slow_consumer_gets_only_the_newest_frames_and_held_slots_stay_intact(started: Starter) -> None:
    capture = started(Capture(lambda: synthetic(fps=200.0), "cam0"))
    generator = SceneGenerator(width=SW, height=SH, seed=SEED)
    ids = []
    for _ in range(10):
        newest_before = capture.stats().frames_captured - 1
        frame = capture.take(timeout_s=3.0)
        assert frame is not None
        assert frame.frame_id >= newest_before  # never older than what was available at take time
        time.sleep(0.03)  # a slow model; meanwhile the thread keeps capturing into the other slots
        expected = generator.render(frame.frame_id)
        np.testing.assert_array_equal(frame.image, expected.image)
        assert isinstance(frame.truth, SceneTruth) and frame.truth.index == frame.frame_id
        np.testing.assert_array_equal(frame.truth.boxes, expected.boxes)
        ids.append(frame.frame_id)
    stats = capture.stats()
    assert ids == sorted(set(ids))
    assert any(b - a > 1 for a, b in itertools.pairwise(ids))
    assert stats.dropped_stale > 0
    assert stats.frames_captured >= ids[-1] + 1
    assert capture.state == "ok"


def test_fast_consumer_gets_every_frame_once_from_three_slots(started: Starter) -> None:
    camera = FakeCamera(fps=20.0)
    capture = started(Capture(camera.source, "cam0"))
    frames = take_all(capture, 10)
    ids = [f.frame_id for f in frames]
    assert ids == list(range(10))
    assert capture.stats().dropped_stale == 0
    # Steady state reuses the preallocated slots: no new frame buffers.
    assert len({f.image.ctypes.data for f in frames}) <= 3


# ---- decoding only what the consumer takes ---------------------------------------------------------


def take_every(capture: Capture, interval_s: float, duration_s: float) -> list[tuple[Frame, int]]:
    """A consumer busy for ``interval_s`` per frame: each frame taken with the newest id grabbed before."""
    taken = []
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        newest_grabbed = capture.stats().frames_captured - 1
        frame = capture.take(timeout_s=2.0)
        assert frame is not None
        assert int(frame.image[0, 0, 0]) == frame.frame_id % 256
        taken.append((frame, newest_grabbed))
        time.sleep(interval_s)
    return taken


def test_frames_a_slow_consumer_would_not_take_are_grabbed_but_never_decoded(started: Starter) -> None:
    camera, source = split_camera(fps=100.0)
    capture = started(Capture(source, "cam0"))
    taken = take_every(capture, 0.08, 0.8)  # the capture thread learns the consumer's pace
    decoded, captured = camera.decoded, capture.stats().frames_captured
    taken += take_every(capture, 0.08, 1.2)
    capture.stop()
    stats = capture.stats()
    assert stats.frames_decoded == camera.decoded
    # Eight frames arrive per frame taken; only the last one or two before each take are decoded.
    assert camera.decoded - decoded < 0.35 * (stats.frames_captured - captured)
    assert stats.frames_captured >= 100 * 2.0 * 0.8
    assert stats.dropped_stale == stats.frames_captured - len(taken) - (capture.take(0.0) is not None)
    # Still the newest frame: never older than the one grabbed last before the take, but for the
    # frame or two that arrive while the consumer is faster than its pace so far.
    late = [frame.frame_id for frame, newest in taken if frame.frame_id < newest - 2]
    assert len(late) <= 2, late


def test_a_consumer_as_fast_as_the_camera_has_every_frame_decoded(started: Starter) -> None:
    camera, source = split_camera(fps=40.0)
    capture = started(Capture(source, "cam0"))
    frames = take_all(capture, 20)
    assert [f.frame_id for f in frames] == list(range(20))
    assert capture.stats().dropped_stale == 0
    assert camera.decoded >= 20


def test_decode_all_decodes_every_frame_for_a_slow_consumer(started: Starter) -> None:
    camera, source = split_camera(fps=100.0)
    capture = started(Capture(source, "cam0", decode_all=True))
    take_every(capture, 0.08, 0.8)
    stats = capture.stats()
    assert stats.frames_decoded == camera.decoded == stats.frames_captured


def test_a_consumer_that_stops_asking_stops_the_decoding_and_gets_a_fresh_frame_when_it_asks(started: Starter) -> None:
    camera, source = split_camera(fps=100.0)
    capture = started(Capture(source, "cam0"))
    taken = take_every(capture, 0.02, 0.4)  # a steady consumer, then a pause (say thermal) of 2 s
    decoded_before, captured_before = camera.decoded, capture.stats().frames_captured
    time.sleep(2.0)
    # Decoding goes on for about AWAY_NS past the consumer's usual cycle, then stops.
    assert camera.decoded - decoded_before <= 100 * (1.0 + 0.5)
    assert capture.stats().frames_captured - captured_before >= 100 * 2.0 * 0.8
    paused_decodes = camera.decoded
    time.sleep(0.3)
    assert camera.decoded == paused_decodes
    newest_grabbed = capture.stats().frames_captured - 1
    frame = capture.take(timeout_s=1.0)
    # Not a frame from before the pause: the next one grabbed, decoded when asked for.
    assert frame is not None and frame.frame_id > newest_grabbed
    assert (time.monotonic_ns() - frame.t_capture_ns) / 1e6 < 100
    capture.stop()
    stats = capture.stats()
    # Every frame is taken, still pending, or counted as dropped: the one left from before the pause too.
    pending = capture.take(0.0) is not None
    assert stats.dropped_stale == stats.frames_captured - (len(taken) + 1) - pending


@pytest.mark.parametrize(
    ("split", "decode_all", "says"),
    [
        (True, False, "decoding only the frames the model may take"),
        (True, True, "decoding every frame"),
        (False, False, "decoding every frame"),
    ],
)
def test_the_first_frame_logs_how_frames_are_decoded(
    started: Starter, caplog: pytest.LogCaptureFixture, split: bool, decode_all: bool, says: str
) -> None:
    caplog.set_level(logging.INFO, logger="edged.capture")
    camera, split_source = split_camera(fps=100.0)
    capture = started(Capture(split_source if split else camera.source, "cam0", decode_all=decode_all))
    assert capture.take(timeout_s=2.0) is not None  # the line follows the first frame's hand-over
    assert wait_for(lambda: f"camera cam0: delivering 32x24 frames, {says}" in caplog.messages)


def test_take_times_out_when_no_frame_arrives(started: Starter) -> None:
    capture = started(Capture(FakeCamera(fps=2.0).source, "cam0"))
    assert capture.take(timeout_s=2.0) is not None
    start = time.monotonic()
    assert capture.take(timeout_s=0.1) is None
    assert 0.09 <= time.monotonic() - start < 0.4


@pytest.mark.parametrize(
    ("priority", "added", "policy"),
    [("normal", 0, os.SCHED_OTHER), ("low", LOW_NICENESS, os.SCHED_OTHER), ("idle", 0, os.SCHED_IDLE)],
)
def test_capture_thread_alone_runs_at_its_priority(
    started: Starter, priority: CapturePriority, added: int, policy: int
) -> None:
    # Read back from the kernel: the capture thread's nice value or policy changes, the caller's does not.
    me = threading.get_native_id()
    base = os.getpriority(os.PRIO_PROCESS, me)
    capture = started(Capture(FakeCamera(fps=50.0).source, "prio-cam", priority=priority))
    assert capture.take(timeout_s=2.0) is not None
    (thread,) = [t for t in threading.enumerate() if t.name == "capture-prio-cam"]
    assert thread.native_id is not None
    assert os.sched_getscheduler(thread.native_id) == policy
    if policy == os.SCHED_OTHER:
        assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == min(19, base + added)
    assert os.getpriority(os.PRIO_PROCESS, me) == base and os.sched_getscheduler(me) == os.SCHED_OTHER


# ---- lost cameras ----------------------------------------------------------------------------------


def test_camera_lost_mid_stream_reconnects_with_backoff_and_ids_continue(
    started: Starter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="edged.capture")
    camera = FakeCamera(fps=100.0, fail_at=5, failed_opens=2)
    capture = started(Capture(camera.source, "cam7", backoff_initial_s=0.05, backoff_max_s=0.15))
    before = take_all(capture, 1)
    assert wait_for(lambda: capture.state == "lost")
    assert wait_for(lambda: capture.state == "ok" and len(camera.open_times) == 4)
    after = take_all(capture, 3)
    ids = [f.frame_id for f in before + after]
    assert ids == sorted(set(ids)) and ids[-1] >= 5  # no reset after the reconnect

    stats = capture.stats()
    assert stats.read_errors == 1 and stats.reconnects == 3
    assert stats.last_error == "fake camera is unplugged"
    # Backoff 0.05, 0.1, 0.15 (capped), each shortened by at most 25% jitter.
    gaps = np.diff(camera.open_times)
    assert list(gaps >= np.array([0.05, 0.1, 0.15]) * 0.75) == [True, True, True]
    assert camera.closed >= 1

    messages = [r.getMessage() for r in caplog.records]
    assert sum("lost" in m for m in messages) == 1
    assert sum("back after 3 failed" in m for m in messages) == 1
    assert all(getattr(r, "CAMERA", None) == "cam7" for r in caplog.records)


def test_camera_that_never_comes_back_keeps_retrying_quietly(started: Starter, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="edged.capture")
    camera = FakeCamera(never_back=True)
    capture = started(Capture(camera.source, "cam0", backoff_initial_s=0.01, backoff_max_s=0.02))
    assert capture.take(timeout_s=0.3) is None
    first = capture.stats()
    time.sleep(0.3)
    second = capture.stats()
    assert capture.state == "lost" and second.alive
    assert second.last_progress_ns > first.last_progress_ns
    assert second.reconnects > first.reconnects >= 5
    assert second.frames_captured == 0
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= 1 + second.reconnects // 10 + 1


def test_stop_returns_quickly_while_waiting_to_reconnect(started: Starter) -> None:
    camera = FakeCamera(never_back=True)
    capture = started(Capture(camera.source, "cam0", backoff_initial_s=5.0, backoff_max_s=10.0))
    assert wait_for(lambda: len(camera.open_times) == 1 and capture.state == "lost")
    time.sleep(0.05)
    start = time.monotonic()
    capture.stop()
    assert time.monotonic() - start < 1.0
    assert not capture.stats().alive


def test_stop_gives_up_on_a_blocked_read_and_the_thread_releases_the_camera_later(started: Starter) -> None:
    camera = FakeCamera(fps=100.0, read_block_s=0.6)
    capture = started(Capture(camera.source, "cam0"))
    time.sleep(0.1)  # inside the first read
    start = time.monotonic()
    capture.stop(timeout_s=0.2)
    assert time.monotonic() - start < 0.5
    assert wait_for(lambda: not capture.stats().alive, timeout_s=2.0)
    assert camera.closed == 1


def test_heartbeat_moves_while_a_slow_source_is_paced(started: Starter) -> None:
    capture = started(Capture(FakeCamera(fps=0.2).source, "cam0"))
    assert capture.take(timeout_s=1.0) is not None
    first = capture.stats().last_progress_ns
    time.sleep(1.2)
    assert capture.stats().last_progress_ns > first


# ---- sizes and endings ----------------------------------------------------------------------------


def test_size_change_mid_stream_reallocates_slots_and_keeps_the_held_frame(started: Starter) -> None:
    camera = FakeCamera(fps=100.0, resize_at=6)
    capture = started(Capture(camera.source, "cam0"))
    held = capture.take(timeout_s=2.0)
    assert held is not None and held.image.shape == (24, 32, 3)
    held_value = int(held.image[0, 0, 0])
    assert wait_for(lambda: capture.stats().size_changes == 1)
    time.sleep(0.05)  # several new-size frames are captured while the old one is held
    np.testing.assert_array_equal(held.image, held_value)
    later = take_all(capture, 4)
    assert all(f.image.shape == (48, 40, 3) for f in later)
    assert capture.stats().size_changes == 1


def test_finite_source_without_loop_ends(tmp_path: Path, started: Starter) -> None:
    path = tmp_path / "short.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), 30.0, (64, 32))
    for i in range(8):
        writer.write(np.full((32, 64, 3), 30 * i, np.uint8))
    writer.release()
    cfg = FileSource(path=path, loop=False, realtime=True)
    capture = started(Capture(lambda: VideoFileSource(cfg), "cam0"))
    frames = []
    while (frame := capture.take(timeout_s=2.0)) is not None:
        frames.append(frame.frame_id)
    assert capture.state == "ended"
    assert frames[-1] == 7 and capture.stats().frames_captured == 8
    assert wait_for(lambda: not capture.stats().alive)
    start = time.monotonic()
    assert capture.take(timeout_s=1.0) is None
    assert time.monotonic() - start < 0.1


def test_a_source_bug_ends_the_thread_visibly(started: Starter) -> None:
    class Broken(FakeSource):
        def read(self, out: np.ndarray | None) -> np.ndarray | None:
            raise ZeroDivisionError("bug")

    capture = started(Capture(lambda: Broken(FakeCamera()), "cam0"))
    assert wait_for(lambda: not capture.stats().alive)
    assert "ZeroDivisionError" in (capture.stats().last_error or "")


def test_start_twice_is_an_error(started: Starter) -> None:
    capture = started(Capture(FakeCamera().source, "cam0"))
    with pytest.raises(RuntimeError):
        capture.start()
