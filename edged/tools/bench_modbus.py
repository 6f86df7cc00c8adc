"""``edged bench --modbus``: how long a verdict takes from capture to the Modbus registers a PLC reads.

The real daemon runs the model on one camera (an image folder of the bench scene, ``--camera-fps``)
with ``[inspect]`` and ``[modbus]``; a Modbus client (pymodbus') polls the camera's block every
`POLL_S`, as a fast PLC scan would. Register 10 is edged's own measure of each verdict, capture to the register update, taken
as the registers are written; the client's view adds the poll: from capture (the verdict message's
capture time, on ZeroMQ) to the read that first showed the verdict's sequence number.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import zmq

from edged.config import Spinning
from edged.errors import ColdStartError
from edged.sources.scenes import SceneGenerator
from edged.tools import bench_process
from edged.tools.bench_config import write_config

STARTUP_TIMEOUT_S = 120.0
POLL_S = 0.002
UNIT = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _percentiles(values: list[float]) -> dict[str, float]:
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)), "max": float(max(values))}


@contextlib.contextmanager
def modbus_daemon(
    model: Path, fps: float, spinning: Spinning, topic: bytes, modbus_keys: str = ""
) -> Iterator[tuple[subprocess.Popen[bytes], zmq.Socket[bytes], int]]:
    """`edged run` on the bench scene (an images source at ``fps``) with ``[inspect]`` and
    ``[modbus]`` (plus ``modbus_keys``, TOML lines), and a SUB on its ``topic``; yields the process,
    the SUB and the Modbus port, and stops them all."""
    with tempfile.TemporaryDirectory(prefix="edged-modbus-") as tmp:
        folder = Path(tmp)
        (folder / "frames").mkdir()
        cv2.imwrite(str(folder / "frames" / "scene.png"), SceneGenerator(1280, 720, seed=0).render(0).image)
        port, endpoint = _free_port(), f"tcp://127.0.0.1:{_free_port()}"
        camera = f'[source]\ntype = "images"\npath = {json.dumps(str(folder / "frames"))}\nfps = {fps}\n'
        config = write_config(folder / "edged.toml", model, endpoint, camera, spinning=spinning, thermal=False)
        with config.open("a") as f:
            f.write(f'[inspect]\n[modbus]\nlisten = "127.0.0.1:{port}"\nunit_id = {UNIT}\n{modbus_keys}')
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        sub.connect(endpoint)
        env = {k: v for k, v in os.environ.items() if not k.startswith("EDGED_")}
        child = bench_process.start(
            [sys.executable, "-m", "edged", "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        try:
            yield child, sub, port
        finally:
            child.terminate()
            child.wait(30)
            sub.close(linger=0)
            context.term()


def run_modbus_bench(model: Path, verdicts: int, fps: float, spinning: Spinning) -> dict[str, Any]:
    """Run the daemon until the client has seen ``verdicts`` verdicts; their latencies in ms."""
    from pymodbus.client import ModbusTcpClient

    logging.getLogger("pymodbus").setLevel(logging.CRITICAL)  # its refused connects while edged starts

    with modbus_daemon(model, fps, spinning, b"edged/verdict/") as (child, sub, port):
        client = ModbusTcpClient("127.0.0.1", port=port, timeout=5, retries=0)
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not client.connect():  # type: ignore[no-untyped-call]
                if child.poll() is not None or time.monotonic() > deadline:
                    raise ColdStartError(f"modbus bench: edged run (exit {child.poll()}) never served Modbus")
                time.sleep(0.1)
            return _poll(client, sub, verdicts, fps)
        finally:
            client.close()  # type: ignore[no-untyped-call]


def _poll(client: Any, sub: zmq.Socket[bytes], verdicts: int, fps: float) -> dict[str, Any]:
    """Read the block every `POLL_S`; each new sequence number's register 10, and when it was first seen."""
    seen_at: dict[int, int] = {}  # seq -> wall clock of the first read that showed it
    register_ms: list[float] = []
    captured: dict[int, int] = {}  # seq -> capture time (wall clock), from the verdict message
    verdict_ms: list[float] = []  # capture to verdict, as the verdict messages say
    last = -1
    reads = 0
    deadline = time.monotonic() + STARTUP_TIMEOUT_S + verdicts / fps * 3
    while len(register_ms) < verdicts and time.monotonic() < deadline:
        reply = client.read_holding_registers(0, count=12, device_id=UNIT)
        now = time.time_ns()
        reads += 1
        words = reply.registers
        seq = (words[3] << 16) | words[4]
        if words[2] and seq != last:
            last = seq
            seen_at[seq] = now
            register_ms.append(words[10] / 10)
        while sub.poll(0):
            _take(sub, captured, verdict_ms)
        time.sleep(POLL_S)
    drained = time.monotonic() + 2.0  # the verdicts already sent; the stream itself never ends
    while time.monotonic() < drained and sub.poll(200):
        _take(sub, captured, verdict_ms)
    if not register_ms:
        raise ColdStartError("modbus bench: no verdict reached the registers")
    seen_ms = [(seen_at[seq] - captured[seq]) / 1e6 for seq in seen_at if seq in captured]
    return {
        "fps": fps,
        "verdicts": len(register_ms),
        "reads": reads,
        "capture_to_verdict_ms": _percentiles(verdict_ms) if verdict_ms else None,
        "capture_to_register_ms": _percentiles(register_ms),
        "capture_to_client_read_ms": _percentiles(seen_ms) if seen_ms else None,
    }


def _take(sub: zmq.Socket[bytes], captured: dict[int, int], verdict_ms: list[float]) -> None:
    message = json.loads(sub.recv_multipart()[1])
    captured[message["seq"]] = message["capture_time_ns"]
    verdict_ms.append(message["verdict_latency_ms"])


def format_modbus(r: dict[str, Any]) -> str:
    register, seen, verdict = r["capture_to_register_ms"], r["capture_to_client_read_ms"], r["capture_to_verdict_ms"]
    lines = [
        f"modbus: {r['verdicts']} verdicts at {r['fps']:g} fps, {r['reads']} reads by a client polling "
        f"every {POLL_S * 1000:g} ms",
        f"  capture to register update p50 {register['p50']:.1f} ms p99 {register['p99']:.1f} ms "
        f"max {register['max']:.1f} ms",
    ]
    if verdict is not None:
        lines.append(f"  capture to verdict (its message) p50 {verdict['p50']:.1f} ms p99 {verdict['p99']:.1f} ms")
    if seen is not None:
        lines.append(
            f"  capture to the client's read p50 {seen['p50']:.1f} ms p99 {seen['p99']:.1f} ms max {seen['max']:.1f} ms"
        )
    return "\n".join(lines)
