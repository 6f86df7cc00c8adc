"""``edged bench --opcua``: how long a verdict takes from capture to the OPC UA nodes, and to a subscriber.

A real ``edged run`` with ``[inspect]`` and ``[opcua]`` inspects a 1280x720 scene at a camera's
pace; a real OPC UA client (asyncua's) monitors ``Sequence`` with a queue, as a PLC would.
Two figures: capture to node update, as the daemon measures it (the status message's
``opcua.update_ms``, over its last verdicts; beside it the frame age, capture to result), and
capture to the data-change notification in the client (its arrival against the value's source
timestamp, the frame's capture time: the same machine's clock), which adds the subscription's
publishing interval and the network.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import zmq
from asyncua.client.client import Client
from asyncua.ua.uaerrors import UaError

from edged.config import Spinning
from edged.errors import ColdStartError
from edged.messages import StatusMessage, parse_message
from edged.opcua_server import MAX_SESSION_TIMEOUT_MS
from edged.sources.scenes import SceneGenerator
from edged.tools import bench_process
from edged.tools.bench_config import write_config

PUBLISHING_MS = 10.0  # the client's publishing interval: as short as a PLC would ask
STARTUP_TIMEOUT_S = 120.0


class _Arrivals:
    """The client's notifications of ``Sequence``: (arrival, source timestamp) in ns, wall clock."""

    def __init__(self) -> None:
        self.at: list[tuple[int, int]] = []

    def datachange_notification(self, node: Any, val: Any, data: Any) -> None:
        stamp = data.monitored_item.Value.SourceTimestamp  # none while waiting for the first verdict
        self.at.append((time.time_ns(), int(stamp.timestamp() * 1e9) if stamp is not None else 0))


def _source(folder: Path, fps: float) -> str:
    (folder / "frames").mkdir(exist_ok=True)
    cv2.imwrite(str(folder / "frames" / "scene.png"), SceneGenerator(1280, 720, seed=0).render(0).image)
    return f'[source]\ntype = "images"\npath = {json.dumps(str(folder / "frames"))}\nfps = {fps}\n[inspect]\n'


async def _subscribe(url: str, verdicts: int, timeout_s: float) -> list[tuple[int, int]]:
    arrivals = _Arrivals()
    deadline = time.monotonic() + timeout_s
    while True:  # the server starts on its own thread after the daemon's first frame
        try:
            client = Client(url, timeout=30)
            client.session_timeout = MAX_SESSION_TIMEOUT_MS  # asyncua asks for an hour, and warns of the revision
            await client.connect()
            break
        except (OSError, TimeoutError, UaError):
            if time.monotonic() > deadline:
                raise ColdStartError(f"bench --opcua: no OPC UA server at {url} within {timeout_s:g} s") from None
            await asyncio.sleep(0.2)
    try:
        ns = await client.get_namespace_index("urn:edged")
        node = await client.nodes.objects.get_child([f"{ns}:edged", f"{ns}:cam0", f"{ns}:Sequence"])
        sub = await client.create_subscription(PUBLISHING_MS, arrivals)
        await sub.subscribe_data_change(node, queuesize=100)
        while len(arrivals.at) < verdicts + 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await sub.delete()
    finally:
        await client.disconnect()
    return [(at, stamp) for at, stamp in arrivals.at[1:] if stamp]  # the first is the value when subscribed


def _last_status(sub: zmq.Socket[bytes], timeout_ms: int = 5000) -> StatusMessage | None:
    """The newest status message that has the OPC UA server's figures, once those queued are read."""
    last = None
    while sub.poll(timeout_ms):
        message = parse_message(sub.recv_multipart()[-1])
        if isinstance(message, StatusMessage) and message.opcua is not None and message.opcua.updates:
            last = message
            if not sub.poll(0):
                break
    return last


@contextmanager
def opcua_daemon(
    model: Path, fps: float, spinning: Spinning, opcua_keys: str = ""
) -> Iterator[tuple[subprocess.Popen[bytes], zmq.Socket[bytes], str, Path]]:
    """`edged run` on the bench scene at ``fps`` with ``[opcua]`` (plus ``opcua_keys``, TOML lines) and a
    SUB on its status; yields the process, the SUB, the server's URL and the file its stderr goes to,
    and stops them all."""
    with tempfile.TemporaryDirectory(prefix="edged-opcua-") as tmp:
        folder = Path(tmp)
        endpoint, url = f"tcp://127.0.0.1:{_free_port()}", f"opc.tcp://127.0.0.1:{_free_port()}"
        sources = _source(folder, fps) + f"[opcua]\nlisten = {json.dumps(url)}\ncert_dir = {json.dumps(tmp)}\n"
        config = write_config(folder / "edged.toml", model, endpoint, sources + opcua_keys, spinning=spinning, thermal=False)
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"edged/status/")
        sub.connect(endpoint)
        log = folder / "edged.stderr"
        with log.open("wb") as stderr:
            child = bench_process.start(
                [sys.executable, "-m", "edged", "run", "--config", str(config)], stdout=subprocess.DEVNULL, stderr=stderr
            )
        try:
            yield child, sub, url, log
        finally:
            child.terminate()
            child.wait(30)
            sub.close(linger=0)
            context.term()


def opcua_latency(model: Path, verdicts: int, fps: float, spinning: Spinning) -> dict[str, Any]:
    """Run edged for ``verdicts`` verdicts at ``fps`` with an OPC UA subscriber; both latencies, p50 and p99."""
    with opcua_daemon(model, fps, spinning) as (_, sub, url, log):
        arrivals = asyncio.run(_subscribe(url, verdicts, STARTUP_TIMEOUT_S + verdicts / fps * 2))
        status = _last_status(sub)
        stderr = log.read_bytes()
    if not arrivals or status is None or status.opcua is None:
        raise ColdStartError(f"bench --opcua: edged published no verdict over OPC UA:\n{stderr.decode()[-2000:]}")
    notified_ms = np.array([(at - stamp) / 1e6 for at, stamp in arrivals])
    return {
        "fps": fps,
        "verdicts": len(arrivals),
        "publishing_ms": PUBLISHING_MS,
        "update_ms": {"p50": status.opcua.update_ms.p50_ms, "p99": status.opcua.update_ms.p99_ms},
        "result_ms": {"p50": age.p50_ms, "p99": age.p99_ms} if (age := status.latency.get("age")) else None,
        "notified_ms": {
            "p50": float(np.percentile(notified_ms, 50)),
            "p99": float(np.percentile(notified_ms, 99)),
            "max": float(notified_ms.max()),
        },
        "dropped": status.drops.get("opcua_dropped", 0),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def format_opcua(r: dict[str, Any]) -> str:
    update, notified, result = r["update_ms"], r["notified_ms"], r["result_ms"]
    before = ""
    if result is not None:
        before = (
            f"  capture to result (the frame age, for comparison) p50 {result['p50']:.2f} ms p99 {result['p99']:.2f} ms\n"
        )
    return (
        f"opcua: {r['verdicts']} verdicts at {r['fps']:g} fps, subscriber publishing every {r['publishing_ms']:g} ms\n"
        + before
        + f"  capture to node update (edged's own) p50 {update['p50']:.2f} ms p99 {update['p99']:.2f} ms\n"
        f"  capture to notification at the client p50 {notified['p50']:.2f} ms p99 {notified['p99']:.2f} ms "
        f"max {notified['max']:.2f} ms; dropped {r['dropped']}"
    )
