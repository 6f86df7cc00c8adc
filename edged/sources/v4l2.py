"""USB/UVC and other V4L2 cameras through OpenCV's V4L2 backend.

Owns the open sequence (pixel format before size, then frame rate and a one-frame driver queue),
reporting what the camera actually negotiated (refused when it is larger than edged takes), and
turning a failed read into ``SourceError`` so the capture thread reconnects.
"""

from __future__ import annotations

import logging
import math
import os

import cv2
import numpy as np

from edged.errors import SourceError
from edged.settings.numerals import INDEX_DIGITS, whole_number
from edged.settings.sources import V4l2SourceConfig
from edged.sources.base import OpenCvCapture, frame_size_problem

log = logging.getLogger(__name__)

SELECT_TIMEOUT_ENV = "OPENCV_VIDEOIO_V4L_SELECT_TIMEOUT"


def _fourcc_text(value: float) -> str:
    code = int(value)
    return "".join(chr((code >> (8 * i)) & 0xFF) for i in range(4))


def _bound_read_wait(fps: float) -> None:
    """Bound how long a read of a stalled camera blocks (OpenCV's default is 10 s per frame).

    OpenCV reads the variable once per process, the first time a V4L2 read has to wait, in whole
    seconds. A few frame periods, at least 2 s so that a slow-starting camera's first frame is not
    refused; a value already set in the environment wins.
    """
    os.environ.setdefault(SELECT_TIMEOUT_ENV, str(max(2, math.ceil(3.0 / fps))))


_UNDECODABLE = "a damaged MJPEG frame, often a USB bandwidth problem: check `dmesg` and the cable"


class V4l2Source(OpenCvCapture):
    """``cv2.VideoCapture(device, cv2.CAP_V4L2)`` with the requested format read back and logged."""

    def __init__(self, cfg: V4l2SourceConfig) -> None:
        super().__init__(cfg.channel_order, f"camera {cfg.device}", _UNDECODABLE)
        self._cfg = cfg

    def _target(self) -> int | str:
        device = self._cfg.device
        index = whole_number(device, INDEX_DIGITS)
        path = f"/dev/video{index}" if index is not None else device
        if not os.path.exists(path):
            raise SourceError(
                f"camera device {path} does not exist (is the camera plugged in? "
                "list cameras with `v4l2-ctl --list-devices`, then check source.device)"
            )
        if not os.access(path, os.R_OK | os.W_OK):
            raise SourceError(
                f"no permission to open camera device {path} (add the service user to the "
                "'video' group; under systemd allow DeviceAllow=char-video4linux rw)"
            )
        return int(device) if index else device

    def open(self) -> None:
        target = self._target()
        _bound_read_wait(self._cfg.fps)
        cap = cv2.VideoCapture(target, cv2.CAP_V4L2)
        if not cap.isOpened():
            cap.release()
            raise SourceError(
                f"cannot open camera {self._cfg.device} with V4L2 (is it a capture device, and "
                "is another process using it? check `v4l2-ctl -d DEVICE --all` and "
                "`fuser DEVICE`)"
            )
        self._cap = cap
        self._configure(cap)

    def _configure(self, cap: cv2.VideoCapture) -> None:
        cfg = self._cfg
        # The pixel format must be set before the size: V4L2 picks sizes per format, and without MJPG
        # most UVC cameras cannot deliver high resolutions at high frame rates.
        cap.set(cv2.CAP_PROP_FOURCC, cv2.VideoWriter.fourcc(*cfg.fourcc))
        cap.set(cv2.CAP_PROP_FRAME_WIDTH, cfg.width)
        cap.set(cv2.CAP_PROP_FRAME_HEIGHT, cfg.height)
        cap.set(cv2.CAP_PROP_FPS, cfg.fps)
        # One driver buffer: the capture thread, not the driver queue, decides which frame is newest.
        cap.set(cv2.CAP_PROP_BUFFERSIZE, 1)
        got = (  # fourcc, width, height, fps
            _fourcc_text(cap.get(cv2.CAP_PROP_FOURCC)),
            int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)),
            int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)),
            float(cap.get(cv2.CAP_PROP_FPS)),
        )
        extra = {"CAMERA": cfg.camera_id}
        log.info("camera %s negotiated %s %dx%d at %.1f fps", cfg.device, *got, extra=extra)
        if (problem := frame_size_problem(got[1], got[2])) is not None:
            raise SourceError(
                f"camera {cfg.device} gives frames of {problem}, not the {cfg.width}x{cfg.height} asked for "
                f"(list its modes with `v4l2-ctl -d {cfg.device} --list-formats-ext`)"
            )
        wanted = (cfg.fourcc, cfg.width, cfg.height)
        if got[:3] != wanted or (got[3] > 0 and not math.isclose(got[3], cfg.fps, rel_tol=0.05)):
            log.warning(
                "camera %s gives %s %dx%d at %.1f fps instead of the requested %s %dx%d at %.1f fps "
                "(list its modes with `v4l2-ctl -d %s --list-formats-ext`)",
                cfg.device,
                *got,
                *wanted,
                cfg.fps,
                cfg.device,
                extra=extra,
            )

    def read(self, out: np.ndarray | None) -> np.ndarray:
        self.grab()
        return self.retrieve(out)

    def grab(self) -> bool:
        """Dequeue the next frame from the driver without decoding it (raises ``SourceError`` when lost).

        OpenCV's V4L2 backend decodes MJPEG and converts YUYV in `retrieve`, so a frame the
        capture thread skips costs only the dequeue.
        """
        if not self._grab():
            raise SourceError(
                f"camera {self._cfg.device} stopped delivering frames (unplugged, or a USB "
                "problem? check `dmesg` and the cable)"
            )
        return True
