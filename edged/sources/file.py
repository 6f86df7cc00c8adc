"""Recorded video: a file decoded by OpenCV's FFmpeg backend, looped and paced like a camera by default.

Pacing at the file's own frame rate gives a bench run the same latest-frame behaviour as a live
camera; unpaced (``realtime = false``), every frame is processed, each decoded once the model has
taken the one before, as a recorded shift is checked offline. Problems with the file itself raise
``SourceError`` naming it, and so do frames larger than edged takes (`frame_size_problem`), known
when the file opens, before edged decodes one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import cv2
import numpy as np

from edged.errors import SourceError
from edged.settings.sources import FileSourceConfig
from edged.sources.base import OpenCvCapture, frame_size_problem

log = logging.getLogger(__name__)

FALLBACK_FPS = 25.0
_PLAUSIBLE_FPS = (1.0, 240.0)
_UNDECODABLE = "the file may be damaged; check it with ffprobe"


class FileSource(OpenCvCapture):
    """A video file through ``cv2.VideoCapture(path, cv2.CAP_FFMPEG)``; restarts at the end when ``loop``."""

    def __init__(self, cfg: FileSourceConfig) -> None:
        what = f"video file {cfg.path}"
        super().__init__(cfg.channel_order, what, _UNDECODABLE, failed=f"decoding {what} failed")
        self._cfg = cfg
        self._path = cfg.path
        self._fps = FALLBACK_FPS
        self._decoded = 0  # frames decoded since the file was last opened
        self._reached_ms = 0.0  # the last frame's time in the file
        self._listed = 0  # frames its container lists (0: not said)
        self._cut_said = False

    def open(self) -> None:
        self._cap = self._open_capture()
        fps = float(self._cap.get(cv2.CAP_PROP_FPS))
        if _PLAUSIBLE_FPS[0] <= fps <= _PLAUSIBLE_FPS[1]:
            self._fps = fps
        else:
            log.warning(
                "video file %s reports %.3g fps; pacing at %.0f fps",
                self._path,
                fps,
                FALLBACK_FPS,
                extra={"CAMERA": self._cfg.camera_id},
            )
        log.info(
            "video file %s: %dx%d, %.2f fps, %d frames, loop=%s, realtime=%s",
            self._path,
            int(self._cap.get(cv2.CAP_PROP_FRAME_WIDTH)),
            int(self._cap.get(cv2.CAP_PROP_FRAME_HEIGHT)),
            self._fps,
            int(self._cap.get(cv2.CAP_PROP_FRAME_COUNT)),
            self._cfg.loop,
            self._cfg.realtime,
            extra={"CAMERA": self._cfg.camera_id},
        )

    def _open_capture(self) -> cv2.VideoCapture:
        """The file opened at its start, at `open` and at each loop; `SourceError` says why not. The
        file is looked at first each time: one deleted, emptied or made unreadable while it played is
        named as such, not as a file FFmpeg does not recognise."""
        try:
            size = os.stat(self._path).st_size if self._path.is_file() else None
        except OSError:
            size = None
        if size is None:
            raise SourceError(f"video file {self._path} does not exist or is not a file (check source.path)")
        if not os.access(self._path, os.R_OK):
            raise SourceError(f"video file {self._path} is not readable by this user (check its permissions)")
        if size == 0:
            raise SourceError(
                f"video file {self._path} is empty (0 bytes): is it still being written, or was its copy cut short?"
            )
        cap = cv2.VideoCapture(str(self._path), cv2.CAP_FFMPEG)
        if not cap.isOpened():
            cap.release()
            _raise_if_unopenable(self._path)  # FFmpeg says only that it failed: out of descriptors is said as such
            raise SourceError(
                f"cannot decode video file {self._path}: FFmpeg does not recognise it (check "
                "that the file is complete and its container and codec are supported, "
                "e.g. with ffprobe)"
            )
        # The size FFmpeg found while opening the file: its headers', or a frame's it decoded to learn it.
        width, height = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if (problem := frame_size_problem(width, height)) is not None:
            cap.release()
            raise SourceError(
                f"video file {self._path} has frames of {problem} (make a copy at a lower resolution, e.g. "
                "`ffmpeg -i FILE -vf scale=3840:-2 SMALLER.mp4`)"
            )
        self._decoded = 0
        self._reached_ms = 0.0
        self._listed = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        return cap

    def read(self, out: np.ndarray | None) -> np.ndarray | None:
        return self.retrieve(out) if self.grab() else None

    def grab(self) -> bool:
        """Advance to the next frame without converting it; False at the end of a file that does not loop.

        FFmpeg decodes the compressed frame here (later frames may depend on it); `retrieve`
        converts it to BGR, which is the part a skipped frame saves.
        """
        if self._grab_one():
            return True
        if self._decoded == 0:
            raise SourceError(
                f"no frame could be decoded from video file {self._path} "
                "(check its codec with ffprobe; the file may be truncated)"
            )
        self._say_if_cut()
        if not self._cfg.loop:
            return False
        # Reopening is slower than seeking to frame 0 but works for every container, seekable or not.
        self.close()
        self._cap = self._open_capture()
        if not self._grab_one():
            raise SourceError(
                f"video file {self._path} could not be read again from its start "
                "(was it replaced or truncated while running?)"
            )
        return True

    def _say_if_cut(self) -> None:
        """At the end of the file: a warning, once, when it ended well before the frames its container
        lists (a copy cut short, data damaged halfway): FFmpeg reads such a file to where it breaks and
        reports its end, and the rest would be left out without a word. A few frames short is an
        estimate's error (a container that gives only a duration), not a fault; so is a count short
        where the last frame came at the file's end: a variable frame rate's count is its duration
        times its nominal rate, which can list several times the frames it holds."""
        if self._cut_said or self._decoded + max(2, self._listed // 20) >= self._listed:
            return
        duration_ms = 1000.0 * self._listed / self._fps
        if self._reached_ms >= duration_ms - max(2000.0 / self._fps, duration_ms / 20):
            return
        self._cut_said = True
        log.warning(
            "video file %s ended after %d of the %d frames its container lists: the rest could not be read "
            "(is it truncated or damaged? check it with ffprobe)%s",
            self._path,
            self._decoded,
            self._listed,
            "; playing it again from its start" if self._cfg.loop else "",
            extra={"CAMERA": self._cfg.camera_id},
        )

    def _grab_one(self) -> bool:
        ok = self._grab()
        if ok:
            self._decoded += 1
            self._reached_ms = float(self._opened().get(cv2.CAP_PROP_POS_MSEC))
        return ok

    def pace(self) -> float | None:
        """Seconds between frames at the file's own rate (``FALLBACK_FPS`` if implausible); ``None`` unless realtime."""
        return 1.0 / self._fps if self._cfg.realtime else None

    def keeps_every_frame(self) -> bool:
        """Unpaced, every frame is processed: read faster than the model, all but the newest would be dropped."""
        return not self._cfg.realtime


def _raise_if_unopenable(path: Path) -> None:
    """`SourceError` with the reason where ``path`` cannot be opened at all (no descriptor left: EMFILE)."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
    except OSError as e:
        raise SourceError(f"cannot open video file {path}: {e.strerror or e}") from None
