"""RTSP cameras end to end: a real GstRtspServer on loopback, the real daemon, its real ZeroMQ stream.

The server (tests/rtsp_server.py) streams solid red MJPEG at 15 fps; the colour probe model calls
a red frame "red", so a detection proves frames went from the server through FFmpeg, the capture
thread and the model in the right colour order. Freezing the server with SIGSTOP is a camera that
keeps its connection open and sends nothing, the case OpenCV's own read does not notice in time.
"""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon import MEMORY_LIMIT_ENV, RunningDaemon, free_port, limit_memory, peak_rss_kb, run_cli, write_config
from onnx_models import LABELS, colour_probe
from rtsp_server import FPS, HEIGHT, WIDTH, RtspServer, write_mpeg4
from waiting import wait_for

from edged.errors import SourceError
from edged.messages import DetectionsMessage
from edged.settings.sources import RtspSourceConfig
from edged.sources.rtsp import PROBE_TIMEOUT_S, RtspSource

pytestmark = pytest.mark.integration

SECRET = "s3cret-pw"
READ_TIMEOUT_S = 1.0
MARGIN_S = 4.0  # a busy 2-core machine: FFmpeg's timeout, the next status message, scheduling


@pytest.fixture
def server() -> Iterator[RtspServer]:
    srv = RtspServer(free_port())
    yield srv
    srv.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections and never answers: a camera whose RTSP server hangs."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield int(listener.getsockname()[1])


def start(tmp_path: Path, url: str, **keys: Any) -> RunningDaemon:
    return start_cameras(
        tmp_path, {"type": "rtsp", "url": url, "open_timeout_s": 5.0, "read_timeout_s": READ_TIMEOUT_S, **keys}
    )


def start_cameras(
    tmp_path: Path, source: dict[str, Any] | list[dict[str, Any]], env: dict[str, str] | None = None
) -> RunningDaemon:
    """`edged run` of the colour probe on ``source``: one camera's table, or a list of them."""
    colour_probe(tmp_path / "probe.onnx")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": source,
            "model": {"path": "probe.onnx"},
            "publish": {"endpoints": [endpoint], "status_interval_s": 0.25},
            "thermal": {"enabled": False},
        },
    )
    return RunningDaemon(config, endpoint, env)


@pytest.fixture
def daemons() -> Iterator[list[RunningDaemon]]:
    started: list[RunningDaemon] = []
    yield started
    for d in started:
        d.close()


def terminate(daemon: RunningDaemon) -> int:
    daemon.signal(signal.SIGTERM)
    return daemon.proc.wait(timeout=10)


def detections(daemon: RunningDaemon, count: int, timeout: float = 30) -> list[DetectionsMessage]:
    msgs = [m for m in daemon.collect("detections", count, timeout) if isinstance(m, DetectionsMessage)]
    assert len(msgs) == count
    return msgs


def test_frames_from_a_real_rtsp_server_become_detections_and_credentials_never_show(
    tmp_path: Path, server: RtspServer, daemons: list[RunningDaemon]
) -> None:
    daemon = start(tmp_path, server.url(f"viewer:{SECRET}"))
    daemons.append(daemon)
    msgs = detections(daemon, 5)
    for msg in msgs:
        assert msg.frame_size == (WIDTH, HEIGHT)
        assert [d.label for d in msg.detections] == [LABELS[0]]  # red, so BGR frames reached an RGB model right
    status = daemon.wait_status(lambda s: s.source_state == "ok")
    assert terminate(daemon) == 0
    assert SECRET not in daemon.log() and "viewer" not in daemon.log()
    assert f"127.0.0.1:{server.port}/cam" in daemon.log()  # the stream is still named, masked
    assert SECRET not in status.model_dump_json()


def test_the_stream_read_through_a_gstreamer_rtspsrc_pipeline_becomes_detections(
    tmp_path: Path, server: RtspServer, daemons: list[RunningDaemon]
) -> None:
    """The way docs/cameras.md gives for a board of several RTSP cameras, whose opens through
    OpenCV's FFmpeg wait for one another: the same stream through GStreamer's rtspsrc."""
    pipeline = f"rtspsrc location={server.url()} protocols=tcp latency=0 ! decodebin"
    daemon = start_cameras(tmp_path, {"type": "gstreamer", "pipeline": pipeline})
    daemons.append(daemon)
    for msg in detections(daemon, 3):
        assert msg.frame_size == (WIDTH, HEIGHT)
        assert [d.label for d in msg.detections] == [LABELS[0]]
    assert terminate(daemon) == 0


def _connecting_to(port: int) -> bool:
    """Whether a socket on this machine is sending its SYN to loopback ``port``, unanswered."""
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return any(f[2] == f"0100007F:{port:04X}" and f[3] == "02" for f in (line.split() for line in lines))


def test_a_camera_that_takes_no_connection_holds_up_no_other_cameras_opening(
    tmp_path: Path, server: RtspServer, daemons: list[RunningDaemon]
) -> None:
    """OpenCV opens one FFmpeg capture at a time, and a camera that is off leaves FFmpeg's connect
    unanswered for the whole open_timeout_s: every other RTSP camera's opening waited behind it, at
    each of its retries. The camera is now connected to first, outside that wait. Here the dead
    camera is a port whose queue is full, which drops the connect as a camera that is off does;
    the live camera's server starts only once the dead one is connecting."""
    server.close()
    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        dead.listen(0)
        dead_port = int(dead.getsockname()[1])
        with socket.create_connection(("127.0.0.1", dead_port)):  # fills the queue: the next connect hangs
            cameras = [
                {"type": "rtsp", "camera_id": "dead", "url": f"rtsp://127.0.0.1:{dead_port}/cam", "open_timeout_s": 60.0},
                {"type": "rtsp", "camera_id": "live", "url": server.url(), "open_timeout_s": 5.0},
            ]
            daemon = start_cameras(tmp_path, cameras)
            daemons.append(daemon)
            assert wait_for(lambda: _connecting_to(dead_port), 30), daemon.log()
            server.start()
            frames = (m for m in daemon.messages(30) if isinstance(m, DetectionsMessage) and m.camera_id == "live")
            assert next(frames, None), f"no frame of the live camera in 30 s, within the dead one's open:\n{daemon.log()}"
            assert wait_for(lambda: f"no answer from 127.0.0.1:{dead_port}" in daemon.log(), 30), daemon.log()


def test_a_frozen_server_is_lost_within_the_read_timeout_and_frames_continue_after_it_thaws_or_restarts(
    tmp_path: Path, server: RtspServer, daemons: list[RunningDaemon]
) -> None:
    daemon = start(tmp_path, server.url())
    daemons.append(daemon)
    last_id = detections(daemon, 3)[-1].frame_id

    server.freeze()
    frozen = time.monotonic()
    lost = daemon.wait_status(lambda s: s.source_state == "lost", timeout=READ_TIMEOUT_S + MARGIN_S)
    assert time.monotonic() - frozen < READ_TIMEOUT_S + MARGIN_S
    assert lost.capture is not None and lost.capture.last_error

    server.thaw()
    back = daemon.wait_status(lambda s: s.source_state == "ok" and s.capture is not None and s.capture.reconnects >= 1)
    assert back.capture is not None
    after_thaw = detections(daemon, 2)[-1].frame_id
    assert after_thaw > last_id  # ids continue across the reconnect

    server.restart()
    reconnects = back.capture.reconnects
    daemon.wait_status(lambda s: s.capture is not None and s.capture.reconnects > reconnects and s.source_state == "ok")
    assert detections(daemon, 2)[-1].frame_id > after_thaw
    assert "lost" in daemon.log() and "back after" in daemon.log()


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("wrong path", "has no stream at /nothing-here (404 Not Found: check the path in source.url)"),
        ("closed port", "refused (is the camera's RTSP server on that port?)"),
        ("silent port", "accepts connections but sent no stream within open_timeout_s = 1"),
    ],
)
def test_a_camera_that_cannot_be_opened_is_logged_with_its_reason_and_retried(
    tmp_path: Path, server: RtspServer, silent_port: int, daemons: list[RunningDaemon], fault: str, reason: str
) -> None:
    url = {
        "wrong path": f"rtsp://127.0.0.1:{server.port}/nothing-here",
        "closed port": f"rtsp://127.0.0.1:{free_port()}/cam",
        "silent port": f"rtsp://127.0.0.1:{silent_port}/cam",
    }[fault]
    daemon = start(tmp_path, url, open_timeout_s=1.0)
    daemons.append(daemon)
    status = daemon.wait_status(lambda s: s.capture is not None and s.capture.reconnects >= 2, timeout=30)
    assert status.source_state == "lost" and status.capture is not None
    assert reason in (status.capture.last_error or "")
    assert reason in daemon.log()
    assert terminate(daemon) == 0


def test_a_camera_that_asks_for_credentials_says_so_when_the_url_has_none_or_others() -> None:
    """FFmpeg's failed open says nothing; both were "answered but refused the stream (check the path and the credentials"."""
    server = RtspServer(free_port(), credentials=f"viewer:{SECRET}")
    try:
        for url, reason in [
            (server.url(), "asks for a user and password (401 Unauthorized) and source.url gives none: write them in it"),
            (server.url("viewer:wrong"), "asks for a user and password (401 Unauthorized) and did not give the stream"),
        ]:
            source = RtspSource(RtspSourceConfig(type="rtsp", url=url, open_timeout_s=5.0))
            with pytest.raises(SourceError, match=re.escape(reason)):
                source.open()
        source = RtspSource(RtspSourceConfig(type="rtsp", url=server.url(f"viewer:{SECRET}"), open_timeout_s=5.0))
        source.open()  # the right ones open it
        source.close()
    finally:
        server.close()


def test_a_stream_of_frames_over_the_limit_is_refused_before_one_is_decoded_and_retried(
    tmp_path: Path, daemons: list[RunningDaemon]
) -> None:
    """A camera set to a resolution past 8K, or any server on the network, decides the frame size: before,
    each 8000x4200 frame (100 MB as BGR; any size up to FFmpeg's 268 million pixels) was decoded and
    planned for. Under 1 GiB of address space, where the old code's allocations failed."""
    server = RtspServer(free_port(), write_mpeg4(tmp_path / "over.mp4", 8000, 4200, frames=10))
    try:
        daemon = start_cameras(
            tmp_path,
            {"type": "rtsp", "url": server.url(f"viewer:{SECRET}"), "open_timeout_s": 10.0, "read_timeout_s": 2.0},
            MEMORY_LIMIT_ENV,
        )
        daemons.append(daemon)
        limit_memory(daemon.proc.pid, 1 << 30)
        over = "frames of 8000x4200 pixels, over the 33177600 pixels (7680x4320) edged takes (set the camera to a lower"
        status = daemon.wait_status(lambda s: bool(s.capture and s.capture.reconnects and over in f"{s.capture.last_error}"))
        assert status.source_state == "lost" and status.frames_processed == 0
        peak_kb = peak_rss_kb(daemon.proc.pid)
        assert terminate(daemon) == 0
    finally:
        server.close()
    assert peak_kb < 250_000, peak_kb  # the old code, 690 MB
    logged = daemon.log()
    assert f"unavailable: RTSP stream rtsp://***@127.0.0.1:{server.port}/cam sends {over}" in logged, logged
    assert SECRET not in logged and "Traceback" not in logged


def test_sigterm_stops_the_daemon_within_two_seconds_while_a_connect_is_pending(
    tmp_path: Path, daemons: list[RunningDaemon]
) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(30)
        daemon = start(tmp_path, f"rtsp://127.0.0.1:{listener.getsockname()[1]}/cam", open_timeout_s=60.0)
        daemons.append(daemon)
        conn, _ = listener.accept()  # edged is connected and waits for an RTSP answer that never comes
        with conn:
            daemon.wait_status(lambda s: s.source_state == "starting")
            sent = time.monotonic()
            daemon.signal(signal.SIGTERM)
            assert daemon.proc.wait(timeout=10) == 0
            assert time.monotonic() - sent < 2.0


def test_check_opens_the_stream_and_reports_what_it_delivers(tmp_path: Path, server: RtspServer) -> None:
    colour_probe(tmp_path / "probe.onnx")
    source = {"type": "rtsp", "url": server.url(f"viewer:{SECRET}")}
    config = write_config(
        tmp_path / "edged.toml",
        {"source": source, "model": {"path": "probe.onnx"}, "publish": {"endpoints": ["tcp://127.0.0.1:0"]}},
    )
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert f"source     rtsp url=rtsp://***@127.0.0.1:{server.port}/cam transport=tcp" in result.stdout
    line = next(line for line in result.stdout.splitlines() if "delivers" in line)
    assert line.startswith(f"           delivers {WIDTH}x{HEIGHT} at ") and line.endswith(
        " fps (measured), channel order bgr (declared: source.channel_order)"
    )
    assert float(line.split(" at ")[1].split()[0]) == pytest.approx(FPS, rel=0.35)
    assert SECRET not in result.stdout + result.stderr


def test_check_names_an_unreachable_stream_and_fails(tmp_path: Path) -> None:
    colour_probe(tmp_path / "probe.onnx")
    source = {"type": "rtsp", "url": f"rtsp://viewer:{SECRET}@127.0.0.1:{free_port()}/cam", "open_timeout_s": 2.0}
    config = write_config(
        tmp_path / "edged.toml",
        {"source": source, "model": {"path": "probe.onnx"}, "publish": {"endpoints": ["tcp://127.0.0.1:0"]}},
    )
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 1
    assert "gave no frame: cannot open RTSP stream rtsp://***@127.0.0.1:" in result.stderr
    assert SECRET not in result.stdout + result.stderr


def _hostile_camera(
    listener: socket.socket, answer: bytes, pause_s: float, stop: threading.Event, asked: list[bytes]
) -> None:
    """Answer every connection's first bytes (kept in ``asked``) with ``answer`` one byte at a time,
    ``pause_s`` apart, then bytes without end: a broken camera, or any server on the network."""
    while not stop.is_set():
        try:
            connection, _ = listener.accept()
        except OSError:
            return
        with connection:
            try:
                asked.append(connection.recv(4096))
                for byte in answer:
                    connection.sendall(bytes([byte]))
                    time.sleep(pause_s)
                while not stop.is_set():
                    connection.sendall(b"x" * 4096)
            except OSError:
                continue


def test_the_describe_probe_reads_a_dripped_answer_and_is_bounded_in_time_and_bytes() -> None:
    """A status dripped a byte at a time was read as no status (its first byte alone), and each wait
    (connect, send, read) had PROBE_TIMEOUT_S of its own."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        stop, asked = threading.Event(), []
        answer = b"RTSP/1.0 404 Not Found\r\n"
        threading.Thread(target=_hostile_camera, args=(listener, answer, 0.01, stop, asked), daemon=True).start()
        url = f"rtsp://viewer:{SECRET}@127.0.0.1:{listener.getsockname()[1]}/cam"
        source = RtspSource(RtspSourceConfig(type="rtsp", url=url, open_timeout_s=5.0))
        try:
            assert "has no stream at /cam (404 Not Found: check the path" in source._why_not_open(0.0)
            assert any(b"DESCRIBE rtsp://127.0.0.1:" in a for a in asked), asked
            assert not any(SECRET.encode() in a or b"viewer" in a for a in asked), asked  # never the credentials
        finally:
            stop.set()
    with socket.socket() as listener:  # dripped without end, never a whole line: no status, within the bound
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        stop = threading.Event()
        answer = b"RTSP/1.0 40" + b"4" * 200
        threading.Thread(target=_hostile_camera, args=(listener, answer, 0.02, stop, []), daemon=True).start()
        url = f"rtsp://127.0.0.1:{listener.getsockname()[1]}/cam"
        source = RtspSource(RtspSourceConfig(type="rtsp", url=url, open_timeout_s=5.0))
        try:
            started = time.monotonic()
            said = source._why_not_open(0.0)
            assert time.monotonic() - started < 2 * PROBE_TIMEOUT_S + 1.0  # the connect's look, then the probe's
            assert "answered but refused the stream" in said, said
        finally:
            stop.set()
