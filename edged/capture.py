"""The capture thread: owns the camera, the frame slots, pacing and reconnects.

Everything camera-specific lives in ``edged.sources``; this module turns any ``Source`` into a
stream of the newest frames for one consumer. A new frame replaces one the consumer has not taken
yet, so a slow model never builds a backlog, and a lost camera is reopened forever with capped
exponential backoff while the rest of the daemon keeps running and reporting. A source that splits
reading into ``grab`` and ``retrieve`` has every frame grabbed but only the frames the consumer
may take decoded: under a model slower than the camera, or a thermal rate cap, decoding frames
that a newer one replaces before they are taken is heat for nothing.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from edged.config import CapturePriority
from edged.demand import Demand, StreamTiming
from edged.errors import SourceError
from edged.sources import Frame, Source, SplitSource, splits_reading

log = logging.getLogger(__name__)

LOW_NICENESS = 10  # added to the capture thread's nice value at capture_priority = "low"

CaptureState = Literal["starting", "ok", "lost", "ended"]

SLOT_COUNT = 3  # one being written, one latest, one held by the consumer
LOG_EVERY_N_FAILURES = 10
HEARTBEAT_S = 1.0  # longest wait without touching last_progress_ns
_JITTER = 0.25  # a backoff delay is shortened by up to this fraction, so cameras do not retry in step


@dataclass(frozen=True, slots=True)
class CaptureStats:
    """A consistent snapshot of the capture counters.

    ``last_progress_ns`` (monotonic) moves on every successful read, every open attempt and at
    least every ``HEARTBEAT_S`` while the thread waits (pacing or backoff): a stale value means the
    thread is stuck in a camera call or gone, not merely reconnecting.
    """

    state: CaptureState
    frames_captured: int
    frames_decoded: int
    dropped_stale: int
    read_errors: int
    reconnects: int
    size_changes: int
    last_error: str | None
    last_progress_ns: int
    alive: bool


@dataclass(slots=True)
class _SlotInfo:
    frame_id: int = -1
    t_capture_ns: int = 0
    t_wall_ns: int = 0
    channel_order: Literal["bgr", "rgb"] = "bgr"
    truth: object | None = None


class Capture:
    """Owns the capture thread and a few preallocated slots (3: one being written, one latest, one
    held by the consumer).

    Latest-frame semantics: a new frame replaces an unconsumed one (counted as ``dropped_stale``),
    so a slow model never builds a backlog. A lost camera is reconnected with capped exponential
    backoff (``backoff_initial_s`` doubling to ``backoff_max_s``, with jitter) forever, until
    stopped; frame ids continue across reconnects. One consumer thread calls ``take``.

    With a source that has ``grab`` and ``retrieve``, a frame is decoded only when the consumer
    is waiting or may ask before a newer frame could be decoded (`edged.demand`); a frame skipped
    undecoded counts as ``dropped_stale`` like one replaced in its slot. ``decode_all`` decodes
    every frame, as for a consumer that takes them all (the bench's worst case).
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
    ) -> None:
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise ValueError(f"need 0 < backoff_initial_s <= backoff_max_s, got {backoff_initial_s} and {backoff_max_s}")
        self._factory = source_factory
        self._priority = priority
        self._camera_id = camera_id
        self._extra = {"CAMERA": camera_id}
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._decode_all = decode_all
        self._rng = random.Random()
        self._stop = threading.Event()
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        # Guarded by _cond: slots, their frame info, and which slot is latest / held.
        self._slots: list[np.ndarray | None] = [None] * SLOT_COUNT
        self._info = [_SlotInfo() for _ in range(SLOT_COUNT)]
        self._latest: int | None = None
        self._held: int | None = None
        self._shape: tuple[int, ...] | None = None
        self._demand = Demand()
        self._next_id = 0
        self._state: CaptureState = "starting"
        self._failures = 0  # failed opens/reads since the last good frame
        self._frames_captured = 0
        self._frames_decoded = 0
        self._dropped_stale = 0
        self._read_errors = 0
        self._reconnects = 0
        self._size_changes = 0
        self._last_error: str | None = None
        self._last_progress_ns = time.monotonic_ns()

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
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._held = None
            self._demand.asked(time.monotonic_ns())
            while self._latest is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set() or self._state == "ended":
                    self._demand.answered(time.monotonic_ns(), served=False)
                    return None
                self._cond.wait(remaining)
            index = self._held = self._latest
            self._latest = None
            image = self._slots[index]
            info = self._info[index]
            self._demand.answered(time.monotonic_ns(), served=True)
        if image is None:
            raise RuntimeError("capture slot published without an image")
        return Frame(image, info.frame_id, info.t_capture_ns, info.t_wall_ns, info.channel_order, info.truth)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and release the camera, waiting at most ``timeout_s``.

        A thread blocked inside a camera read cannot be interrupted; it then finishes the read,
        releases the camera itself and exits (it is a daemon thread, so it never holds up exit).
        """
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
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
        with self._cond:
            return CaptureStats(
                state=self._state,
                frames_captured=self._frames_captured,
                frames_decoded=self._frames_decoded,
                dropped_stale=self._dropped_stale,
                read_errors=self._read_errors,
                reconnects=self._reconnects,
                size_changes=self._size_changes,
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
            with self._cond:
                self._last_error = f"capture thread failed: {e!r}"
                self._state = "lost"
        finally:
            with self._cond:
                self._cond.notify_all()

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
                if self._sleep(self._backoff_s(self._failures)):
                    return
                with self._cond:
                    self._reconnects += 1
            source = self._open()
            if source is None:
                continue
            try:
                outcome = self._stream(source)
            finally:
                self._close(source)
            if outcome == "ended":
                self._mark_ended()
                return

    def _backoff_s(self, failures: int) -> float:
        base = min(self._backoff_max_s, self._backoff_initial_s * 2.0 ** min(failures - 1, 30))
        return base * (1.0 - _JITTER * self._rng.random())

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` unless stopped (then True), touching last_progress_ns as a heartbeat."""
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if self._stop.wait(min(remaining, HEARTBEAT_S)):
                return True
            self._last_progress_ns = time.monotonic_ns()

    def _open(self) -> Source | None:
        source: Source | None = None
        try:
            source = self._factory()
            source.open()
        except SourceError as e:
            if source is not None:
                self._close(source)
            self._fail(str(e), read=False)
            return None
        self._touch()
        return source

    def _close(self, source: Source) -> None:
        try:
            source.close()
        except Exception as e:  # closing a camera that is already gone may fail in any way
            log.debug("camera %s: close failed: %s", self._camera_id, e, extra=self._extra)

    def _stream(self, source: Source) -> Literal["ended", "lost", "stopped"]:
        pace = getattr(source, "pace", None)
        period = pace() if pace is not None else None
        truth = getattr(source, "truth", None)
        split = source if splits_reading(source) else None
        order = source.channel_order
        timing = StreamTiming(period_ns=period * 1e9 if period else 0.0, paced=bool(period))
        due = time.monotonic()
        first = True
        while not self._stop.is_set():
            if period:
                if self._sleep(due - time.monotonic()):
                    return "stopped"
                # Keep the schedule through jitter, but never burst to catch up after a slow read.
                due = max(due + period, time.monotonic())
            try:
                got = self._read(source, split, timing, decode=first or self._decode_all)
            except SourceError as e:
                self._fail(str(e), read=True)
                return "lost"
            if got == "ended":
                return "ended"
            if got == "skipped":
                continue
            self._publish(*got, order, truth() if truth is not None else None)
            if first:
                self._mark_ok(on_demand=split is not None and not self._decode_all)
                first = False
        return "stopped"

    def _read(
        self, source: Source, split: SplitSource | None, timing: StreamTiming, decode: bool
    ) -> tuple[int, int, int] | Literal["ended", "skipped"]:
        """The next frame into a free slot: (slot, t_capture_ns, t_wall_ns), or why there is none.

        A source with ``grab``/``retrieve`` (``split``, the same object) has its frame grabbed,
        then decoded only when ``decode`` or when the consumer may want it; otherwise it is
        counted as skipped.
        """
        if split is None:
            index, buf = self._claim()
            image = source.read(buf)
            if image is None:
                return "ended"
            t_capture_ns, t_wall_ns = time.monotonic_ns(), time.time_ns()
        else:
            if not split.grab():
                return "ended"
            t_capture_ns, t_wall_ns = time.monotonic_ns(), time.time_ns()
            timing.grabbed(t_capture_ns)
            if not decode and not self._wanted(t_capture_ns, timing):
                self._skip(t_capture_ns)
                return "skipped"
            index, buf = self._claim()
            image = split.retrieve(buf)
            timing.decoded(time.monotonic_ns() - t_capture_ns)
        if buf is None or image.shape != buf.shape or image.dtype != buf.dtype:
            self._adopt(index, image)
        elif image is not buf:
            np.copyto(buf, image)  # a source that could not fill the slot in place
        return index, t_capture_ns, t_wall_ns

    def _wanted(self, now_ns: int, timing: StreamTiming) -> bool:
        with self._cond:
            return self._demand.wants(now_ns, timing.newer_ready_ns)

    def _skip(self, t_capture_ns: int) -> None:
        """A frame grabbed and left undecoded: it takes an id, so the gap shows it as dropped.

        A decoded frame still waiting is dropped with it: the consumer has stopped asking (within
        a cycle the decision only turns from skip to decode), and when it asks again it should
        get the next frame, not one from before its pause.
        """
        with self._cond:
            self._next_id += 1
            self._frames_captured += 1
            self._dropped_stale += 1 + (self._latest is not None)
            self._latest = None
            self._last_progress_ns = t_capture_ns

    def _claim(self) -> tuple[int, np.ndarray | None]:
        """A slot neither latest nor held (with 3 slots there is always one), sized for the stream."""
        with self._cond:
            index = next(i for i in range(SLOT_COUNT) if i != self._latest and i != self._held)
            buf = self._slots[index]
            if self._shape is not None and (buf is None or buf.shape != self._shape):
                buf = self._slots[index] = np.empty(self._shape, np.uint8)
            return index, buf

    def _adopt(self, index: int, image: np.ndarray) -> None:
        """Take a frame of a new size as slot ``index`` and resize the other free slots to match."""
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise SourceError(f"source delivered {image.shape} {image.dtype} frames; expected (height, width, 3) uint8")
        with self._cond:
            previous = self._shape
            self._shape = image.shape
            self._slots[index] = image
            for i in range(SLOT_COUNT):
                # The latest and held slots still carry frames of the old size; _claim resizes them later.
                if i not in (index, self._latest, self._held):
                    self._slots[i] = np.empty(image.shape, np.uint8)
            if previous is not None:
                self._size_changes += 1
        if previous is not None:
            log.warning(
                "camera %s: frame size changed from %dx%d to %dx%d",
                self._camera_id,
                previous[1],
                previous[0],
                image.shape[1],
                image.shape[0],
                extra=self._extra,
            )

    def _publish(
        self, index: int, t_capture_ns: int, t_wall_ns: int, order: Literal["bgr", "rgb"], truth: object | None
    ) -> None:
        with self._cond:
            info = self._info[index]
            info.frame_id = self._next_id
            info.t_capture_ns = t_capture_ns
            info.t_wall_ns = t_wall_ns
            info.channel_order = order
            info.truth = truth
            self._next_id += 1
            if self._latest is not None:
                self._dropped_stale += 1
            self._latest = index
            self._frames_captured += 1
            self._frames_decoded += 1
            self._last_progress_ns = t_capture_ns
            self._cond.notify()

    def _touch(self) -> None:
        self._last_progress_ns = time.monotonic_ns()

    # ---- state changes, each logged once ---------------------------------------------------

    def _mark_ok(self, *, on_demand: bool) -> None:
        with self._cond:
            previous, failures, shape = self._state, self._failures, self._shape
            self._state = "ok"
            self._failures = 0
        size = f"{shape[1]}x{shape[0]}" if shape else "?"
        if previous == "lost":
            log.info(
                "camera %s: back after %d failed attempt(s), %s frames", self._camera_id, failures, size, extra=self._extra
            )
        elif previous == "starting":
            decoding = "decoding only the frames the model may take" if on_demand else "decoding every frame"
            log.info("camera %s: delivering %s frames, %s", self._camera_id, size, decoding, extra=self._extra)

    def _fail(self, message: str, *, read: bool) -> None:
        with self._cond:
            previous = self._state
            self._state = "lost"
            self._failures += 1
            failures = self._failures
            self._read_errors += int(read)
            self._last_error = message
            self._last_progress_ns = time.monotonic_ns()
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
        with self._cond:
            self._state = "ended"
            self._cond.notify_all()
        log.info("camera %s: end of stream", self._camera_id, extra=self._extra)
