"""The capture thread: owns the camera, its pacing and reconnects, and feeds the latest-frame slots.

Everything camera-specific lives in ``edged.sources``; the hand-over to the one consumer lives in
``edged.latest``. This module runs a ``Source`` on its own thread: a lost camera is reopened
forever with capped exponential backoff while the rest of the daemon keeps running and reporting.
A source that splits reading into ``grab`` and ``retrieve`` has every frame grabbed but only the
frames the consumer may take decoded: under a model slower than the camera, or a thermal rate
cap, decoding frames that a newer one replaces before they are taken is heat for nothing.
A network stream (a source with ``timeouts``) is called stalled when no new frame has come for
its limit on this clock, whatever its reads said: a frozen RTSP server can make a read block and
then return old frames as if all were well. A frame larger than edged takes loses the camera
before it goes further, as a failed read does.

All timing goes through an injectable monotonic clock and wait, so pacing, backoff and the
heartbeat are exact under a test clock.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

from edged.backoff import Backoff
from edged.config import CapturePriority
from edged.demand import StreamTiming
from edged.errors import EdgedError, SourceError
from edged.latest import DropCause, LatestFrame, Shape
from edged.messages import CaptureState
from edged.sources.base import (
    Frame,
    Source,
    SplitSource,
    frame_size_problem,
    frames_vary_in_size,
    keeps_every_frame,
    names_frames,
    paces,
    skipped,
    splits_reading,
    stamps,
    times_out,
)
from edged.wake import Waker

log = logging.getLogger(__name__)

LOW_NICENESS = 10  # added to the capture thread's nice value at capture_priority = "low"

StreamEnd = Literal["ended", "lost", "stopped"]
ReadOutcome = Literal["delivered", "skipped", "ended"]

LOG_EVERY_N_FAILURES = 10
HEARTBEAT_S = 1.0  # longest wait without touching last_progress_ns


@dataclass(frozen=True, slots=True)
class CaptureStats:
    """A snapshot of the capture counters (each part consistent in itself).

    ``last_progress_ns`` (on the capture's monotonic clock) moves on every frame obtained, every
    open attempt and at least every ``HEARTBEAT_S`` while the thread waits (pacing or backoff): a
    stale value means the thread is stuck in a camera call or gone, not merely reconnecting.
    """

    state: CaptureState
    frames_captured: int
    frames_decoded: int
    dropped: dict[DropCause, int]
    read_errors: int
    unreadable: int  # frames the source passed over as unreadable (an image folder's bad images)
    reconnects: int
    size_changes: int
    last_error: str | None
    last_progress_ns: int
    alive: bool


class StallWatch:
    """Calls a stream stalled when a frame comes later than allowed, however the read that got it ended.

    The first frame may take ``first_s`` from ``since_ns`` (when opening began: the stream is
    starting until then), every later one ``between_s`` from the one before.
    """

    def __init__(self, first_s: float, between_s: float, *, since_ns: int) -> None:
        self._between_ns = round(between_s * 1e9)
        self._allowed_ns = round(first_s * 1e9)
        self._last_ns = since_ns

    def arrived(self, now_ns: int) -> None:
        """Note a frame that came at ``now_ns``; raise ``SourceError`` if it came too late to be taken as live."""
        waited_ns = now_ns - self._last_ns
        if waited_ns > self._allowed_ns:
            raise SourceError(f"stalled: no new frame for {waited_ns / 1e9:.1f} s (allowed {self._allowed_ns / 1e9:g} s)")
        self._last_ns, self._allowed_ns = now_ns, self._between_ns


def _refuse_oversize(width: int, height: int) -> None:
    """`SourceError` for a frame larger than edged takes (`frame_size_problem`), before it goes further: the
    camera is then lost and retried like one that cannot be read. The sources that know the size before
    decoding refuse such a stream when it opens; this is for the others (a size known only from a frame,
    a camera that changed its size)."""
    if (problem := frame_size_problem(width, height)) is not None:
        raise SourceError(f"the camera delivered frames of {problem} (set it to a lower resolution)")


class Capture:
    """Owns the capture thread: opening, pacing, reading and reconnecting one camera.

    Frames go to a `LatestFrame` ring, from which one consumer thread calls ``take``. A lost
    camera is reconnected with capped exponential backoff (``backoff_initial_s`` doubling to
    ``backoff_max_s``, with jitter) forever, until stopped; frame ids continue across reconnects.

    With a source that has ``grab`` and ``retrieve``, a frame is decoded only when the consumer
    is waiting or may ask before a newer frame could be decoded (`edged.demand`); a frame skipped
    undecoded counts as dropped like one replaced in its slot. ``decode_all`` decodes
    every frame, as for a consumer that takes them all (the bench's worst case).

    ``clock`` (monotonic ns) stamps frames and progress and times pacing and backoff; ``wait(s)``
    waits ``s`` seconds on it and returns True once stopped. The default waits on the stop event,
    so ``stop`` interrupts it; a test passes both to run the thread on a clock it moves itself.
    ``wake`` is set whenever a frame is ready or the source ends (`edged.latest.LatestFrame`).
    """

    def __init__(
        self,
        source_factory: Callable[[], Source],
        camera_id: str,
        *,
        priority: CapturePriority = "normal",
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 10.0,
        decode_all: bool = False,
        clock: Callable[[], int] = time.monotonic_ns,
        wait: Callable[[float], bool] | None = None,
        wake: Waker | None = None,
    ) -> None:
        self._factory = source_factory
        self._priority = priority
        self._camera_id = camera_id
        self._extra = {"CAMERA": camera_id}
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._decode_all = decode_all
        self._clock = clock
        self._stop = threading.Event()
        self._wait_for = wait if wait is not None else self._stop.wait
        self._frames = LatestFrame(clock, wake)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Written by the capture thread; _lock makes a snapshot of them consistent.
        self._state: CaptureState = "starting"
        self._failures = 0  # failed opens/reads since the last good frame
        self._read_errors = 0
        self._unreadable = 0  # of the sources closed before and the one open, together
        self._sizes_vary = False  # the open source's frames differ in size by nature: a change is no news
        self._reconnects = 0
        self._last_error: str | None = None
        self._last_progress_ns = clock()
        self.fatal: EdgedError | None = None  # a configuration the camera refused: retrying cannot help

    # ---- consumer side ---------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"capture {self._camera_id} was already started")
        self._thread = threading.Thread(target=self._run, name=f"capture-{self._camera_id}", daemon=True)
        self._thread.start()

    def take(self, timeout_s: float) -> Frame | None:
        """The newest frame not yet taken, or ``None`` on timeout, after stop, or once a finite
        source has ended. Releases the slot of the previously taken frame.

        The times of these calls are also how the capture thread learns when the next frame is
        wanted, and so which frames to decode (`edged.demand`).
        """
        return self._frames.take(timeout_s)

    def passing(self, cause: DropCause) -> None:
        """Why the consumer takes no frame now: the frames dropped from now on count under ``cause``."""
        self._frames.passing(cause)

    def signal_stop(self) -> None:
        """Tell the thread to stop without waiting for it: several cameras then stop together."""
        self._stop.set()
        self._frames.close()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and release the camera, waiting at most ``timeout_s``.

        A thread blocked inside a camera read cannot be interrupted; it then finishes the read,
        releases the camera itself and exits (it is a daemon thread, so it never holds up exit).
        """
        self.signal_stop()
        if self._thread is None:
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "camera %s: capture thread still blocked in a camera call after %.1f s; it releases "
                "the camera when the call returns",
                self._camera_id,
                timeout_s,
                extra=self._extra,
            )

    @property
    def state(self) -> CaptureState:
        return self._state

    def stats(self) -> CaptureStats:
        counts = self._frames.counts()
        with self._lock:
            return CaptureStats(
                state=self._state,
                **asdict(counts),  # the ring's counters, as they are
                read_errors=self._read_errors,
                unreadable=self._unreadable,
                reconnects=self._reconnects,
                last_error=self._last_error,
                last_progress_ns=self._last_progress_ns,
                alive=self._thread is not None and self._thread.is_alive(),
            )

    # ---- capture thread --------------------------------------------------------------------

    def _run(self) -> None:
        self._yield_to_inference()
        try:
            self._connect_loop()
        except Exception as e:
            # A bug rather than a camera problem: end the thread so the watchdog sees alive=False.
            log.exception("camera %s: capture thread failed", self._camera_id, extra=self._extra)
            with self._lock:
                self._last_error = f"capture thread failed: {e!r}"
                self._state = "lost"

    def _yield_to_inference(self) -> None:
        """Lower this thread's priority so that, when cores are short, inference gets them first.

        On Linux a nice value and a scheduling policy belong to one thread and the threads it
        starts inherit them (a decoder's worker threads), so the capture side yields while the
        loop and ONNX Runtime's pool, started by the main thread, keep theirs. Lowering needs no
        privilege. ``low`` adds `LOW_NICENESS`; ``idle`` (SCHED_IDLE) never preempts a normal
        thread, so it only decodes on a core nothing else wants. A late frame is only a stale
        one, which latest-frame capture drops anyway.
        """
        if self._priority == "normal" or sys.platform != "linux":
            return
        tid = threading.get_native_id()
        try:
            if self._priority == "idle":
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + LOW_NICENESS))
        except OSError as e:
            log.warning(
                "camera %s: cannot lower the capture thread's priority (%s); it competes with inference for cores",
                self._camera_id,
                e,
                extra=self._extra,
            )

    def _connect_loop(self) -> None:
        while not self._stop.is_set():
            if self._failures:
                if self._wait(self._backoff.delay_s(self._failures)):
                    return
                with self._lock:
                    self._reconnects += 1
            opening_ns = self._clock()
            source = self._open()
            if source is None:
                continue
            try:
                end = self._stream(source, opening_ns)
            finally:
                self._close(source)
            if end == "ended":
                self._mark_ended()
                return
            if end == "stopped":
                return

    def _wait(self, seconds: float) -> bool:
        """Wait ``seconds`` on the clock unless stopped (then True), touching last_progress_ns as a heartbeat."""
        deadline_ns = self._clock() + round(seconds * 1e9)
        while (remaining_ns := deadline_ns - self._clock()) > 0:
            if self._wait_for(min(remaining_ns / 1e9, HEARTBEAT_S)):
                return True
            self._last_progress_ns = self._clock()
        return False

    def _open(self) -> Source | None:
        source: Source | None = None
        try:
            source = self._factory()
            source.open()
        except (SourceError, OSError) as e:  # OSError: the process out of descriptors (EMFILE), memory, ...
            if source is not None:
                self._close(source)
            self._fail(str(e), read=False)
            return None
        except EdgedError as e:
            # The camera refused its configuration (an unknown control, a missing module): the
            # consumer stops with the error's exit code instead of retrying forever.
            if source is not None:
                self._close(source)
            log.error("camera %s: %s", self._camera_id, e, extra=self._extra)
            with self._lock:
                self.fatal = e
                self._last_error = str(e)
            self._stop.set()
            self._frames.close()
            return None
        self._last_progress_ns = self._clock()
        return source

    def _close(self, source: Source) -> None:
        try:
            source.close()
        except Exception as e:  # closing a camera that is already gone may fail in any way
            log.debug("camera %s: close failed: %s", self._camera_id, e, extra=self._extra)

    def _stream(self, source: Source, opening_ns: int) -> StreamEnd:
        """Read one opened source until it ends, fails, stalls or capture stops, at its pace if it has one.

        A source with ``timeouts`` stalls when its first frame comes later than the first limit
        after ``opening_ns`` (it is starting until then), or a frame later than the second after
        the one before. A source that keeps every frame has its next frame read only once the
        consumer has taken the one before.
        """
        every = keeps_every_frame(source)
        decode_all = every or self._decode_all  # a frame kept for the consumer is one it takes
        split = source if splits_reading(source) else None
        watch = StallWatch(*source.timeouts(), since_ns=opening_ns) if times_out(source) else None
        period_s = source.pace() if paces(source) else None
        period_ns = round(period_s * 1e9) if period_s else 0
        timing = StreamTiming(period_ns=float(period_ns), paced=period_ns > 0)
        due_ns = self._clock()
        delivered = False
        before = self._unreadable  # a source counts its own from 0: those of the sources before stay
        self._sizes_vary = frames_vary_in_size(source)
        while not self._stop.is_set():
            if every and not self._until_taken():
                return "stopped"
            if period_ns:
                if self._wait((due_ns - self._clock()) / 1e9):
                    return "stopped"
                # Keep the schedule through jitter, but never burst to catch up after a slow read:
                # once behind by a whole interval, the next read is one interval after this one.
                now_ns = self._clock()
                due_ns = due_ns + period_ns if due_ns + period_ns > now_ns else now_ns + period_ns
            try:
                if split is None:
                    got = self._read(source, watch)
                else:
                    got = self._grab(split, timing, watch, decode=decode_all or not delivered)
            except (SourceError, OSError) as e:  # an OSError passes with its cause: retried as a lost camera is
                self._fail(str(e), read=True)
                return "lost"
            finally:
                self._unreadable = before + skipped(source)
            if got == "ended":
                return "ended"
            if got == "delivered" and not delivered:
                self._mark_ok(on_demand=split is not None and not decode_all)
                delivered = True
        return "stopped"

    def _until_taken(self) -> bool:
        """Wait until the consumer has taken the frame waiting, touching last_progress_ns as a
        heartbeat (a slow consumer is not a stuck camera); False once stopped."""
        while not self._frames.taken(HEARTBEAT_S):
            if self._stop.is_set():
                return False
            self._last_progress_ns = self._clock()
        return not self._stop.is_set()

    def _read(self, source: Source, watch: StallWatch | None) -> ReadOutcome:
        """The next frame of a source that reads in one call, into a free slot."""
        index, buf = self._frames.claim()
        image = source.read(buf)
        if image is None:
            return "ended"
        now_ns, wall_ns = self._clock(), time.time_ns()
        if watch is not None:
            watch.arrived(now_ns)
        age_ns = source.frame_age_ns() if stamps(source) else 0
        name = source.frame_name() if names_frames(source) else None
        self._deliver(index, image, now_ns - age_ns, wall_ns - age_ns, source.channel_order, name)
        return "delivered"

    def _grab(self, source: SplitSource, timing: StreamTiming, watch: StallWatch | None, *, decode: bool) -> ReadOutcome:
        """The next frame grabbed, decoded into a free slot only when ``decode`` or the consumer may want it."""
        if not source.grab():
            return "ended"
        t_capture_ns, wall_ns = self._clock(), time.time_ns()  # both before decoding, which takes its time
        if watch is not None:
            watch.arrived(t_capture_ns)
        timing.grabbed(t_capture_ns)
        if not decode and not self._frames.wants(t_capture_ns, timing.newer_ready_ns):
            self._frames.skip()
            self._last_progress_ns = t_capture_ns
            return "skipped"
        index, buf = self._frames.claim()
        image = source.retrieve(buf)
        timing.decoded(self._clock() - t_capture_ns)
        self._deliver(index, image, t_capture_ns, wall_ns, source.channel_order)
        return "delivered"

    def _deliver(
        self,
        index: int,
        image: np.ndarray,
        t_capture_ns: int,
        wall_ns: int,
        order: Literal["bgr", "rgb"],
        name: str | None = None,
    ) -> None:
        """The frame in slot ``index`` handed to the consumer, stamped with its capture time on both
        clocks: the monotonic one paces and places the part for the reject line, the wall one is
        the time subscribers are told."""
        if image.shape != self._frames.shape and image.ndim >= 2:
            _refuse_oversize(image.shape[1], image.shape[0])
        previous = self._frames.adopt(index, image)
        if previous is not None:
            self._log_size_change(previous, image.shape)
        self._frames.hand_over(index, t_capture_ns, wall_ns, order, name)
        self._last_progress_ns = t_capture_ns

    # ---- state changes, each logged once ---------------------------------------------------

    def _log_size_change(self, previous: Shape, shape: Shape) -> None:
        """A warning for a camera (a renegotiation); a debug line for a source whose frames differ in
        size by nature (an image folder of several sizes would write one at every image, each pass)."""
        log.log(
            logging.DEBUG if self._sizes_vary else logging.WARNING,
            "camera %s: frame size changed from %dx%d to %dx%d",
            self._camera_id,
            previous[1],
            previous[0],
            shape[1],
            shape[0],
            extra=self._extra,
        )

    def _mark_ok(self, *, on_demand: bool) -> None:
        with self._lock:
            previous, failures = self._state, self._failures
            self._state = "ok"
            self._failures = 0
        shape = self._frames.shape
        size = f"{shape[1]}x{shape[0]}" if shape else "?"
        if previous == "lost":
            log.info(
                "camera %s: back after %d failed attempt(s), %s frames", self._camera_id, failures, size, extra=self._extra
            )
        elif previous == "starting":
            decoding = "decoding only the frames the model may take" if on_demand else "decoding every frame"
            log.info("camera %s: delivering %s frames, %s", self._camera_id, size, decoding, extra=self._extra)

    def _fail(self, message: str, *, read: bool) -> None:
        with self._lock:
            previous = self._state
            self._state = "lost"
            self._failures += 1
            failures = self._failures
            self._read_errors += int(read)
            self._last_error = message
            self._last_progress_ns = self._clock()
        if previous == "ok":
            log.warning("camera %s: lost: %s; reconnecting", self._camera_id, message, extra=self._extra)
        elif previous == "starting":
            log.warning("camera %s: unavailable: %s; retrying", self._camera_id, message, extra=self._extra)
        elif failures % LOG_EVERY_N_FAILURES == 0:
            log.warning(
                "camera %s: still unavailable after %d attempts: %s", self._camera_id, failures, message, extra=self._extra
            )
        else:
            log.debug("camera %s: attempt %d failed: %s", self._camera_id, failures, message, extra=self._extra)

    def _mark_ended(self) -> None:
        with self._lock:
            self._state = "ended"
        self._frames.close()
        log.info("camera %s: end of stream", self._camera_id, extra=self._extra)
