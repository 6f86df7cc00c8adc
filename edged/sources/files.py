"""Recorded input: a video file decoded by OpenCV's FFmpeg backend, or a folder/glob of still images.

Both behave like a camera for the rest of edged: they loop by default and are paced (the file at
its own frame rate, images at ``fps``), so a bench run sees the same latest-frame behaviour as a
live camera. Problems with the files themselves raise ``SourceError`` naming the file.
"""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path
from typing import Literal

import cv2
import numpy as np

from edged.config import FileSource, ImagesSource
from edged.errors import SourceError
from edged.sources import retrieve_frame

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp"})
FALLBACK_FPS = 25.0
_PLAUSIBLE_FPS = (1.0, 240.0)


def _into(out: np.ndarray | None, image: np.ndarray) -> np.ndarray:
    """``image`` copied into ``out`` when the shapes match, else ``image`` itself (a new size)."""
    if out is not None and out.shape == image.shape and out.dtype == image.dtype:
        np.copyto(out, image)
        return out
    return image


class VideoFileSource:
    """A video file through ``cv2.VideoCapture(path, cv2.CAP_FFMPEG)``; restarts at the end when ``loop``."""

    def __init__(self, cfg: FileSource) -> None:
        self._cfg = cfg
        self._path = cfg.path
        self.channel_order: Literal["bgr", "rgb"] = cfg.channel_order
        self._cap: cv2.VideoCapture | None = None
        self._fps = FALLBACK_FPS
        self._decoded = 0  # frames decoded since the file was last opened

    @property
    def fps(self) -> float:
        """The file's frame rate (``FALLBACK_FPS`` when the container does not give a plausible one)."""
        return self._fps

    def open(self) -> None:
        if not self._path.is_file():
            raise SourceError(f"video file {self._path} does not exist or is not a file (check source.path)")
        if not os.access(self._path, os.R_OK):
            raise SourceError(f"video file {self._path} is not readable by this user (check its permissions)")
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
        cap = cv2.VideoCapture(str(self._path), cv2.CAP_FFMPEG)
        if not cap.isOpened():
            cap.release()
            raise SourceError(
                f"cannot decode video file {self._path}: FFmpeg does not recognise it (check "
                "that the file is complete and its container and codec are supported, "
                "e.g. with ffprobe)"
            )
        self._decoded = 0
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

    def retrieve(self, out: np.ndarray | None) -> np.ndarray:
        """The frame last grabbed, in ``out`` when its shape fits (no allocation)."""
        return retrieve_frame(
            self._opened(),
            out,
            failed=f"decoding video file {self._path} failed",
            undecodable=f"a frame of video file {self._path} could not be decoded "
            "(the file may be damaged; check it with ffprobe)",
        )

    def _grab_one(self) -> bool:
        try:
            ok = self._opened().grab()
        except cv2.error as e:
            raise SourceError(f"decoding video file {self._path} failed: {e}") from e
        self._decoded += int(ok)
        return bool(ok)

    def _opened(self) -> cv2.VideoCapture:
        if self._cap is None:
            raise SourceError(f"video file {self._path} read before open()")
        return self._cap

    def pace(self) -> float | None:
        return 1.0 / self._fps if self._cfg.realtime else None

    def close(self) -> None:
        if self._cap is not None:
            self._cap.release()
            self._cap = None


def list_images(pattern: str) -> list[str]:
    """The image files named by ``pattern``: a folder (known extensions only), a glob, or one file; sorted."""
    path = Path(pattern)
    if path.is_dir():
        return sorted(str(p) for p in path.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    if any(c in pattern for c in "*?["):
        return sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if path.is_file():
        return [pattern]
    raise SourceError(f"image folder {pattern} does not exist (check source.path: a folder, a glob or a file)")


class ImageFolderSource:
    """Still images read with ``cv2.imread`` in sorted order; unreadable ones are skipped and counted."""

    def __init__(self, cfg: ImagesSource) -> None:
        self._cfg = cfg
        self.channel_order: Literal["bgr", "rgb"] = cfg.channel_order
        self._paths: list[str] = []
        self._next = 0
        self._reported: set[str] = set()
        self.skipped = 0

    @property
    def paths(self) -> list[str]:
        return list(self._paths)

    def open(self) -> None:
        self._paths = list_images(self._cfg.path)
        if not self._paths:
            kinds = " ".join(sorted(IMAGE_EXTENSIONS))
            raise SourceError(f"no images found at {self._cfg.path} (looked for {kinds}; check source.path)")
        self._next = 0
        log.info(
            "image source %s: %d images at %.1f fps, loop=%s",
            self._cfg.path,
            len(self._paths),
            self._cfg.fps,
            self._cfg.loop,
            extra={"CAMERA": self._cfg.camera_id},
        )

    def read(self, out: np.ndarray | None) -> np.ndarray | None:
        for _ in range(len(self._paths)):
            if self._next == len(self._paths):
                if not self._cfg.loop:
                    return None
                self._next = 0
            path = self._paths[self._next]
            self._next += 1
            image = cv2.imread(path, cv2.IMREAD_COLOR)
            if image is None:
                self._skip(path)
                continue
            return _into(out, image)
        raise SourceError(
            f"none of the {len(self._paths)} images at {self._cfg.path} could be read "
            "(check that they are image files OpenCV can decode)"
        )

    def _skip(self, path: str) -> None:
        self.skipped += 1
        if path not in self._reported:
            self._reported.add(path)
            log.warning(
                "skipping unreadable image %s (missing, truncated or not an image)",
                path,
                extra={"CAMERA": self._cfg.camera_id},
            )

    def pace(self) -> float:
        return 1.0 / self._cfg.fps

    def close(self) -> None:
        """Nothing to release: ``cv2.imread`` opens and closes each file itself."""
