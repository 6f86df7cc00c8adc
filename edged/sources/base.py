"""What every camera kind's module builds on: the frame it hands over, the `Source` protocol and its
optional members, the largest frame edged takes (`frame_size_problem`), and what the sources read
through OpenCV share (`OpenCvCapture`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, TypeGuard

import cv2
import numpy as np

from edged.errors import SourceError
from edged.settings.sources import MAX_HEIGHT, MAX_SIDE, MAX_WIDTH

# The largest frame edged takes from any source: a camera's largest, 100 MB as 8-bit BGR (an image
# file decoded, about twice that at the peak), which the plans (`edged.pipeline.PLAN_PIXELS`) and the
# buffers of a segmentation or anomaly model are sized for. A video file or a network stream claims
# what it likes: a 2 MB MJPEG AVI of 10000x10000 frames took 780 MB at its first frame, past what
# a 4 GB board spares. MAX_SIDE bounds a side too: some of a plan's buffers grow with a side, not the
# pixels (an anomaly model's resize holds its input's height times the frame's width, twice, in float32).
MAX_PIXELS = MAX_WIDTH * MAX_HEIGHT
PIXEL_LIMIT = f"{MAX_PIXELS} pixels ({MAX_WIDTH}x{MAX_HEIGHT})"


def frame_size_problem(width: int, height: int) -> str | None:
    """Why frames of ``width`` x ``height`` are too large for edged (over `MAX_PIXELS`, or a side over
    `MAX_SIDE`), to follow "frames of"; None when they are not."""
    if width * height > MAX_PIXELS:
        return f"{width}x{height} pixels, over the {PIXEL_LIMIT} edged takes"
    if max(width, height) > MAX_SIDE:
        return f"{width}x{height} pixels, a side longer than the {MAX_SIDE} edged takes"
    return None


@dataclass(frozen=True, slots=True)
class Frame:
    """One captured frame as handed to the consumer.

    ``image`` is a view into a capture slot, valid until the consumer's next ``take()``; copy it to
    keep it longer. ``frame_id`` increases by 1 per captured frame and continues across reconnects,
    so a gap between two ids is the number of frames dropped as stale. ``source_file`` is the file
    the frame was read from, for a source that names its frames (an image folder), else None.
    """

    image: np.ndarray
    frame_id: int
    t_capture_ns: int
    t_wall_ns: int
    channel_order: Literal["bgr", "rgb"]
    source_file: str | None = None


class Source(Protocol):
    """One camera kind. Opening and reading may block (camera I/O); they run only on the capture thread.

    ``read(out)`` fills ``out`` in place when its shape fits and returns it (OpenCV's
    ``read(image=out)``), so steady-state capture allocates nothing. It returns a new array when the
    frame size differs (a renegotiated camera; the new array then belongs to the caller), ``None``
    at the end of a finite stream, and raises ``SourceError`` when the camera is lost.

    Optional members, checked once per opened source by the capture thread (`paces`, `splits_reading`):

    - ``pace() -> float | None``: seconds between frames for sources that must be paced (files,
      image folders, synthetic scenes). The capture thread waits between reads; ``read`` itself
      never sleeps, so stopping is never held up by pacing. Live cameras return ``None``.
    - ``grab() -> bool`` and ``retrieve(out) -> np.ndarray``: ``read`` in two halves, as OpenCV
      splits it. ``grab`` takes the next frame off the camera without converting it (``False`` at
      the end of a finite stream), ``retrieve`` decodes the frame last grabbed into ``out``. With
      both, the capture thread grabs every frame but decodes only those the consumer may take.
    - ``timeouts() -> tuple[float, float]``: for network streams, the longest waits (s) for the
      first frame after opening starts and between two frames. The capture thread calls a stream
      that exceeds them stalled, on its own clock, even when the camera call itself said ok.
    - ``frame_age_ns() -> int``: for cameras whose frames carry the sensor's own timestamp, how
      long before the last ``read`` returned its frame was captured; the frame's capture time is
      then that much before the read returned, not when it returned.
    - ``frame_sizes_vary = True`` (a class attribute, read from the config by `sizes_vary`): for
      sources whose frames legitimately differ in size (an image folder). Each size then gets its
      own plan; a camera's new size is a renegotiation, re-planned only once it lasts.
    - ``frame_name() -> str``: for sources whose frames are files (an image folder), the name of
      the file the last ``read`` returned; the frame carries it into its messages.
    - ``keeps_every_frame() -> bool``: True when every frame must be processed (an image folder
      with ``pace = false``): the capture thread then reads the next frame only once the consumer
      has taken the one before, so none is dropped, however slow the model.
    - ``skipped`` (an int property): for sources that pass over frames they cannot read (an image
      folder's unreadable images), how many since opening; the capture counts them across reopens.
    """

    channel_order: Literal["bgr", "rgb"]

    def open(self) -> None:
        """Acquire the camera; raise ``SourceError`` with an actionable message on failure."""

    def read(self, out: np.ndarray | None) -> np.ndarray | None:
        """The next frame, in ``out`` when its shape fits (see the class docstring)."""

    def close(self) -> None:
        """Release the camera; safe to call more than once and after a failed ``open``."""


class SplitSource(Source, Protocol):
    """A source whose reading comes in OpenCV's two halves (see `Source`, ``grab``/``retrieve``)."""

    def grab(self) -> bool:
        """Take the next frame off the camera without decoding it; ``False`` at the end of a finite stream."""

    def retrieve(self, out: np.ndarray | None) -> np.ndarray:
        """The frame last grabbed, decoded into ``out`` when its shape fits."""


def splits_reading(source: Source) -> TypeGuard[SplitSource]:
    """Whether ``source`` has ``grab`` and ``retrieve``, so the capture thread can skip decoding."""
    return callable(getattr(source, "grab", None)) and callable(getattr(source, "retrieve", None))


class PacedSource(Source, Protocol):
    """A source that may need pacing (see `Source`, ``pace``)."""

    def pace(self) -> float | None:
        """Seconds between frames, or ``None`` when reading itself keeps the camera's pace."""


def paces(source: Source) -> TypeGuard[PacedSource]:
    """Whether ``source`` has ``pace``, so the capture thread may have to wait between reads."""
    return callable(getattr(source, "pace", None))


class TimedSource(Source, Protocol):
    """A stream that can stall without failing a read (see `Source`, ``timeouts``)."""

    def timeouts(self) -> tuple[float, float]:
        """Seconds allowed until the first frame after opening starts, and between frames."""


def times_out(source: Source) -> TypeGuard[TimedSource]:
    """Whether ``source`` has ``timeouts``, so the capture thread watches it for stalls."""
    return callable(getattr(source, "timeouts", None))


class StampedSource(Source, Protocol):
    """A camera whose frames carry their capture time (see `Source`, ``frame_age_ns``)."""

    def frame_age_ns(self) -> int:
        """Nanoseconds between the capture of the frame the last ``read`` returned and that return."""


def stamps(source: Source) -> TypeGuard[StampedSource]:
    """Whether ``source`` has ``frame_age_ns``, so a frame's capture time comes from the camera."""
    return callable(getattr(source, "frame_age_ns", None))


class NamedSource(Source, Protocol):
    """A source whose frames are files (see `Source`, ``frame_name``)."""

    def frame_name(self) -> str:
        """The file the last ``read`` returned its frame from."""


def names_frames(source: Source) -> TypeGuard[NamedSource]:
    """Whether ``source`` has ``frame_name``, so each frame carries the name of its file."""
    return callable(getattr(source, "frame_name", None))


def frames_vary_in_size(source: object) -> bool:
    """Whether the frames of ``source`` (a source, or what builds one) differ in size by nature (see `Source`,
    ``frame_sizes_vary``)."""
    return bool(getattr(source, "frame_sizes_vary", False))


def skipped(source: Source) -> int:
    """The frames ``source`` has passed over as unreadable since it opened (see `Source`, ``skipped``); 0 for others."""
    count = getattr(source, "skipped", 0)
    return count if isinstance(count, int) else 0


def keeps_every_frame(source: Source) -> bool:
    """Whether every frame of ``source`` must be processed (see `Source`, ``keeps_every_frame``)."""
    keeps = getattr(source, "keeps_every_frame", None)
    return callable(keeps) and bool(keeps())


class OpenCvCapture:
    """What the sources read through one ``cv2.VideoCapture`` share: OpenCV's grab and its retrieve
    straight into ``out`` when its shape fits (no allocation), errors that name the source, close.

    ``what`` names the source; ``undecodable`` says why a frame of it may not decode and what to
    check; ``failed`` prefixes OpenCV's own messages (by default "WHAT failed").
    """

    def __init__(self, channel_order: Literal["bgr", "rgb"], what: str, undecodable: str, failed: str | None = None) -> None:
        self.channel_order = channel_order
        self._cap: cv2.VideoCapture | None = None
        self._what = what
        self._undecodable = f"a frame of {what} could not be decoded ({undecodable})"
        self._failed = failed or f"{what} failed"

    def _grab(self) -> bool:
        try:
            return bool(self._opened().grab())
        except cv2.error as e:
            raise SourceError(f"{self._failed}: {e}") from e

    def retrieve(self, out: np.ndarray | None) -> np.ndarray:
        """The frame last grabbed, converted straight into ``out`` when its shape fits."""
        try:
            ok, image = self._opened().retrieve(image=out)
        except cv2.error as e:
            raise SourceError(f"{self._failed}: {e}") from e
        if not ok:
            raise SourceError(self._undecodable)
        return image

    def _opened(self) -> cv2.VideoCapture:
        if self._cap is None:
            raise SourceError(f"{self._what} read before open()")
        return self._cap

    def close(self) -> None:
        if self._cap is not None:
            self._cap.release()
            self._cap = None
