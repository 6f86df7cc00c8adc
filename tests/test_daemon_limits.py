"""The running daemon out of file descriptors (its ``RLIMIT_NOFILE`` lowered under it, as a unit's
``LimitNOFILE=`` or a leak elsewhere makes happen) or out of threads (a pids cgroup, as ``TasksMax=``),
pushed from every side a client comes in by: no server spins a core on a failed accept, each says it
once instead of a traceback per try, the camera is retried as a lost one, a reload is refused, and
everything is served again, the clients that waited included, once the limit is raised."""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq
from daemon import RunningDaemon, free_port, write_config, write_video
from filesystems import no_descriptor_left
from onnx_models import fixed_scene
from test_trigger import SCENE, images
from waiting import wait_for

from edged.errors import SourceError
from edged.messages import DetectionsMessage, StatusMessage
from edged.settings.sources import FileSourceConfig
from edged.sources.file import FileSource

pytestmark = pytest.mark.integration

ROOM = 10  # the descriptor limit while short: below every number the daemon holds, so that nothing new opens
SPIN_WINDOW_S = 1.5  # CPU time is measured over this; a server spinning on accept takes a whole core of it
MOST_CPU = 0.4  # of a core, over the window: the daemon with its camera lost and clients waiting is all but idle


# `edged` run with three descriptors to spare, once every library is loaded: room for the files it opens
# one at a time, not for the descriptors libzmq keeps, so that it runs out as it binds.
AT_THE_LIMIT = """
import os, resource, sys
import cv2, numpy, onnxruntime, zmq
import edged.check, edged.cli, edged.subscribe, edged.trigger, edged.unit
free = next(fd for fd in range(1 << 20) if not os.path.exists(f"/proc/self/fd/{fd}"))
resource.setrlimit(resource.RLIMIT_NOFILE, (free + 3, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
sys.exit(edged.cli.main(sys.argv[1:]))
"""


def cpu_s(pid: int) -> float:
    """User and system CPU time of the process so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_share(pid: int, seconds: float = SPIN_WINDOW_S) -> float:
    """The share of one core the process used over the next ``seconds`` (a measurement window)."""
    before = cpu_s(pid)
    wait_for(lambda: False, seconds)
    return (cpu_s(pid) - before) / seconds


@contextmanager
def short_of_descriptors(pid: int) -> Iterator[None]:
    """The process's soft descriptor limit at `ROOM` until the block ends, then back as it was."""
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (ROOM, hard))
    try:
        yield
    finally:
        if os.path.exists(f"/proc/{pid}"):
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))


def start(tmp_path: Path, **sections: dict[str, Any]) -> RunningDaemon:
    """An inspected image folder at 10 fps publishing on a free port, with ``sections`` added."""
    fixed_scene(tmp_path / "model.onnx", SCENE)
    folder = images(tmp_path / "frames", count=20)  # a pass of 20: the limit comes between two images, not two passes
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    doc: dict[str, Any] = {
        "source": {"type": "images", "path": str(folder), "fps": 10.0},
        "model": {"path": "model.onnx"},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.25},
        "thermal": {"enabled": False},
        "inspect": {"ng_classes": ["crack"]},
        **sections,
    }
    return RunningDaemon(write_config(tmp_path / "edged.toml", doc), endpoint)


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def answer(sock: socket.socket, size: int = 1) -> bytes:
    """What the daemon answers on ``sock``, at least ``size`` bytes of it, or all until it closes."""
    got = b""
    while len(got) < size:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def test_out_of_descriptors_no_server_spins_the_camera_is_retried_and_all_come_back(tmp_path: Path) -> None:
    http = free_port()
    d = start(tmp_path, http={"listen": f"127.0.0.1:{http}"})
    waiting: list[socket.socket] = []
    context = zmq.Context()
    late = context.socket(zmq.SUB)
    late.setsockopt(zmq.LINGER, 0)
    late.setsockopt(zmq.SUBSCRIBE, b"edged/detections/")
    try:
        assert wait_for(lambda: "live view, status page and metrics on" in d.log(), 30), d.log()
        d.collect("detections", 1)
        pid = d.proc.pid
        with short_of_descriptors(pid):
            lost = d.wait_status(lambda s: s.source_state == "lost")
            assert lost.capture is not None and "Too many open files" in str(lost.capture.last_error)
            for _ in range(3):  # viewers and scrapers keep coming: they wait in the listen backlog
                sock = socket.create_connection(("127.0.0.1", http), timeout=20)
                sock.sendall(b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                waiting.append(sock)
            assert cpu_share(pid) < MOST_CPU, "the live view's accept loop spins"
            assert wait_for(lambda: "http: cannot take a connection (Too many open files" in d.log(), 20), d.log()
            late.connect(d.endpoint)  # a subscriber: libzmq's own accept fails as fast as it can try
            assert wait_for(lambda: "new connections wait unaccepted: Too many open files" in d.log(), 20), d.log()
            assert cpu_share(pid) < MOST_CPU, "ZeroMQ's accept spins"
            assert d.proc.poll() is None
        for sock in waiting:  # each waiting client is served, in turn, once there is room again
            reply = answer(sock, 1 << 20)
            assert reply.startswith(b"HTTP/1.0 200") and reply.endswith(b"ok\n"), reply
        assert late.poll(20_000), d.log()  # the new subscriber gets frames captured since
        assert wait_for(lambda: "camera cam0: back after" in d.log(), 20), d.log()
        log = d.log()
        assert log.count("http: cannot take a connection") == 1 and "http: taking connections again" in log
        assert "Traceback" not in log and "capture thread failed" not in log
        assert "skipping unreadable image" not in log  # the process could not open them: no image is to blame
        status = d.wait_status(lambda s: s.source_state == "ok" and s.frames_processed > 0)
        assert status.drops.get("unreadable_image", 0) == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=20) as response:
            metrics = response.read().decode()
        failed = re.search(r'^edged_http_refused_total\{reason="out_of_resources"\} (\S+)$', metrics, re.MULTILINE)
        assert failed is not None and float(failed[1]) >= 1, metrics  # counted for an alert, not only said
        assert d.stop() == 0
    finally:
        for sock in waiting:
            sock.close()
        late.close(linger=0)
        context.term()
        d.close()


def modbus_request() -> bytes:
    """Read one holding register of unit 1: MBAP header (transaction 7) and PDU."""
    return struct.pack(">HHHBBHH", 7, 0, 6, 1, 3, 0, 1)


def opcua_hello(url: str) -> bytes:
    """OPC UA's HEL message, which a server answers with ACK before anything else."""
    body = struct.pack("<IIIII", 0, 65536, 65536, 0, 0) + struct.pack("<i", len(url)) + url.encode()
    return b"HELF" + struct.pack("<I", 8 + len(body)) + body


def test_out_of_descriptors_modbus_and_opc_ua_say_it_once_and_serve_who_waited(tmp_path: Path) -> None:
    pytest.importorskip("pymodbus")
    pytest.importorskip("asyncua")
    modbus, opcua = free_port(), free_port()
    url = f"opc.tcp://127.0.0.1:{opcua}"
    d = start(tmp_path, modbus={"listen": f"127.0.0.1:{modbus}"}, opcua={"listen": url})
    waiting: dict[str, socket.socket] = {}
    try:
        assert wait_for(lambda: "Modbus TCP on" in d.log() and "OPC UA: serving" in d.log(), 30), d.log()
        d.collect("verdict", 1)
        pid = d.proc.pid
        with short_of_descriptors(pid):
            for name, port in (("modbus", modbus), ("OPC UA", opcua)):
                waiting[name] = socket.create_connection(("127.0.0.1", port), timeout=20)
            waiting["modbus"].sendall(modbus_request())
            waiting["OPC UA"].sendall(opcua_hello(url))

            def failed(name: str, port: int) -> bool:  # said by edged, or by asyncio as it was
                log = d.log()
                return f"{name}: cannot take a connection" in log or f"laddr=('127.0.0.1', {port})" in log

            assert wait_for(lambda: failed("modbus", modbus) and failed("OPC UA", opcua), 20), d.log()[-3000:]
            assert cpu_share(pid, 2.5) < MOST_CPU  # asyncio tries again every second: two tries at least
            log = d.log()
            assert "socket.accept() out of system resource" not in log and "Traceback" not in log, log[-3000:]
            assert log.count("modbus: cannot take a connection (Too many open files") == 1
            assert log.count("OPC UA: cannot take a connection (Too many open files") == 1
        reply = answer(waiting["modbus"], 11)
        assert reply[:2] == b"\x00\x07" and reply[7] == 3, reply  # transaction 7, function 3 answered
        assert answer(waiting["OPC UA"], 8).startswith(b"ACKF")
        counted = d.wait_status(lambda s: s.modbus is not None and s.opcua is not None and s.modbus.accept_failed > 0)
        assert counted.opcua is not None and counted.opcua.accept_failed > 0  # in the status too, not only said
        assert d.stop() == 0
    finally:
        for sock in waiting.values():
            sock.close()
        d.close()


@contextmanager
def pids_cgroup() -> Iterator[Path]:
    """A cgroup of its own under a pids controller (v1, or v2 with pids delegated), removed at the end;
    the test is skipped where there is none this process may make (not root, no controller)."""
    candidates = [Path("/sys/fs/cgroup/pids")]
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "pids" in controllers.read_text().split():
            candidates.append(root)
    for root in candidates:
        if not (root / "cgroup.procs").exists():
            continue
        group = root / f"edged-test-tasks-{os.getpid()}"
        try:
            if (root / "cgroup.subtree_control").exists():
                (root / "cgroup.subtree_control").write_text("+pids")
            group.mkdir()
        except OSError:
            continue
        if not (group / "pids.max").exists():
            group.rmdir()
            continue
        try:
            yield group
        finally:
            wait_for(lambda g=group: not (g / "cgroup.procs").read_text().strip(), 10)
            group.rmdir()
        return
    pytest.skip("no pids cgroup can be made here (needs root and a pids controller, v1 or v2 delegated)")


def no_thread_more(group: Path, pid: int) -> None:
    """Process ``pid`` moved into the pids cgroup ``group``, which lets it start no thread more."""
    try:
        (group / "cgroup.procs").write_text(str(pid))
    except OSError as e:
        pytest.skip(f"the daemon cannot be moved into a pids cgroup here: {e}")
    (group / "pids.max").write_text(str(len(os.listdir(f"/proc/{pid}/task"))))


def test_out_of_threads_a_viewer_is_closed_a_reload_refused_and_both_work_once_there_is_room(tmp_path: Path) -> None:
    with pids_cgroup() as group:
        http = free_port()
        d = start(tmp_path, http={"listen": f"127.0.0.1:{http}"})
        try:
            assert wait_for(lambda: "live view, status page and metrics on" in d.log(), 30), d.log()
            d.collect("detections", 1)
            no_thread_more(group, d.proc.pid)
            for _ in range(3):
                with socket.create_connection(("127.0.0.1", http), timeout=20) as sock:
                    sock.sendall(b"GET /stream.mjpg HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                    assert answer(sock, 1 << 20) == b""  # closed: no thread to serve it
            d.signal(signal.SIGHUP)  # a reload loads on a thread of its own
            assert wait_for(lambda: "reload refused, keeping the running configuration" in d.log(), 20), d.log()
            assert d.proc.poll() is None
            since = d.wait_status(lambda s: True).time_ns
            fresh = d.wait_status(lambda s: s.time_ns > since and s.source_state == "ok")
            assert isinstance(fresh, StatusMessage)
            assert d.captured_after(fresh.time_ns, 1)  # frames flow on
            log = d.log()
            assert log.count("http: cannot take a connection (can't start new thread") == 1
            assert "Traceback" not in log, log
            (group / "pids.max").write_text("max")
            with socket.create_connection(("127.0.0.1", http), timeout=20) as sock:
                sock.sendall(b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                assert answer(sock, 1 << 20).endswith(b"ok\n")
            d.signal(signal.SIGHUP)
            assert wait_for(lambda: "reloaded: model" in d.log(), 30), d.log()
            assert isinstance(d.collect("detections", 1)[0], DetectionsMessage)
            assert d.stop() == 0
        finally:
            d.close()


def test_a_video_file_opened_without_a_descriptor_left_says_so_not_that_ffmpeg_cannot_decode_it(tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.avi", [(0, 0, 255)] * 4)
    source = FileSource(FileSourceConfig(path=video, loop=True, realtime=False))
    with no_descriptor_left(), pytest.raises(SourceError) as info:
        source.open()
    assert str(info.value) == f"cannot open video file {video}: Too many open files"
    source.open()  # once there is room, as a camera reconnecting opens it
    source.close()


def test_out_of_threads_the_thermal_watch_says_so_once_and_frames_flow(tmp_path: Path) -> None:
    """The board's thermal files are read on a thread of their own at every poll: with no thread to be
    had, the poll raised out of the loop and the daemon stopped."""
    board = Path(shutil.copytree(Path(__file__).parent / "fixtures" / "thermal" / "rpi4", tmp_path / "rpi4"))
    thermal = {"enabled": True, "root": str(board), "poll_interval_s": 0.2, "use_vcgencmd": False}
    with pids_cgroup() as group:
        d = start(tmp_path, thermal=thermal)
        try:
            d.wait_status(lambda s: s.thermal is not None and s.thermal.state == "ok")
            no_thread_more(group, d.proc.pid)
            said = "no thread to read the board's thermal files on"
            assert wait_for(lambda: said in d.log(), 20), d.log()
            since = d.wait_status(lambda s: True).time_ns
            assert d.captured_after(since, 3)  # frames flow on
            assert d.proc.poll() is None and d.log().count(said) == 1
            (group / "pids.max").write_text("max")
            later = d.wait_status(lambda s: True).time_ns
            d.wait_status(lambda s: s.time_ns > later and s.thermal is not None and s.thermal.state == "ok")
            assert "Traceback" not in d.log()
            assert d.stop() == 0
        finally:
            d.close()


def test_a_viewer_past_descriptor_1023_is_served(tmp_path: Path) -> None:
    """select() takes no descriptor past 1023, and the units let edged hold 16,384: a flood of ZeroMQ
    connections, then a live-view viewer, whose socket is numbered past it. Its stream failed with
    "filedescriptor out of range in select()" (as did an MQTT reconnect and a reject line so placed)."""
    http = free_port()
    # A frame every 1.25 s: a second with none, the viewer's socket is watched for its leaving.
    d = start(tmp_path, http={"listen": f"127.0.0.1:{http}"}, source={"type": "images", "path": "frames", "fps": 0.8})
    flood: list[socket.socket] = []
    try:
        assert wait_for(lambda: "live view, status page and metrics on" in d.log(), 30), d.log()
        d.collect("detections", 1)
        for _ in range(1100):  # each held by libzmq until its handshake times out (30 s)
            flood.append(socket.create_connection(("127.0.0.1", port_of(d.endpoint)), timeout=5))
        assert wait_for(lambda: len(os.listdir(f"/proc/{d.proc.pid}/fd")) > 1100, 20)
        with socket.create_connection(("127.0.0.1", http), timeout=20) as viewer:
            viewer.sendall(b"GET /stream.mjpg HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            got = b""
            while got.count(b"Content-Type: image/jpeg") < 2 and (chunk := viewer.recv(1 << 16)):
                got += chunk
        assert got.count(b"Content-Type: image/jpeg") >= 2, got[:300]  # the viewer watched between the two
        assert "out of range" not in d.log() and "Traceback" not in d.log(), d.log()[-3000:]
        assert d.stop() == 0
    finally:
        for s in flood:
            s.close()
        d.close()


def test_check_with_too_few_descriptors_says_so_without_a_traceback(tmp_path: Path) -> None:
    """A unit's LimitNOFILE= far too low: `edged check` printed a traceback (an OSError, or libzmq's
    ZMQError, which carries the same errno), or libzmq aborted it; it says what ran out and where to look,
    exit 1, as run does. The limit is set in the process once its libraries are loaded, whatever number
    of descriptors this machine's libraries hold."""
    d = start(tmp_path)  # writes the configuration; the check runs beside it, on another port
    d.close()
    config = tmp_path / "edged.toml"
    config.write_text(config.read_text().replace(d.endpoint, f"tcp://127.0.0.1:{free_port()}"))
    checked = subprocess.run(
        [sys.executable, "-c", AT_THE_LIMIT, "check", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "Traceback" not in checked.stderr, checked.stderr
    assert "edged: check failed: Too many open files: the process has no file descriptor left, LimitNOFILE= too low" in (
        checked.stderr
    )


@pytest.mark.parametrize("command", [["subscribe", "--count", "1"], ["trigger"]])
def test_a_client_tool_with_too_few_descriptors_says_so_and_is_not_aborted(command: list[str]) -> None:
    """libzmq aborted `edged subscribe` and `edged trigger` (exit 134, "Too many open files
    (src/epoll.cpp:38)") where it could not open a descriptor of its own: run under a low ``ulimit -n``."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-c", AT_THE_LIMIT, command[0], endpoint, *command[1:], "--timeout", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"edged: {command[0]} failed: Too many open files: the process has no file descriptor left" in done.stderr
