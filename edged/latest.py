"""The latest-frame slot ring between the capture thread and its one consumer.

Three preallocated slots: one being written by the producer, one holding the newest frame not yet
taken, one held by the consumer until its next ``take``. A new frame replaces one the consumer has
not taken (counted as stale), so a slow consumer never builds a backlog and never sees a frame
older than the newest one delivered before it asked. The consumer's calls to ``take`` are also how
the producer learns which frames are worth decoding (`edged.demand`).

A dropped frame is counted under the reason the consumer last gave for not taking frames
(`DropCause`): a healthy triggered line drops most frames because nobody asked for them, which is
not the fault that a model too slow for its camera is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from edged.demand import Demand
from edged.errors import SourceError
from edged.sources.base import Frame
from edged.wake import Waker

SLOT_COUNT = 3  # one being written, one latest, one held by the consumer

# Why a frame was dropped: the consumer was busy with earlier frames (the model or the lanes too
# slow for the camera), the rate cap held it back (service.max_fps, thermal), or it wanted no frame
# (request mode between requests).
DropCause = Literal["stale_slow", "rate_capped", "not_requested"]
DROP_CAUSES: tuple[DropCause, ...] = ("stale_slow", "rate_capped", "not_requested")

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FrameCounts:
    """A consistent snapshot of the ring's counters.

    Every frame the producer obtains takes an id, handed over or skipped, so ``frames_captured`` is
    also the next frame's id, and a gap between two taken ids is the frames dropped in between,
    each counted in ``dropped`` under its `DropCause`.
    """

    frames_captured: int
    frames_decoded: int
    dropped: dict[DropCause, int]
    size_changes: int


@dataclass(slots=True)
class _SlotInfo:
    frame_id: int = -1
    t_capture_ns: int = 0
    t_wall_ns: int = 0
    channel_order: Literal["bgr", "rgb"] = "bgr"
    source_file: str | None = None


class LatestFrame:
    """Three frame slots with latest-frame hand-over from one producer to one consumer.

    The producer ``claim``s a free slot, fills it (in place when the source can), ``adopt``s what
    it got and ``hand_over``s it as the latest frame; a frame it grabbed but left undecoded is
    ``skip``ped, which still takes an id. The consumer ``take``s the latest frame, which stays
    untouched until its next ``take``. Frames of a new size become the slot size: the free slots
    are resized at once, the latest and the held one when they are next claimed, so a frame the
    consumer holds is never overwritten.

    ``clock`` (monotonic ns, the producer's clock) stamps the consumer's calls for `Demand`.
    ``wake`` is set on every hand-over and on close: a consumer serving several rings waits on
    one event for all of them.
    """

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns, wake: Waker | None = None) -> None:
        self._clock = clock
        self._wake = wake
        self._cond = threading.Condition(threading.Lock())
        # Guarded by _cond: everything below.
        self._slots: list[np.ndarray | None] = [None] * SLOT_COUNT
        self._info = [_SlotInfo() for _ in range(SLOT_COUNT)]
        self._latest: int | None = None
        self._held: int | None = None
        self._shape: Shape | None = None
        self._closed = False
        self._demand = Demand()
        self._next_id = 0
        self._decoded = 0
        self._dropped: dict[DropCause, int] = dict.fromkeys(DROP_CAUSES, 0)
        self._cause: DropCause = "stale_slow"  # set by the consumer, read under _cond by the producer
        self._size_changes = 0

    # ---- consumer side ---------------------------------------------------------------------

    def take(self, timeout_s: float) -> Frame | None:
        """The newest frame not yet taken, or ``None`` on timeout or once closed with none waiting.

        Releases the slot of the previously taken frame. ``timeout_s`` is real time: it bounds a
        real wait, whatever the producer's clock.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._held = None
            self._demand.asked(self._clock())
            while self._latest is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    self._demand.answered(self._clock(), served=False)
                    return None
                self._cond.wait(remaining)
            index = self._held = self._latest
            self._latest = None
            image = self._slots[index]
            info = self._info[index]
            self._demand.answered(self._clock(), served=True)
            self._cond.notify()  # a producer keeping every frame waits for this one to be taken
        if image is None:
            raise RuntimeError("frame slot handed over without an image")
        return Frame(image, info.frame_id, info.t_capture_ns, info.t_wall_ns, info.channel_order, info.source_file)

    def passing(self, cause: DropCause) -> None:
        """Why the consumer takes no frame now: frames dropped from now on count under ``cause``."""
        self._cause = cause

    def close(self) -> None:
        """No more frames will come: ``take`` returns the one still waiting, then ``None`` at once."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._wake is not None:
            self._wake.set()

    def counts(self) -> FrameCounts:
        with self._cond:
            return FrameCounts(
                frames_captured=self._next_id,
                frames_decoded=self._decoded,
                dropped=dict(self._dropped),
                size_changes=self._size_changes,
            )

    # ---- producer side ---------------------------------------------------------------------

    @property
    def shape(self) -> Shape | None:
        """The size of the frames in the slots, set by the first frame and changed by ``adopt``."""
        with self._cond:
            return self._shape

    def wants(self, now_ns: int, newer_ready_ns: float) -> bool:
        """Whether a frame grabbed at ``now_ns`` may be taken before a newer one, ready in ``newer_ready_ns``."""
        with self._cond:
            return self._demand.wants(now_ns, newer_ready_ns)

    def claim(self) -> tuple[int, np.ndarray | None]:
        """A slot neither latest nor held (with 3 slots there is always one), sized for the stream.

        Its buffer is ``None`` until the first frame has set the size. The slot is the producer's
        until it hands it over; the consumer never sees it before.
        """
        with self._cond:
            index = next(i for i in range(SLOT_COUNT) if i != self._latest and i != self._held)
            buf = self._slots[index]
            if self._shape is not None and (buf is None or buf.shape != self._shape):
                buf = self._slots[index] = np.empty(self._shape, np.uint8)
            return index, buf

    def adopt(self, index: int, image: np.ndarray) -> Shape | None:
        """Make ``image`` the content of claimed slot ``index``; the previous size when it changed the size.

        A source that filled the slot in place needs nothing, one that returned another array of
        the slot's shape is copied in, and a frame of a new size becomes the slot itself, with the
        other free slots resized to match.
        """
        buf = self._slots[index]  # a claimed slot is the producer's: no other thread touches it
        if buf is not None and image.shape == buf.shape and image.dtype == buf.dtype:
            if image is not buf:
                np.copyto(buf, image)
            return None
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise SourceError(f"source delivered {image.shape} {image.dtype} frames; expected (height, width, 3) uint8")
        with self._cond:
            previous = self._shape
            self._shape = image.shape
            self._slots[index] = image
            for i in range(SLOT_COUNT):
                # The latest and held slots still carry frames of the old size; claim resizes them later.
                if i not in (index, self._latest, self._held):
                    self._slots[i] = np.empty(image.shape, np.uint8)
            if previous is None:
                return None
            self._size_changes += 1
            return previous

    def taken(self, timeout_s: float) -> bool:
        """Wait until no frame is waiting to be taken, at most ``timeout_s``; False on timeout.

        A producer that must not drop a frame (`edged.sources.base.keeps_every_frame`) reads the
        next only then; once closed, nothing more is taken and this returns True at once.
        """
        with self._cond:
            return self._cond.wait_for(lambda: self._latest is None or self._closed, timeout_s)

    def hand_over(
        self,
        index: int,
        t_capture_ns: int,
        t_wall_ns: int,
        channel_order: Literal["bgr", "rgb"],
        source_file: str | None = None,
    ) -> None:
        """Make claimed slot ``index`` the latest frame, with the next id; a frame still waiting is dropped as stale."""
        with self._cond:
            info = self._info[index]
            info.frame_id = self._next_id
            info.t_capture_ns = t_capture_ns
            info.t_wall_ns = t_wall_ns
            info.channel_order = channel_order
            info.source_file = source_file
            self._next_id += 1
            self._decoded += 1
            if self._latest is not None:
                self._dropped[self._cause] += 1
            self._latest = index
            self._cond.notify()
        if self._wake is not None:
            self._wake.set()

    def skip(self) -> None:
        """A frame grabbed and left undecoded: it takes an id, so the gap shows it as dropped.

        A decoded frame still waiting is dropped with it: the consumer has stopped asking (within
        a cycle the decision only turns from skip to decode), and when it asks again it should
        get the next frame, not one from before its pause.
        """
        with self._cond:
            self._next_id += 1
            self._dropped[self._cause] += 1 + (self._latest is not None)
            self._latest = None
