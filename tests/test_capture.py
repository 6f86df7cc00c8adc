"""The capture thread with a real thread and real sources; a failing camera is faked at the Source boundary.

Most tests run the thread on a `ManualClock`: it moves only when the test says, and the thread's
pacing and backoff waits block until it has, so every frame, skip and reconnect happens at a known
time and the tests need no sleeps. The slot ring itself is tested in tests/test_latest.py.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import cv2
import numpy as np
import pytest
from waiting import wait_for

from edged.backoff import JITTER, Backoff
from edged.capture import HEARTBEAT_S, LOG_EVERY_N_FAILURES, LOW_NICENESS, Capture, CaptureStats
from edged.config import CapturePriority
from edged.demand import AWAY_NS
from edged.errors import SourceError
from edged.settings.sources import FileSourceConfig, SyntheticSourceConfig
from edged.sources.base import Frame, Source
from edged.sources.file import FileSource
from edged.sources.scenes import SceneGenerator
from edged.sources.synthetic import SyntheticSource

SEED = 3
SW, SH = 96, 64
S = 1_000_000_000  # ns


def synthetic(fps: float) -> SyntheticSource:
    return SyntheticSource(SyntheticSourceConfig(width=SW, height=SH, fps=fps, seed=SEED))


class ManualClock:
    """A monotonic clock that the test moves; the capture thread's waits block until it has moved past their end.

    Every wait is recorded, so a test knows what the thread waited for, and that once it waits
    again everything it did before is done: the test and the thread run in lock-step.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._now_ns = 0
        self._end_ns = 0  # where the wait in progress ends
        self._closed = False
        self.waits: list[float] = []  # seconds, as the thread asked for them

    def __call__(self) -> int:
        with self._cond:
            return self._now_ns

    def wait(self, seconds: float) -> bool:
        with self._cond:
            self.waits.append(seconds)
            end = self._end_ns = self._now_ns + round(seconds * 1e9)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._now_ns >= end or self._closed)
            return self._closed

    def advance(self, seconds: float) -> None:
        with self._cond:
            self._now_ns += round(seconds * 1e9)
            self._cond.notify_all()

    def waiting(self, count: int) -> None:
        """Return once the thread has begun its ``count``-th wait."""
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.waits) >= count, timeout=10.0), f"no wait #{count}: {self.waits}"

    def step(self, count: int = 1) -> None:
        """``count`` times: let the wait in progress end and return once the thread waits again."""
        for _ in range(count):
            with self._cond:
                started = len(self.waits)
                self._now_ns = max(self._now_ns, self._end_ns)
                self._cond.notify_all()
            self.waiting(started + 1)

    def close(self) -> None:
        """End every wait as if capture were stopped."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class Captures:
    """Starts a test's captures and stops every one afterwards, whatever the test does."""

    def __init__(self) -> None:
        self._captures: list[Capture] = []
        self._clocks: list[ManualClock] = []

    def start(self, capture: Capture) -> Capture:
        self._captures.append(capture)
        capture.start()
        return capture

    def on_clock(
        self, factory: Callable[[], Source], clock: ManualClock | None = None, camera_id: str = "cam0", **options: Any
    ) -> tuple[Capture, ManualClock]:
        """A capture on a `ManualClock`, started; ``options`` are `Capture`'s."""
        clock = clock or ManualClock()
        self._clocks.append(clock)
        return self.start(Capture(factory, camera_id, clock=clock, wait=clock.wait, **options)), clock

    def stop_all(self) -> None:
        for clock in self._clocks:
            clock.close()
        for capture in self._captures:
            capture.stop()


@pytest.fixture
def captures() -> Iterator[Captures]:
    started = Captures()
    yield started
    started.stop_all()


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
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.fps = fps
        self.fail_at = fail_at
        self.failed_opens = failed_opens
        self.never_back = never_back
        self.resize_at = resize_at
        self.clock = clock
        self.in_read = threading.Event()
        self.release: threading.Event | None = None  # when set, every read blocks until it is
        self.slow_read: Callable[[], None] | None = None  # run inside the next read, once
        self.served = 0
        self.decoded = 0
        self.open_times: list[int] = []
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
        cam.open_times.append(cam.clock())
        if cam.never_back or (len(cam.open_times) > 1 and cam.failed_opens > 0):
            cam.failed_opens -= 1
            raise SourceError("fake camera is unplugged")

    def read(self, out: np.ndarray | None) -> np.ndarray | None:
        cam = self.camera
        cam.in_read.set()
        if cam.release is not None:
            cam.release.wait()
        if cam.slow_read is not None:
            cam.slow_read()
            cam.slow_read = None
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


def dropped(stats: CaptureStats) -> int:
    """Frames dropped, whatever the cause."""
    return sum(stats.dropped.values())


def take_all(capture: Capture, clock: ManualClock, count: int) -> list[Frame]:
    """A consumer as fast as the camera: ``count`` frames, one per frame interval, each checked while its slot is held."""
    frames = []
    for _ in range(count):
        frame = capture.take(timeout_s=0)
        assert frame is not None
        assert int(frame.image[0, 0, 0]) == frame.frame_id % 256
        frames.append(frame)
        clock.step()
    return frames


def consume(capture: Capture, clock: ManualClock, busy_frames: int, takes: int) -> list[tuple[Frame, int]]:
    """A consumer busy for ``busy_frames`` frame intervals per frame: each frame taken with the newest id grabbed before."""
    taken = []
    for _ in range(takes):
        newest_grabbed = capture.stats().frames_captured - 1
        frame = capture.take(timeout_s=0)
        assert frame is not None
        assert int(frame.image[0, 0, 0]) == frame.frame_id % 256
        taken.append((frame, newest_grabbed))
        clock.step(busy_frames)
    return taken


# ---- latest-frame semantics ----------------------------------------------------------------------


def test_slow_consumer_gets_only_the_newest_frames_and_held_slots_stay_intact(captures: Captures) -> None:
    capture, clock = captures.on_clock(lambda: synthetic(fps=200.0))
    clock.waiting(1)
    generator = SceneGenerator(width=SW, height=SH, seed=SEED)
    ids = []
    for _ in range(10):
        newest_before = capture.stats().frames_captured - 1
        frame = capture.take(timeout_s=0)
        assert frame is not None
        assert frame.frame_id >= newest_before  # never older than what was available at take time
        clock.step(6)  # a slow model; meanwhile the thread keeps capturing into the other slots
        np.testing.assert_array_equal(frame.image, generator.render(frame.frame_id).image)
        ids.append(frame.frame_id)
    stats = capture.stats()
    assert ids == sorted(set(ids))
    assert any(b - a > 1 for a, b in itertools.pairwise(ids))
    assert dropped(stats) > 0
    assert stats.frames_captured >= ids[-1] + 1
    assert capture.state == "ok"


def test_fast_consumer_gets_every_frame_once_from_three_slots(captures: Captures) -> None:
    camera = FakeCamera(fps=20.0)
    capture, clock = captures.on_clock(camera.source)
    clock.waiting(1)
    frames = take_all(capture, clock, 10)
    assert [f.frame_id for f in frames] == list(range(10))
    assert dropped(capture.stats()) == 0
    # Steady state reuses the preallocated slots: no new frame buffers.
    assert len({f.image.ctypes.data for f in frames}) <= 3


# ---- pacing and the clock ------------------------------------------------------------------------


def test_a_paced_source_keeps_its_schedule_through_a_late_wake_up_and_never_bursts_after_a_slow_read(
    captures: Captures,
) -> None:
    camera = FakeCamera(fps=50.0)
    capture, clock = captures.on_clock(camera.source)
    clock.waiting(1)  # the first frame is read at once
    clock.step(3)
    assert clock.waits == pytest.approx([0.02] * 4)
    assert capture.stats().frames_captured == 4
    clock.advance(0.025)  # woken 5 ms late: the next wait is shorter, so the schedule holds
    clock.waiting(5)
    assert clock.waits[-1] == pytest.approx(0.015)
    camera.slow_read = lambda: clock.advance(0.07)  # a read that takes three and a half intervals
    clock.step()
    # The frame that fell due during the slow read is read at once; then the pace resumes.
    assert capture.stats().frames_captured == 7
    assert clock.waits[-1] == pytest.approx(0.02)
    clock.step()
    assert capture.stats().frames_captured == 8


def test_heartbeat_moves_while_a_slow_source_is_paced(captures: Captures) -> None:
    capture, clock = captures.on_clock(FakeCamera(fps=0.2).source)
    clock.waiting(1)
    assert capture.take(timeout_s=0) is not None
    first = capture.stats().last_progress_ns
    clock.step()
    assert capture.stats().last_progress_ns == first + HEARTBEAT_S * S
    clock.step(3)
    assert clock.waits == [HEARTBEAT_S] * 5  # five seconds between frames, waited a heartbeat at a time
    assert capture.stats().frames_captured == 1
    clock.step()
    assert capture.stats().frames_captured == 2


def test_frames_are_stamped_with_the_capture_clock(captures: Captures) -> None:
    capture, clock = captures.on_clock(FakeCamera(fps=10.0).source)
    clock.waiting(1)
    clock.step(2)
    frame = capture.take(timeout_s=0)
    assert frame is not None and frame.frame_id == 2
    assert frame.t_capture_ns == clock() == 2 * S // 10
    assert capture.stats().last_progress_ns == frame.t_capture_ns


def test_a_frames_wall_time_is_when_it_was_grabbed_not_when_decoding_ended(captures: Captures) -> None:
    """Subscribers are told when the part was seen: a large frame's decoding, which takes
    milliseconds on a board, is not added to its capture time."""
    camera, decoding = FakeCamera(fps=100.0), list[int]()

    class SlowDecoding(SplitFakeSource):
        def retrieve(self, out: np.ndarray | None) -> np.ndarray:
            decoding.append(time.time_ns())
            time.sleep(0.02)
            return super().retrieve(out)

    capture, clock = captures.on_clock(lambda: SlowDecoding(camera))
    clock.waiting(1)
    frame = capture.take(timeout_s=0)
    assert frame is not None and len(decoding) == 1
    assert frame.t_wall_ns <= decoding[0]


def test_a_frame_the_camera_stamps_is_that_old_on_the_wall_clock_too(captures: Captures) -> None:
    camera, read_ends = FakeCamera(fps=100.0), list[int]()
    age_ns = 5 * S  # far more than the capture thread can take between the read and its stamps

    class Stamped(FakeSource):
        def read(self, out: np.ndarray | None) -> np.ndarray | None:
            image = super().read(out)
            read_ends.append(time.time_ns())
            return image

        def frame_age_ns(self) -> int:
            return age_ns

    capture, clock = captures.on_clock(lambda: Stamped(camera))
    clock.waiting(1)
    frame = capture.take(timeout_s=0)
    assert frame is not None
    assert frame.t_capture_ns == clock() - age_ns
    assert read_ends[0] - age_ns - S < frame.t_wall_ns <= read_ends[0] - age_ns + S // 10


# ---- decoding only what the consumer takes ---------------------------------------------------------


def test_frames_a_slow_consumer_would_not_take_are_grabbed_but_never_decoded(captures: Captures) -> None:
    camera, source = split_camera(fps=100.0)
    capture, clock = captures.on_clock(source)
    clock.waiting(1)
    taken = consume(capture, clock, 8, 10)  # the capture thread learns the consumer's pace
    decoded, captured = camera.decoded, capture.stats().frames_captured
    taken += consume(capture, clock, 8, 15)
    stats = capture.stats()
    assert stats.frames_decoded == camera.decoded
    # Eight frames arrive per frame taken; only the last one or two before each take are decoded.
    assert camera.decoded - decoded < 0.35 * (stats.frames_captured - captured)
    assert stats.frames_captured == 1 + 8 * 25
    assert dropped(stats) == stats.frames_captured - len(taken) - (capture.take(0.0) is not None)
    # Still the newest frame: the one grabbed last before the take.
    assert [frame.frame_id for frame, _ in taken] == [newest for _, newest in taken]


def test_a_consumer_as_fast_as_the_camera_has_every_frame_decoded(captures: Captures) -> None:
    camera, source = split_camera(fps=40.0)
    capture, clock = captures.on_clock(source)
    clock.waiting(1)
    frames = take_all(capture, clock, 20)
    assert [f.frame_id for f in frames] == list(range(20))
    assert dropped(capture.stats()) == 0
    assert camera.decoded >= 20


def test_decode_all_decodes_every_frame_for_a_slow_consumer(captures: Captures) -> None:
    camera, source = split_camera(fps=100.0)
    capture, clock = captures.on_clock(source, decode_all=True)
    clock.waiting(1)
    consume(capture, clock, 8, 12)
    stats = capture.stats()
    assert stats.frames_decoded == camera.decoded == stats.frames_captured


def test_a_consumer_that_stops_asking_stops_the_decoding_and_gets_a_fresh_frame_when_it_asks(
    captures: Captures,
) -> None:
    camera, source = split_camera(fps=100.0)
    capture, clock = captures.on_clock(source)
    clock.waiting(1)
    taken = consume(capture, clock, 2, 20)  # a steady consumer, then a pause (say thermal) of 2 s
    decoded_before, captured_before = camera.decoded, capture.stats().frames_captured
    clock.step(200)
    # Decoding goes on for about AWAY_NS past the consumer's usual cycle, then stops.
    assert camera.decoded - decoded_before <= 100 * (AWAY_NS / S + 0.5)
    assert capture.stats().frames_captured - captured_before == 200
    paused_decodes = camera.decoded
    clock.step(30)
    assert camera.decoded == paused_decodes
    newest_grabbed = capture.stats().frames_captured - 1
    # Not a frame from before the pause: none is waiting, and the next one grabbed is decoded once asked for.
    assert capture.take(timeout_s=0) is None
    clock.step()
    frame = capture.take(timeout_s=0)
    assert frame is not None and frame.frame_id == newest_grabbed + 1
    assert frame.t_capture_ns == clock()
    stats = capture.stats()
    # Every frame is taken, still pending, or counted as dropped: the one left from before the pause too.
    pending = capture.take(0.0) is not None
    assert dropped(stats) == stats.frames_captured - (len(taken) + 1) - pending


@pytest.mark.parametrize(
    ("split", "decode_all", "says"),
    [
        (True, False, "decoding only the frames the model may take"),
        (True, True, "decoding every frame"),
        (False, False, "decoding every frame"),
    ],
)
def test_the_first_frame_logs_how_frames_are_decoded(
    captures: Captures, caplog: pytest.LogCaptureFixture, split: bool, decode_all: bool, says: str
) -> None:
    caplog.set_level(logging.INFO, logger="edged.capture")
    camera, split_source = split_camera(fps=100.0)
    _, clock = captures.on_clock(split_source if split else camera.source, decode_all=decode_all)
    clock.waiting(1)  # the line follows the first frame's hand-over
    assert f"camera cam0: delivering 32x24 frames, {says}" in caplog.messages


@pytest.mark.parametrize(
    ("priority", "added", "policy"),
    [("normal", 0, os.SCHED_OTHER), ("low", LOW_NICENESS, os.SCHED_OTHER), ("idle", 0, os.SCHED_IDLE)],
)
def test_capture_thread_alone_runs_at_its_priority(
    captures: Captures, priority: CapturePriority, added: int, policy: int
) -> None:
    # Read back from the kernel: the capture thread's nice value or policy changes, the caller's does not.
    me = threading.get_native_id()
    base = os.getpriority(os.PRIO_PROCESS, me)
    _, clock = captures.on_clock(FakeCamera(fps=50.0).source, camera_id="prio-cam", priority=priority)
    clock.waiting(1)
    (thread,) = [t for t in threading.enumerate() if t.name == "capture-prio-cam"]
    assert thread.native_id is not None
    assert os.sched_getscheduler(thread.native_id) == policy
    if policy == os.SCHED_OTHER:
        assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == min(19, base + added)
    assert os.getpriority(os.PRIO_PROCESS, me) == base and os.sched_getscheduler(me) == os.SCHED_OTHER


# ---- lost cameras ----------------------------------------------------------------------------------


def test_backoff_doubles_to_its_cap_and_jitter_only_shortens_it() -> None:
    backoff = Backoff(0.5, 3.0, random.Random(SEED))
    for failures, base in enumerate([0.5, 1.0, 2.0, 3.0, 3.0, 3.0], start=1):
        assert base * (1 - JITTER) <= backoff.delay_s(failures) <= base
    assert backoff.delay_s(10_000) <= 3.0
    with pytest.raises(ValueError, match="backoff_initial_s"):
        Capture(FakeCamera().source, "cam0", backoff_initial_s=2.0, backoff_max_s=1.0)


def test_camera_lost_mid_stream_reconnects_with_backoff_and_ids_continue(
    captures: Captures, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="edged.capture")
    clock = ManualClock()
    camera = FakeCamera(fps=100.0, fail_at=5, failed_opens=2, clock=clock)
    capture, _ = captures.on_clock(camera.source, clock, "cam7", backoff_initial_s=0.05, backoff_max_s=0.15)
    clock.waiting(1)
    before = take_all(capture, clock, 5)  # frames 0-4; the read of the sixth fails
    assert capture.state == "lost"
    clock.step(3)  # two failed opens, then the camera is back
    assert capture.stats().state == "ok" and len(camera.open_times) == 4
    after = take_all(capture, clock, 3)
    ids = [f.frame_id for f in before + after]
    assert ids == sorted(set(ids)) and ids[-1] >= 5  # no reset after the reconnect

    stats = capture.stats()
    assert stats.read_errors == 1 and stats.reconnects == 3
    assert stats.last_error == "fake camera is unplugged"
    # Backoff 0.05, 0.1, 0.15 (capped), each shortened by at most 25% jitter, between the paced reads.
    assert clock.waits[:5] == pytest.approx([0.01] * 5)
    backoffs = np.array(clock.waits[5:8])
    expected = np.array([0.05, 0.1, 0.15])
    assert list((backoffs >= expected * (1 - JITTER)) & (backoffs <= expected)) == [True, True, True]
    assert list(np.diff(camera.open_times)[1:]) == [round(b * S) for b in backoffs[1:]]
    assert camera.closed >= 1

    messages = [r.getMessage() for r in caplog.records]
    assert sum("lost" in m for m in messages) == 1
    assert sum("back after 3 failed" in m for m in messages) == 1
    assert all(getattr(r, "CAMERA", None) == "cam7" for r in caplog.records)


class SkippingSource(FakeSource):
    """A source that passes over an unreadable frame before each it delivers, as an image folder
    passes over a bad image: its own count starts from 0 each time it is built."""

    def __init__(self, camera: FakeCamera) -> None:
        super().__init__(camera)
        self._skipped = 0

    @property
    def skipped(self) -> int:
        return self._skipped

    def read(self, out: np.ndarray | None) -> np.ndarray | None:
        image = super().read(out)
        self._skipped += 1
        return image


def test_frames_a_source_passes_over_are_counted_across_its_reopens(captures: Captures) -> None:
    # An image folder's unreadable images were counted by the source alone, which nothing read:
    # the status and /metrics said nothing of them.
    clock = ManualClock()
    camera = FakeCamera(fps=100.0, fail_at=3, clock=clock)
    sources: list[SkippingSource] = []

    def build() -> SkippingSource:
        sources.append(SkippingSource(camera))
        return sources[-1]

    capture, _ = captures.on_clock(build, clock, backoff_initial_s=0.05, backoff_max_s=0.05)
    clock.waiting(1)
    take_all(capture, clock, 3)  # frames 0-2; the read of the fourth fails
    assert capture.state == "lost"
    clock.step()  # the backoff, then the camera is back
    take_all(capture, clock, 2)
    assert len(sources) == 2 and sources[0].skipped == 3  # before each of its three frames
    assert capture.stats().unreadable == sources[0].skipped + sources[1].skipped > sources[1].skipped


def test_camera_that_never_comes_back_keeps_retrying_quietly(captures: Captures, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="edged.capture")
    camera = FakeCamera(never_back=True)
    capture, clock = captures.on_clock(camera.source, backoff_initial_s=0.01, backoff_max_s=0.02)
    clock.waiting(1)
    assert capture.take(timeout_s=0) is None
    clock.step(5)
    first = capture.stats()
    clock.step(20)
    second = capture.stats()
    assert capture.state == "lost" and second.alive
    assert second.last_progress_ns > first.last_progress_ns
    assert second.reconnects == 25 and first.reconnects == 5
    assert second.frames_captured == 0
    assert all(0.01 * (1 - JITTER) <= w <= 0.02 for w in clock.waits)
    # One warning when the camera is first missing, then one per LOG_EVERY_N_FAILURES attempts.
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 + (second.reconnects + 1) // LOG_EVERY_N_FAILURES


def test_stop_returns_quickly_while_waiting_to_reconnect(captures: Captures) -> None:
    camera = FakeCamera(never_back=True)
    capture = captures.start(Capture(camera.source, "cam0", backoff_initial_s=5.0, backoff_max_s=10.0))
    assert wait_for(lambda: len(camera.open_times) == 1 and capture.state == "lost")
    start = time.monotonic()
    capture.stop()
    assert time.monotonic() - start < 1.0
    assert not capture.stats().alive


def test_stop_gives_up_on_a_blocked_read_and_the_thread_releases_the_camera_later(captures: Captures) -> None:
    camera = FakeCamera(fps=100.0)
    camera.release = threading.Event()
    capture = captures.start(Capture(camera.source, "cam0"))
    assert camera.in_read.wait(timeout=3.0)  # inside the first read, which blocks
    start = time.monotonic()
    capture.stop(timeout_s=0.2)
    assert time.monotonic() - start < 0.5
    assert capture.stats().alive and camera.closed == 0
    camera.release.set()  # the read returns
    assert wait_for(lambda: not capture.stats().alive, timeout_s=2.0)
    assert camera.closed == 1


class StreamFakeSource(SplitFakeSource):
    """A network stream: ``timeouts`` as an RTSP source's, and the camera's ``slow_read`` run inside ``grab`` or ``open``.

    A slow call that still succeeds is what a frozen RTSP server does to OpenCV: the read blocks,
    then returns an old frame with ok.
    """

    OPEN_TIMEOUT_S, READ_TIMEOUT_S = 10.0, 5.0

    def timeouts(self) -> tuple[float, float]:
        return self.OPEN_TIMEOUT_S, self.READ_TIMEOUT_S

    def open(self) -> None:
        super().open()
        self._run_slow()

    def grab(self) -> bool:
        self._run_slow()
        return super().grab()

    def _run_slow(self) -> None:
        if self.camera.slow_read is not None:
            self.camera.slow_read()
            self.camera.slow_read = None


def test_a_stream_that_returns_frames_late_is_stalled_lost_and_reconnected_with_ids_going_on(captures: Captures) -> None:
    clock = ManualClock()
    camera = FakeCamera(fps=10.0, clock=clock)
    capture, _ = captures.on_clock(lambda: StreamFakeSource(camera), clock, decode_all=True, backoff_initial_s=0.5)
    clock.waiting(1)
    before = take_all(capture, clock, 3)
    camera.slow_read = lambda: clock.advance(StreamFakeSource.READ_TIMEOUT_S + 0.5)  # the read said ok, 5.6 s late
    clock.step()
    stats = capture.stats()
    assert stats.state == "lost" and stats.read_errors == 1 and stats.reconnects == 0
    assert stats.last_error == "stalled: no new frame for 5.6 s (allowed 5 s)"
    assert len(camera.open_times) == 1 and camera.closed == 1
    clock.step()  # the backoff ends; reopened, it delivers again
    assert capture.stats().state == "ok" and capture.stats().reconnects == 1
    assert [f.frame_id for f in before] == [0, 1, 2]
    after = capture.take(timeout_s=0)  # frame 3 came in time; the camera's fifth, late, was never handed on
    assert after is not None and after.frame_id == 4 and int(after.image[0, 0, 0]) == 5


def test_a_stream_whose_first_frame_is_slower_than_the_read_timeout_is_starting_until_the_open_timeout(
    captures: Captures,
) -> None:
    clock = ManualClock()
    camera = FakeCamera(fps=10.0, clock=clock)
    first_frame_s = StreamFakeSource.OPEN_TIMEOUT_S - 1.0  # longer than READ_TIMEOUT_S
    camera.slow_read = lambda: clock.advance(first_frame_s)
    capture, _ = captures.on_clock(lambda: StreamFakeSource(camera), clock)
    clock.waiting(1)
    stats = capture.stats()
    assert stats.state == "ok" and stats.read_errors == 0 and stats.frames_captured == 1


def test_a_stream_without_a_first_frame_by_the_open_timeout_is_lost(captures: Captures) -> None:
    clock = ManualClock()
    camera = FakeCamera(fps=10.0, clock=clock)
    camera.slow_read = lambda: clock.advance(StreamFakeSource.OPEN_TIMEOUT_S + 1.0)
    capture, _ = captures.on_clock(lambda: StreamFakeSource(camera), clock)
    clock.waiting(1)  # waiting to reconnect
    stats = capture.stats()
    assert stats.state == "lost" and stats.frames_captured == 0  # grabbed too late: never handed on
    assert stats.last_error == "stalled: no new frame for 11.0 s (allowed 10 s)"


# ---- sizes and endings ----------------------------------------------------------------------------


def test_size_change_mid_stream_reallocates_slots_and_keeps_the_held_frame(captures: Captures) -> None:
    camera = FakeCamera(fps=100.0, resize_at=6)
    capture, clock = captures.on_clock(camera.source)
    clock.waiting(1)
    held = capture.take(timeout_s=0)
    assert held is not None and held.image.shape == (24, 32, 3)
    held_value = int(held.image[0, 0, 0])
    clock.step(8)  # several new-size frames are captured while the old one is held
    assert capture.stats().size_changes == 1
    np.testing.assert_array_equal(held.image, held_value)
    later = take_all(capture, clock, 4)
    assert all(f.image.shape == (48, 40, 3) for f in later)
    assert capture.stats().size_changes == 1


class ResizingSource(FakeSource):
    """A camera whose frames of ``before`` (height, width) become ``after`` at its frame ``resize_at``.
    Never written (a new frame is ``np.zeros``, a later one the slot it is read into), so an 8K
    frame costs no memory."""

    def __init__(self, camera: FakeCamera, before: tuple[int, int], after: tuple[int, int]) -> None:
        super().__init__(camera)
        self.sizes = before, after

    def read(self, out: np.ndarray | None) -> np.ndarray | None:
        cam = self.camera
        shape = (*self.sizes[cam.resize_at is not None and cam.served >= cam.resize_at], 3)
        cam.served += 1
        return out if out is not None and out.shape == shape else np.zeros(shape, np.uint8)


@pytest.mark.parametrize(
    ("fits", "over", "why"),
    [
        ((4320, 7680), (4320, 7681), "7681x4320 pixels, over the 33177600 pixels (7680x4320) edged takes"),
        ((506, 65535), (1, 65536), "65536x1 pixels, a side longer than the 65535 edged takes"),
    ],
)
def test_frames_over_the_limit_lose_the_camera_before_one_reaches_the_consumer_and_it_is_retried(
    captures: Captures, fits: tuple[int, int], over: tuple[int, int], why: str
) -> None:
    # A camera or stream whose size is known only from its frames (or that changed it) had such frames
    # handed on: the slots, then a plan, made for them (a 10000x10000 frame is 300 MB as BGR).
    camera = FakeCamera(fps=100.0, resize_at=2)
    capture, clock = captures.on_clock(lambda: ResizingSource(camera, fits, over), backoff_initial_s=0.05)
    clock.waiting(1)  # frame 0 delivered, at the limit
    clock.step(2)  # frame 1, then frame 2 of the larger size
    stats = capture.stats()
    assert stats.state == "lost" and stats.last_error is not None and why in stats.last_error
    assert stats.frames_captured == 2 and stats.read_errors == 1
    frame = capture.take(timeout_s=0)
    assert frame is not None and frame.frame_id == 1 and frame.image.shape == (*fits, 3)
    clock.step()  # the backoff: reopened, and lost again at its first frame
    assert len(camera.open_times) == 2 and capture.stats().reconnects == 1 and capture.state == "lost"
    assert capture.take(timeout_s=0) is None


class MixedSizesSource(FakeSource):
    """A source whose frames differ in size by nature, as an image folder's do."""

    frame_sizes_vary = True


@pytest.mark.parametrize("mixed", [False, True])
def test_a_size_change_is_a_warning_for_a_camera_and_a_debug_line_where_sizes_vary(
    captures: Captures, caplog: pytest.LogCaptureFixture, mixed: bool
) -> None:
    # An image folder of several sizes wrote a warning at every image of another size, every pass.
    caplog.set_level(logging.DEBUG, logger="edged.capture")
    camera = FakeCamera(fps=100.0, resize_at=2)
    capture, clock = captures.on_clock(lambda: MixedSizesSource(camera) if mixed else FakeSource(camera))
    clock.waiting(1)
    take_all(capture, clock, 4)
    assert capture.stats().size_changes == 1
    [line] = [r for r in caplog.records if "frame size changed" in r.getMessage()]
    assert line.levelno == (logging.DEBUG if mixed else logging.WARNING)


def test_finite_source_without_loop_ends(tmp_path: Path, captures: Captures) -> None:
    path = tmp_path / "short.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), 30.0, (64, 32))
    for i in range(8):
        writer.write(np.full((32, 64, 3), 30 * i, np.uint8))
    writer.release()
    cfg = FileSourceConfig(path=path, loop=False, realtime=True)
    capture = captures.start(Capture(lambda: FileSource(cfg), "cam0"))
    frames = []
    while (frame := capture.take(timeout_s=2.0)) is not None:
        frames.append(frame.frame_id)
    assert capture.state == "ended"
    assert frames[-1] == 7 and capture.stats().frames_captured == 8
    assert wait_for(lambda: not capture.stats().alive)
    start = time.monotonic()
    assert capture.take(timeout_s=1.0) is None
    assert time.monotonic() - start < 0.1


def test_a_source_bug_ends_the_thread_visibly(captures: Captures) -> None:
    class Broken(FakeSource):
        def read(self, out: np.ndarray | None) -> np.ndarray | None:
            raise ZeroDivisionError("bug")

    capture = captures.start(Capture(lambda: Broken(FakeCamera()), "cam0"))
    assert wait_for(lambda: not capture.stats().alive)
    assert "ZeroDivisionError" in (capture.stats().last_error or "")


def test_start_twice_is_an_error(captures: Captures) -> None:
    capture, _ = captures.on_clock(FakeCamera().source)
    with pytest.raises(RuntimeError):
        capture.start()
