"""IP cameras over RTSP through OpenCV's FFmpeg backend, with bounded waits and credentials kept out of logs.

FFmpeg waits forever (OpenCV: 30 s) for a silent camera unless the open and read timeouts are
passed when the capture is opened, so both go in ``VideoCapture``'s parameters. The transport and
the discarding of corrupt packets are FFmpeg demuxer options, which OpenCV reads from
``OPENCV_FFMPEG_CAPTURE_OPTIONS`` only while opening: they are set for that call alone, on top of
any options the user set there. OpenCV opens one FFmpeg capture at a time in a process, so edged
connects to a camera first, outside OpenCV's open: one that is off or unreachable is found in at
most `PROBE_TIMEOUT_S`, and never holds up the other cameras' opening for its open_timeout_s. A
stall that FFmpeg's own timeout does not catch (old frames returned after a long wait) is the
capture thread's to see, from `RtspSource.timeouts`. A stream whose frames are larger than edged
takes (`frame_size_problem`: a misconfigured camera, or any server on the network) is refused once
opened, from the size FFmpeg found while opening it, before edged decodes a frame.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import cv2
import numpy as np

from edged.errors import SourceError, printable
from edged.settings.endpoints import address_of, host_port, look_up
from edged.settings.sources import DEFAULT_PORTS, RtspSourceConfig, mask_credentials
from edged.sources.base import OpenCvCapture, frame_size_problem

log = logging.getLogger(__name__)

FFMPEG_OPTIONS_ENV = "OPENCV_FFMPEG_CAPTURE_OPTIONS"
PROBE_TIMEOUT_S = 2.0  # the plain connect before an open, and the one that explains a failed open
STATUS_BYTES = 1024  # the most of a camera's answer the probe reads: its status line is in it

_UNDECODABLE = "the stream delivered data FFmpeg could not convert to an image; check the camera's codec settings"
_options_lock = threading.Lock()  # the environment is process-wide: one open at a time sets it


@contextmanager
def _ffmpeg_options(options: dict[str, str]) -> Iterator[None]:
    """``OPENCV_FFMPEG_CAPTURE_OPTIONS`` with ``options`` over the user's own, for one open, then as it was."""
    with _options_lock:
        before = os.environ.get(FFMPEG_OPTIONS_ENV)
        merged = dict(pair.split(";", 1) for pair in (before or "").split("|") if ";" in pair)
        merged.update(options)
        os.environ[FFMPEG_OPTIONS_ENV] = "|".join(f"{key};{value}" for key, value in merged.items())
        try:
            yield
        finally:
            if before is None:
                del os.environ[FFMPEG_OPTIONS_ENV]
            else:
                os.environ[FFMPEG_OPTIONS_ENV] = before


class RtspSource(OpenCvCapture):
    """``cv2.VideoCapture(url, cv2.CAP_FFMPEG, timeouts)``; every grab takes a frame off the stream, so it never lags."""

    def __init__(self, cfg: RtspSourceConfig) -> None:
        self._name = mask_credentials(cfg.url)
        super().__init__(cfg.channel_order, f"RTSP stream {self._name}", _UNDECODABLE)
        self._cfg = cfg
        self._reached: tuple[str, int] | None = None  # the address the last plain connect reached

    def timeouts(self) -> tuple[float, float]:
        return self._cfg.open_timeout_s, self._cfg.read_timeout_s

    def open(self) -> None:
        cfg = self._cfg
        params = [
            cv2.CAP_PROP_OPEN_TIMEOUT_MSEC,
            round(cfg.open_timeout_s * 1000),
            cv2.CAP_PROP_READ_TIMEOUT_MSEC,
            round(cfg.read_timeout_s * 1000),
        ]
        if (problem := self._connect_problem()) is not None:
            raise SourceError(f"cannot open RTSP stream {self._name}: {problem}")
        started = time.monotonic()
        with _ffmpeg_options({"rtsp_transport": cfg.transport, "fflags": "discardcorrupt"}):
            cap = cv2.VideoCapture(cfg.url, cv2.CAP_FFMPEG, params)
        if not cap.isOpened():
            cap.release()
            raise SourceError(f"cannot open RTSP stream {self._name}: {self._why_not_open(time.monotonic() - started)}")
        width, height = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if (problem := frame_size_problem(width, height)) is not None:
            cap.release()
            raise SourceError(f"RTSP stream {self._name} sends frames of {problem} (set the camera to a lower resolution)")
        self._cap = cap
        log.info(
            "RTSP stream %s over %s: %dx%d at %.1f fps",
            self._name,
            cfg.transport,
            width,
            height,
            float(cap.get(cv2.CAP_PROP_FPS)),
            extra={"CAMERA": cfg.camera_id},
        )

    def _address(self) -> tuple[str, int]:
        parts = urlsplit(self._cfg.url)
        return parts.hostname or "", parts.port or DEFAULT_PORTS[parts.scheme]

    def _connect_problem(self) -> str | None:
        """Why a plain TCP connect to the camera fails (a name that does not resolve, refused, no
        answer, unreachable), or None; within min(`PROBE_TIMEOUT_S`, open_timeout_s), the name's
        lookup included: a DNS server that does not answer makes the camera lost, and retried, in
        that time rather than the resolver's, however long."""
        host, port = self._address()
        where = host_port(host, port)
        wait_s = min(PROBE_TIMEOUT_S, self._cfg.open_timeout_s)
        deadline = time.monotonic() + wait_s
        # The lookup comes first: it has the whole wait, said as configured (not the 0.998 s left of
        # 1 s once this thread had waited for a core between the two lines).
        addresses = [host] if address_of(host) is not None else look_up(host, wait_s)
        if isinstance(addresses, str):
            return f"{addresses} (check the camera's host name in source.url, and the board's DNS)"
        problem = f"no answer from {where} (is the address right and the camera reachable from here?)"
        for address in addresses:
            try:
                with socket.create_connection((address, port), timeout=max(0.01, deadline - time.monotonic())):
                    self._reached = (address, port)
                    return None
            except ConnectionRefusedError:
                problem = f"connection to {where} refused (is the camera's RTSP server on that port?)"
            except TimeoutError:
                problem = f"no answer from {where} (is the address right and the camera reachable from here?)"
            except OSError as e:
                problem = f"cannot reach {where}: {e.strerror or e} (check the address and the network)"
            if time.monotonic() >= deadline:
                break
        return problem

    def _why_not_open(self, waited_s: float) -> str:
        """What a plain TCP connect to the camera says, since OpenCV's failed open says nothing."""
        if (problem := self._connect_problem()) is not None:
            return problem
        where = host_port(*self._address())
        if waited_s >= self._cfg.open_timeout_s:
            return (
                f"{where} accepts connections but sent no stream within open_timeout_s = "
                f"{self._cfg.open_timeout_s:g} (is it an RTSP server, and is the camera busy or booting?)"
            )
        parts = urlsplit(self._cfg.url)
        status = self._describe_status() if parts.scheme == "rtsp" else None
        path = printable(parts.path or "/")
        if status is not None and status.startswith("404"):
            return f"{where} has no stream at {path} ({status}: check the path in source.url)"
        if status is not None and status.startswith("401") and parts.username is None:
            return (
                f"{where} asks for a user and password ({status}) and source.url gives none: "
                f"write them in it, rtsp://USER:PASSWORD@{where}{path}"
            )
        if status is not None and status.startswith("401"):
            return (
                f"{where} asks for a user and password ({status}) and did not give the stream to those in "
                "source.url: check them, and the path"
            )
        answered = f"answered {status}" if status is not None and not status.startswith("200") else "answered"
        return (
            f"{where} {answered} but refused the stream (check the path and the credentials in source.url, "
            "e.g. with `ffprobe -rtsp_transport tcp URL`)"
        )

    def _describe_status(self) -> str | None:
        """The status (``404 Not Found``) the camera answers a DESCRIBE of the URL without its user and password,
        within `PROBE_TIMEOUT_S` in all and its first `STATUS_BYTES`; None when it gives none. FFmpeg, whose
        open failed, says nothing of why: this tells a wrong path from missing or wrong credentials. The
        answer is read until its first line ends: a camera may send it in pieces."""
        if self._reached is None:
            return None
        url = urlsplit(self._cfg.url)._replace(netloc=host_port(*self._address()), fragment="").geturl()
        request = f"DESCRIBE {url} RTSP/1.0\r\nCSeq: 1\r\nAccept: application/sdp\r\n\r\n"
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        answer, ended = b"", False
        try:
            with socket.create_connection(self._reached, timeout=PROBE_TIMEOUT_S) as connection:
                connection.settimeout(max(0.01, deadline - time.monotonic()))
                connection.sendall(request.encode("ascii", "replace"))
                while b"\n" not in answer and len(answer) < STATUS_BYTES and (left := deadline - time.monotonic()) > 0:
                    connection.settimeout(left)
                    chunk = connection.recv(STATUS_BYTES - len(answer))
                    answer, ended = answer + chunk, not chunk
                    if ended:
                        break
        except OSError:
            pass  # a reset or the bound: a line not ended is none (``RTSP/1.0 40`` is no status)
        if b"\n" not in answer and not ended:
            return None
        first = answer.split(b"\n", 1)[0].decode("ascii", "replace").split(" ", 2)
        if len(first) < 2 or not first[0].startswith("RTSP/") or not first[1].isdigit():
            return None
        return printable(" ".join(first[1:]).strip())[:60]

    def read(self, out: np.ndarray | None) -> np.ndarray:
        self.grab()
        return self.retrieve(out)

    def grab(self) -> bool:
        """Take the next packet's frame off the stream (FFmpeg decodes it; `retrieve` only converts it)."""
        if not self._grab():
            raise SourceError(
                f"RTSP stream {self._name} delivered no frame within read_timeout_s = {self._cfg.read_timeout_s:g} "
                "or ended (camera rebooted, network down, or the server closed the session)"
            )
        return True
