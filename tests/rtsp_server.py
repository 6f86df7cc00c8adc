"""A real RTSP server for the tests: GStreamer's GstRtspServer streaming a solid-colour MJPEG test pattern.

Run as a script by Debian's own Python (``python3-gi`` and ``gir1.2-gst-rtsp-server-1.0``, installed by
``scripts/setup test``), on a free loopback port; `RtspServer` starts it, freezes it with SIGSTOP (a
camera that stops sending but keeps its connection), thaws it with SIGCONT, and restarts it on the
same port; with ``credentials`` it asks for them (Basic). MJPEG needs only GStreamer's base and good
plugins, and FFmpeg decodes it with no codec extras. RTP/JPEG carries at most 2040 pixels a side, so a
larger stream is an MPEG-4 video file (`write_mpeg4`), served as it is, each client from its start.
"""

from __future__ import annotations

import select
import signal
import subprocess
import sys
from pathlib import Path

SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's, which sees python3-gi
MOUNT = "/cam"
WIDTH, HEIGHT, FPS = 160, 120, 15


def launch_line(pattern: str) -> str:
    """The server's media: a live ``videotestsrc`` of ``pattern`` as RTP/JPEG (payloader ``pay0``),
    or, for a ``pattern`` that is an .mp4 file's path, that file's MPEG-4 video as it is."""
    if pattern.endswith(".mp4"):
        return f"( filesrc location={pattern} ! qtdemux ! mpeg4videoparse ! rtpmp4vpay name=pay0 pt=96 config-interval=1 )"
    return (
        f"( videotestsrc is-live=true pattern={pattern} ! video/x-raw,format=I420,width={WIDTH},height={HEIGHT},"
        f"framerate={FPS}/1 ! jpegenc quality=90 ! rtpjpegpay name=pay0 pt=26 )"
    )


def write_mpeg4(path: Path, width: int, height: int, frames: int, fps: float = 5.0) -> Path:
    """An MPEG-4 video (OpenCV's FFmpeg, fourcc mp4v) of ``frames`` black frames, for `RtspServer`; up to
    8191 pixels a side."""
    import cv2  # here: the server itself runs under Debian's Python, which need not have them
    import numpy as np

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"mp4v"), fps, (width, height))
    assert writer.isOpened(), f"this OpenCV cannot write a {width}x{height} MPEG-4 video"
    frame = np.zeros((height, width, 3), np.uint8)
    for _ in range(frames):
        writer.write(frame)
    writer.release()
    return path


class RtspServer:
    """The server as a subprocess on ``port``, serving ``launch_line(pattern)`` at `MOUNT`; stopped by `close`."""

    def __init__(self, port: int, pattern: str | Path = "red", credentials: str = "") -> None:
        self.port = port
        self.pattern = str(pattern)
        self.credentials = credentials  # "user:password" the server asks for (Basic), or none
        self.proc: subprocess.Popen[str] | None = None
        self.start()

    def url(self, credentials: str = "") -> str:
        at = f"{credentials}@" if credentials else ""
        return f"rtsp://{at}127.0.0.1:{self.port}{MOUNT}"

    def start(self, timeout_s: float = 20.0) -> None:
        """Start the server and return once it listens (it prints ``ready``)."""
        self.proc = subprocess.Popen(
            [SYSTEM_PYTHON, str(Path(__file__)), str(self.port), self.pattern, self.credentials],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            self.close()
            raise AssertionError(f"RTSP server did not start in {timeout_s} s: {line!r}")

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.close()
        self.start()

    def close(self) -> None:
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None


def _serve(port: int, pattern: str, credentials: str) -> None:
    import gi

    gi.require_version("Gst", "1.0")
    gi.require_version("GstRtspServer", "1.0")
    from gi.repository import GLib, Gst, GstRtspServer

    Gst.init(None)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(port))
    factory = GstRtspServer.RTSPMediaFactory()
    factory.set_launch(launch_line(pattern))
    factory.set_shared(not pattern.endswith(".mp4"))  # a file plays to its end: each client from its start
    if credentials:
        user, password = credentials.split(":", 1)
        token = GstRtspServer.RTSPToken()
        token.set_string("media.factory.role", "viewer")
        auth = GstRtspServer.RTSPAuth()
        auth.add_basic(GstRtspServer.RTSPAuth.make_basic(user, password), token)
        server.set_auth(auth)
        role = "viewer, media.factory.access=(boolean)true, media.factory.construct=(boolean)true"
        factory.add_role_from_structure(Gst.Structure.new_from_string(role))
    server.get_mount_points().add_factory(MOUNT, factory)
    if server.attach(None) == 0:
        sys.exit(f"cannot listen on port {port}")
    print("ready", flush=True)
    GLib.MainLoop().run()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")
