"""Camera sources: the one place that knows how frames are obtained from each kind of camera.

A source only opens, reads and closes; threading, latest-frame slots, pacing and reconnects belong
to ``edged.capture``. ``open_source`` maps a ``source.type`` from the configuration to its class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeGuard

import cv2
import numpy as np

from edged.errors import SourceError

if TYPE_CHECKING:
    from edged.config import SourceConfig


@dataclass(frozen=True, slots=True)
class Frame:
    """One captured frame as handed to the consumer.

    ``image`` is a view into a capture slot, valid until the consumer's next ``take()``; copy it to
    keep it longer. ``frame_id`` increases by 1 per captured frame and continues across reconnects,
    so a gap between two ids is the number of frames dropped as stale.
    """

    image: np.ndarray
    frame_id: int
    t_capture_ns: int
    t_wall_ns: int
    channel_order: Literal["bgr", "rgb"]
    truth: object | None = None


class Source(Protocol):
    """One camera kind. Opening and reading may block (camera I/O); they run only on the capture thread.

    ``read(out)`` fills ``out`` in place when its shape fits and returns it (OpenCV's
    ``read(image=out)``), so steady-state capture allocates nothing. It returns a new array when the
    frame size differs (a renegotiated camera; the new array then belongs to the caller), ``None``
    at the end of a finite stream, and raises ``SourceError`` when the camera is lost.

    Optional members, looked up with ``getattr`` by the capture thread:

    - ``pace() -> float | None``: seconds between frames for sources that must be paced (files,
      image folders, synthetic scenes). The capture thread waits between reads; ``read`` itself
      never sleeps, so stopping is never held up by pacing. Live cameras return ``None``.
    - ``truth() -> object | None``: ground truth of the frame last read (synthetic scenes).
    - ``grab() -> bool`` and ``retrieve(out) -> np.ndarray``: ``read`` in two halves, as OpenCV
      splits it. ``grab`` takes the next frame off the camera without converting it (``False`` at
      the end of a finite stream), ``retrieve`` decodes the frame last grabbed into ``out``. With
      both, the capture thread grabs every frame but decodes only those the consumer may take.

    Other camera kinds fit the same shape:

    - picamera2: ``read`` enters ``captured_request()`` and ``MappedArray(request, "main")`` and
      copies ``m.array`` (a possibly strided view onto the dmabuf) into ``out`` with
      ``np.copyto``: one pass, and no reference to the camera buffer outlives the ``with`` block.
      Configure ``RGB888``, which is BGR in memory, and report ``channel_order = "bgr"``.
    - GStreamer or RTSP: ``cv2.VideoCapture(pipeline, cv2.CAP_GSTREAMER)`` (an OpenCV built with
      GStreamer) ending in ``appsink drop=true max-buffers=1``, or an ``rtsp://`` URL through
      ``CAP_FFMPEG``; ``grab``/``retrieve`` are OpenCV's like the file source's, a failed read
      raises ``SourceError``, and the capture thread's reconnect loop reopens the stream.
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


def retrieve_frame(cap: cv2.VideoCapture, out: np.ndarray | None, *, failed: str, undecodable: str) -> np.ndarray:
    """OpenCV's ``retrieve`` of the frame last grabbed, straight into ``out`` when its shape fits.

    Errors become ``SourceError``: ``failed`` prefixes OpenCV's own message, ``undecodable`` is
    the whole message for a frame that did not decode.
    """
    try:
        ok, image = cap.retrieve(image=out)
    except cv2.error as e:
        raise SourceError(f"{failed}: {e}") from e
    if not ok:
        raise SourceError(undecodable)
    return image


def _registry() -> dict[str, Callable[[Any], Source]]:
    # Imported here: the submodules import SourceError from this package.
    from edged.sources.files import ImageFolderSource, VideoFileSource
    from edged.sources.synthetic import SyntheticSceneSource
    from edged.sources.v4l2 import V4l2CameraSource

    return {
        "synthetic": SyntheticSceneSource,
        "file": VideoFileSource,
        "images": ImageFolderSource,
        "v4l2": V4l2CameraSource,
    }


def open_source(cfg: SourceConfig) -> Source:
    """Build (not open) the source for ``cfg``; the capture thread opens it.

    Pass ``lambda: open_source(cfg)`` to ``Capture`` so that every reconnect starts from a fresh
    source object.
    """
    try:
        factory = _registry()[cfg.type]
    except KeyError:
        raise SourceError(f"unknown source type {cfg.type!r}") from None
    return factory(cfg)
