"""The Modbus TCP output on the running daemon, served to real Modbus clients (pymodbus' client, raw
sockets, Debian's ``mbpoll``) on a free loopback port."""

from __future__ import annotations

import shutil
import signal
import socket
import struct
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from daemon import RunningDaemon, free_port, rss_kb, run_cli, write_config
from onnx_models import fixed_scene
from pymodbus.client import ModbusTcpClient
from pymodbus.pdu import ExceptionResponse
from test_trigger import SCENE, images, ready, running
from waiting import wait_for

from edged.messages import StatusMessage, VerdictMessage
from edged.modbus import BLOCK

pytestmark = pytest.mark.integration

UNIT = 7


def words32(high: int, low: int) -> int:
    return (high << 16) | low


@contextmanager
def client(port: int) -> Iterator[ModbusTcpClient]:
    c = ModbusTcpClient("127.0.0.1", port=port, timeout=10, retries=0)
    assert c.connect()
    try:
        yield c
    finally:
        c.close()


def block(c: ModbusTcpClient, count: int = BLOCK, address: int = 0) -> list[int]:
    reply = c.read_holding_registers(address, count=count, device_id=UNIT)
    assert not reply.isError(), reply
    return list(reply.registers)


@contextmanager
def free_running(tmp_path: Path, http: dict[str, Any] | None = None, **modbus: Any) -> Iterator[tuple[RunningDaemon, int]]:
    """A free-running inspected camera at 30 fps with ``[modbus]`` on a free port; every frame NG (crack)."""
    fixed_scene(tmp_path / "model.onnx", SCENE)
    folder = images(tmp_path / "frames")
    endpoint, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    doc: dict[str, Any] = {
        "source": {"type": "images", "path": str(folder), "fps": 30.0},
        "model": {"path": "model.onnx"},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.25},
        "thermal": {"enabled": False},
        "inspect": {"ng_classes": ["crack"]},
        "modbus": {"listen": f"127.0.0.1:{port}", "unit_id": UNIT, **modbus},
        "http": http or {"listen": ""},
    }
    d = RunningDaemon(write_config(tmp_path / "edged.toml", doc), endpoint)
    try:
        assert wait_for(lambda: "Modbus TCP on" in d.log(), 30), d.log()
        yield d, port
    finally:
        d.close()


def modbus_status(d: RunningDaemon, condition: Any = lambda m: True) -> StatusMessage:
    return d.wait_status(lambda s: s.modbus is not None and condition(s.modbus), timeout=30)


def test_reads_during_a_flood_of_verdicts_are_whole_and_match_the_stream(tmp_path: Path) -> None:
    with free_running(tmp_path) as (d, port), client(port) as c:
        streamed = {m.seq: m for m in d.collect("verdict", 5) if isinstance(m, VerdictMessage)}
        torn, seen = 0, set()
        deadline = time.monotonic() + 60
        while len(seen) < 30 and time.monotonic() < deadline:
            words = block(c, 12)
            seq, ok, ng = words32(*words[3:5]), words32(*words[5:7]), words32(*words[7:9])
            if ok + ng == 0:
                continue
            torn += seq != ok + ng - 1  # the sequence number and the counts of one verdict, never of two
            assert words[2] == 2 and ng == ok + ng and words[9] == 1  # NG, for a crack: class 1
            seen.add(seq)
        assert torn == 0 and len(seen) >= 30
        for m in d.messages(5):  # the stream's verdicts of those sequence numbers are the registers'
            if isinstance(m, VerdictMessage):
                streamed[m.seq] = m
        assert any(seq in streamed and streamed[seq].verdict == "ng" for seq in seen)
        status = modbus_status(d, lambda m: m.requests >= 30)
        assert status.modbus is not None and status.modbus.clients == 1
        words = block(c, 12)
        assert words[1] == 1 and 0 < words[11] <= 400 and words[10] > 0  # running; fps x 10; 0.1 ms


def test_status_metrics_and_the_live_view_show_the_clients_and_requests_served(tmp_path: Path) -> None:
    http = free_port()
    with free_running(tmp_path, {"listen": f"127.0.0.1:{http}"}) as (d, port), client(port) as c:
        block(c)
        c.read_holding_registers(0, count=1, device_id=UNIT + 1)
        status = modbus_status(d, lambda m: m.clients == 1 and m.requests >= 2)
        assert status.modbus is not None and status.modbus.exceptions == 1
        metrics = ""

        def scraped() -> bool:
            nonlocal metrics
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10).read().decode()
            return "edged_modbus_requests_total" in metrics and metric(metrics, "edged_modbus_requests_total") >= 2

        assert wait_for(scraped, 30), metrics
        assert metric(metrics, "edged_modbus_clients") == 1 and metric(metrics, "edged_modbus_exceptions_total") == 1
        assert metric(metrics, "edged_modbus_accept_failed_total") == 0
        page = urllib.request.urlopen(f"http://127.0.0.1:{http}/", timeout=10).read().decode()
        assert 'id="modbus"' in page and "m.clients" in page
        started = time.monotonic()
        assert d.stop(timeout=10) == 0  # a client still connected: closed within the server's bound
        assert time.monotonic() - started < 5


def metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_the_heartbeat_counts_seconds_while_the_loop_turns(tmp_path: Path) -> None:
    with free_running(tmp_path) as (_d, port), client(port) as c:
        first = block(c, 1)[0]
        assert wait_for(lambda: block(c, 1)[0] >= first + 2, 30)


def test_a_reload_that_moves_the_blocks_serves_them_at_their_new_address(tmp_path: Path) -> None:
    with free_running(tmp_path) as (d, port):
        with client(port) as c:
            assert wait_for(lambda: block(c)[2] == 2, 15)
            before = words32(*block(c)[3:5])
        config = tmp_path / "edged.toml"
        config.write_text(config.read_text().replace(f"unit_id = {UNIT}", f"unit_id = {UNIT}\nbase = 100"))
        d.signal(signal.SIGHUP)
        assert wait_for(lambda: "registers from 100" in d.log(), 30), d.log()
        with client(port) as c:
            assert wait_for(lambda: words32(*block(c, address=100)[3:5]) > before, 15)
            words = block(c, address=100)  # the counts go on since start, as the sequence numbers do
            assert words32(*words[3:5]) == words32(*words[5:7]) + words32(*words[7:9]) - 1 > 0
            reply = c.read_holding_registers(0, count=1, device_id=UNIT)
            assert isinstance(reply, ExceptionResponse) and reply.exception_code == 2


def test_a_coil_write_inspects_a_frame_captured_after_it_and_clears_the_coil(tmp_path: Path) -> None:
    port = free_port()
    with running(tmp_path, modbus={"listen": f"127.0.0.1:{port}", "unit_id": UNIT}) as d:
        ready(d, frames=3)
        assert wait_for(lambda: "Modbus TCP on" in d.log(), 30), d.log()
        with client(port) as c:
            requested(d, c)


def requested(d: RunningDaemon, c: ModbusTcpClient) -> None:
    """Two requests through the coil, each with its part id, each answered with a verdict published on ZeroMQ."""
    for part in (1234, 70000):
        assert not c.write_registers(12, [part >> 16, part & 0xFFFF], device_id=UNIT).isError()
        written_ns = time.time_ns()
        assert not c.write_coil(0, True, device_id=UNIT).isError()
        assert wait_for(lambda: not c.read_coils(0, count=1, device_id=UNIT).bits[0], 15)
        words = block(c)
        seq = words32(*words[3:5])
        verdict = next(
            m for m in d.messages(15) if isinstance(m, VerdictMessage) and m.seq == seq
        )  # the verdict of the registers, as published on ZeroMQ
        assert verdict.part_id == str(part) and verdict.capture_time_ns > written_ns
        assert words[2] == 2 and words[14] == 0
    assert modbus_status(d, lambda m: m.triggers == 2)


def test_a_request_without_a_frame_in_time_clears_the_coil_and_says_timeout(tmp_path: Path) -> None:
    # One image every 20 s: after the first, no frame comes within the request's second.
    port = free_port()
    modbus = {"listen": f"127.0.0.1:{port}", "unit_id": UNIT}
    with running(tmp_path, fps=0.05, trigger={"timeout_s": 1.0}, modbus=modbus) as d:
        ready(d)
        assert wait_for(lambda: "Modbus TCP on" in d.log(), 30), d.log()
        with client(port) as c:
            assert not c.write_coil(0, True, device_id=UNIT).isError()
            assert wait_for(lambda: not c.read_coils(0, count=1, device_id=UNIT).bits[0], 15)
            words = block(c)
            assert words[14] == 3 and words[2] == 0  # timeout; no verdict


def test_each_camera_has_its_block_and_coil_at_base_plus_16_times_its_index(tmp_path: Path) -> None:
    port = free_port()
    folder = images(tmp_path / "frames")
    cameras = [
        {"type": "images", "path": str(folder), "fps": 30.0, "camera_id": "front", "trigger": "free"},
        {"type": "images", "path": str(folder), "fps": 2.0, "camera_id": "back"},
    ]
    modbus = {"listen": f"127.0.0.1:{port}", "unit_id": UNIT, "base": 40}
    with running(tmp_path, source=cameras, modbus=modbus) as d:  # type: ignore[arg-type]
        assert wait_for(lambda: "Modbus TCP on" in d.log(), 30), d.log()
        with client(port) as c:
            # front: free-running and not inspected: running, its rate shown, no verdict ever
            assert wait_for(lambda: block(c, address=40)[1] == 1 and block(c, address=40)[11] > 0, 30)
            assert block(c, address=40)[2] == 0
            reply = c.write_coil(40, True, device_id=UNIT)
            assert isinstance(reply, ExceptionResponse) and reply.exception_code == 2
            assert block(c, address=56)[2] == 0  # back: in request mode, no verdict yet
            assert not c.write_registers(56 + 12, [0, 7], device_id=UNIT).isError()
            assert not c.write_coil(56, True, device_id=UNIT).isError()
            assert wait_for(lambda: not c.read_coils(56, count=1, device_id=UNIT).bits[0], 15)
            back = block(c, address=56)
            verdict = next(m for m in d.messages(15) if isinstance(m, VerdictMessage) and m.camera_id == "back")
            assert verdict.part_id == "7" and words32(*back[3:5]) == verdict.seq and back[2] == 2 and back[14] == 0


def test_a_coil_of_a_free_running_camera_or_between_cameras_is_an_illegal_address(tmp_path: Path) -> None:
    with free_running(tmp_path) as (_d, port), client(port) as c:
        for address in (0, 1):
            reply = c.write_coil(address, True, device_id=UNIT)
            assert isinstance(reply, ExceptionResponse) and reply.exception_code == 2
        reply = c.write_registers(3, [1, 2], device_id=UNIT)
        assert isinstance(reply, ExceptionResponse) and reply.exception_code == 2
        reply = c.read_holding_registers(0, count=17, device_id=UNIT)
        assert isinstance(reply, ExceptionResponse) and reply.exception_code == 2
        reply = c.read_holding_registers(0, count=1, device_id=UNIT + 1)
        assert isinstance(reply, ExceptionResponse) and reply.exception_code == 0x0B


def mbap(transaction: int, pdu: bytes, unit: int = UNIT, protocol: int = 0, length: int | None = None) -> bytes:
    return struct.pack(">HHHB", transaction, protocol, len(pdu) + 1 if length is None else length, unit) + pdu


def test_malformed_frames_and_unknown_function_codes_leave_the_server_serving(tmp_path: Path) -> None:
    with free_running(tmp_path) as (d, port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(mbap(1, bytes([0x63])))  # no such function code
            answer = s.recv(64)
            assert answer[7] == 0x80 | 0x63 or answer[7] == 0x80, answer
            assert answer[8] == 1, answer  # exception 1: illegal function
        for garbage in (
            b"\xff" * 300,
            mbap(2, bytes([3, 0, 0, 0, 1]), protocol=7),
            mbap(3, bytes([3, 0, 0]), length=2000),
            mbap(4, bytes([3, 0, 0, 0, 200])),
            bytes(range(256)) * 8,
        ):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(garbage)
                s.settimeout(0.5)
                try:
                    s.recv(64)
                except TimeoutError:
                    pass
        with client(port) as c:
            assert len(block(c)) == BLOCK
        frames = ready(d).frames_processed
        assert d.wait_status(lambda s: s.frames_processed > frames + 10)


def test_connections_beyond_the_bound_are_closed_as_they_come_and_counted(tmp_path: Path) -> None:
    with free_running(tmp_path, max_connections=4, reclaim_idle_s=3600) as (d, port):
        sockets = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(200)]
        try:
            status = modbus_status(d, lambda m: m.refused >= 196)
            assert status.modbus is not None and (status.modbus.clients, status.modbus.reclaimed) == (4, 0)
            rss = rss_kb(d.proc.pid)
        finally:
            for s in sockets:
                s.close()
        modbus_status(d, lambda m: m.clients == 0)
        with client(port) as c:
            assert len(block(c)) == BLOCK
        assert rss_kb(d.proc.pid) < rss + 20_000
        frames = ready(d).frames_processed
        assert d.wait_status(lambda s: s.frames_processed > frames + 10)


def test_a_new_client_takes_the_place_of_one_silent_for_reclaim_idle_s_and_a_busy_one_keeps_its_own(
    tmp_path: Path,
) -> None:
    # Two clients that connect and never ask take every place; once they have been silent for
    # reclaim_idle_s, a newcomer closes the one silent longest, and a client that keeps asking is
    # never the one closed. (The refusal while they are younger: tests/test_modbus.py, on a set
    # clock; the bound's refusals: the test above.)
    with free_running(tmp_path, max_connections=3, reclaim_idle_s=1.0) as (d, port), client(port) as plc:
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        try:
            modbus_status(d, lambda m: m.clients == 3)
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:  # the PLC keeps asking while the others say nothing
                assert len(block(plc, 1)) == 1
            with client(port) as newcomer:
                assert len(block(newcomer)) == BLOCK
                assert silent[0].recv(1) == b"", "the connection silent longest made room"
                assert modbus_status(d, lambda m: m.reclaimed == 1).modbus.clients == 3  # type: ignore[union-attr]
                assert len(block(plc)) == BLOCK
        finally:
            for s in silent:
                s.close()


def test_a_client_that_never_reads_its_answers_is_closed_and_counted(tmp_path: Path) -> None:
    # Its answers fill the kernel's buffers first (small: edged sets them so), then edged's: beyond
    # MAX_UNREAD_BYTES there, the connection is dropped. Another client's round trip after each of
    # its requests paces them one at a time through the server (pymodbus discards a backlog of
    # frames over 516 bytes, and a cut frame garbles what follows); it is answered throughout.
    with free_running(tmp_path) as (d, port), client(port) as other:
        rss = rss_kb(d.proc.pid)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.connect(("127.0.0.1", port))
        request = mbap(1, bytes([3, 0, 0, 0, 125]))  # 259 bytes of answer each
        deadline = time.monotonic() + 300
        try:
            while time.monotonic() < deadline:
                try:
                    s.sendall(request)
                except (ConnectionResetError, BrokenPipeError):
                    break
                assert len(block(other, 1)) == 1
        finally:
            s.close()
        assert time.monotonic() < deadline, "never dropped"
        assert modbus_status(d, lambda m: m.unread == 1)
        assert rss_kb(d.proc.pid) < rss + 30_000
        assert len(block(other)) == BLOCK


def test_a_busy_port_fails_the_check_with_exit_1_naming_modbus_listen(tmp_path: Path) -> None:
    fixed_scene(tmp_path / "model.onnx", SCENE)
    port = free_port()
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "images", "path": str(images(tmp_path / "frames"))},
            "model": {"path": "model.onnx"},
            "publish": {"endpoints": [f"tcp://127.0.0.1:{free_port()}"]},
            "thermal": {"enabled": False},
            "modbus": {"listen": f"127.0.0.1:{port}"},
        },
    )
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"listen     modbus.listen: modbus://127.0.0.1:{port} (bound and released)" in result.stdout
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        result = run_cli("check", "--config", str(config))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"modbus.listen 127.0.0.1:{port}: the Modbus server cannot listen there" in result.stderr
    assert "Address already in use" in result.stderr


def test_a_busy_port_at_run_is_logged_and_retried_while_detection_goes_on(tmp_path: Path) -> None:
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    port = free_port()
    held.bind(("127.0.0.1", port))
    held.listen()
    fixed_scene(tmp_path / "model.onnx", SCENE)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    doc: dict[str, Any] = {
        "source": {"type": "images", "path": str(images(tmp_path / "frames")), "fps": 30.0},
        "model": {"path": "model.onnx"},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.25},
        "thermal": {"enabled": False},
        "inspect": {"ng_classes": ["crack"]},
        "modbus": {"listen": f"127.0.0.1:{port}", "unit_id": UNIT},
    }
    d = RunningDaemon(write_config(tmp_path / "edged.toml", doc), endpoint)
    try:
        frames = ready(d).frames_processed
        assert d.wait_status(lambda s: s.frames_processed > frames + 10)
        assert wait_for(lambda: "the Modbus server cannot listen there" in d.log(), 30), d.log()
        assert d.log().count("Address already in use") == 1
        held.close()
        assert wait_for(lambda: "Modbus TCP on" in d.log(), 30), d.log()
        with client(port) as c:
            assert len(block(c)) == BLOCK
    finally:
        held.close()
        d.close()


@pytest.mark.skipif(shutil.which("mbpoll") is None, reason="mbpoll is not installed (Debian: apt install mbpoll)")
def test_mbpoll_reads_the_block(tmp_path: Path) -> None:
    with free_running(tmp_path) as (d, port):
        modbus_status(d)
        result = subprocess.run(
            [
                "mbpoll",
                "-m",
                "tcp",
                "-p",
                str(port),
                "-a",
                str(UNIT),
                "-0",
                "-r",
                "0",
                "-c",
                "12",
                "-t",
                "4",
                "-1",
                "127.0.0.1",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        values = dict(line.strip("[]").split("]:") for line in result.stdout.splitlines() if line.startswith("["))
        assert int(values["1"].strip()) == 1 and int(values["2"].strip()) == 2  # running; NG
