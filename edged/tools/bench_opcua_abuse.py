"""``edged bench --opcua --abuse``: the loop's frame rate while OPC UA clients press on the server.

The real daemon runs the model on one camera (the bench scene, ``--camera-fps``) with ``[inspect]``
and ``[opcua]`` at ``max_clients = SESSIONS``. Its rate is taken as for ``--modbus --abuse``: quiet,
while `SESSIONS` asyncua sessions are open (one of them subscribed to every camera node, at the
shortest publishing interval, with its publish loop stopped: it never asks for, nor acknowledges,
a notification), and quiet again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from asyncua.client.client import Client
from asyncua.ua.uaerrors import UaError

from edged.config import Spinning
from edged.tools.bench_modbus_abuse import format_phases, measure_phases, wait_for_frames
from edged.tools.bench_opcua import opcua_daemon

SESSIONS = 50
PUBLISHING_MS = 10.0


class _Ignored:
    def datachange_notification(self, node: Any, val: Any, data: Any) -> None:
        """Never called: the publish loop that would deliver it is stopped."""


async def _sessions(url: str, seconds: float) -> dict[str, Any]:
    logging.getLogger("asyncua").setLevel(logging.CRITICAL)  # its warnings of each session's timeout
    clients: list[Client] = []
    failed = 0
    for _ in range(SESSIONS):
        client = Client(url, timeout=10)
        try:
            await client.connect()
            clients.append(client)
        except (OSError, TimeoutError, UaError):
            failed += 1
    subscribed = 0
    if clients:
        silent = clients[0]
        ns = await silent.get_namespace_index("urn:edged")
        camera = await silent.nodes.objects.get_child([f"{ns}:edged", f"{ns}:cam0"])
        sub = await silent.create_subscription(PUBLISHING_MS, _Ignored())
        for node in await camera.get_children():
            with contextlib.suppress(UaError):
                await sub.subscribe_data_change(node, queuesize=100)
                subscribed += 1
        task = silent.uaclient._publish_task
        if task is not None:
            task.cancel()
    await asyncio.sleep(seconds)
    for client in clients:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.disconnect(), 5)
    return {"sessions_opened": len(clients), "sessions_failed": failed, "silent_subscriber_nodes": subscribed}


def run_opcua_abuse_bench(model: Path, fps: float, seconds: float, spinning: Spinning) -> dict[str, Any]:
    """The daemon's frame rate for ``seconds`` quiet, ``seconds`` with the sessions open, ``seconds`` quiet."""
    with opcua_daemon(model, fps, spinning, f"max_clients = {SESSIONS}\n") as (child, sub, url, _):
        # The OPC UA server builds its address space on a thread of its own, and a loaded board
        # may process frames seconds before it listens: sessions opened then are refused.
        wait_for_frames(sub, child, lambda status: bool((status.get("opcua") or {}).get("serving")))
        return measure_phases(sub, seconds, fps, lambda s: asyncio.run(_sessions(url, s)), "opcua")


def format_opcua_abuse(r: dict[str, Any]) -> str:
    a, s = r["abusers"], r["server"]
    lines = format_phases("opcua", r)
    if a:
        lines.append(
            f"  clients: {a['sessions_opened']} sessions ({a['sessions_failed']} failed), one subscribed to "
            f"{a['silent_subscriber_nodes']} nodes that never acknowledges"
        )
    lines.append(f"  server: peak {s['peak_clients']} clients")
    return "\n".join(lines)
