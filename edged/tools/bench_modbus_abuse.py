"""``edged bench --modbus --abuse``: the loop's frame rate while Modbus clients misbehave.

The real daemon runs the model on one camera (an image folder of the bench scene, ``--camera-fps``)
with ``[inspect]`` and ``[modbus]`` at its most connections. Its rate, from the status messages'
``frames_processed`` over their ``time_ns``, is taken for a quiet phase, a phase under abuse and a
quiet phase again. The abuse runs in threads of the bench: a flood of malformed MBAP frames,
requests with unknown function codes (each answer awaited), a client that asks for the camera's
block `PIPELINED` times a send and never reads the answers (each at most `ABUSE_HZ` sends a second,
reconnecting whenever edged closes it), then `HOLDERS` connections opened and held, past
``max_connections``: edged closes the rest as they come. The finding is each phase's rate and the
abused one's change against the quiet mean, beside the `TARGET_PCT` the server must stay within.
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import zmq

from edged.config import Spinning
from edged.errors import ColdStartError
from edged.settings.modbus import MAX_CONNECTIONS
from edged.tools.bench_modbus import STARTUP_TIMEOUT_S, UNIT, modbus_daemon

HOLDERS = 200
ABUSE_HZ = 500.0
TARGET_PCT = 5.0
PIPELINED = 10


def _mbap(transaction: int, pdu: bytes, unit: int = UNIT) -> bytes:
    return struct.pack(">HHHB", transaction & 0xFFFF, 0, len(pdu) + 1, unit) + pdu


def _malformed(transaction: int) -> bytes:
    """Frames a Modbus server must survive: a foreign protocol id, a length past the frame, one of zero, noise."""
    kinds = (
        struct.pack(">HHHB", transaction & 0xFFFF, 0x1234, 6, UNIT) + b"\x03\x00\x00\x00\x01",
        struct.pack(">HHHB", transaction & 0xFFFF, 0, 2000, UNIT) + b"\x03\x00",
        struct.pack(">HHH", transaction & 0xFFFF, 0, 0),
        bytes((transaction * 37 + i) & 0xFF for i in range(17)),
    )
    return kinds[transaction % len(kinds)]


def _unknown_function(transaction: int) -> bytes:
    """A request with one of 20 function codes Modbus does not define (0x41-0x54): answered as an exception."""
    return _mbap(transaction, bytes((0x41 + transaction % 20,)) + b"\x00\x00\x00\x01")


def _unread(transaction: int) -> bytes:
    """`PIPELINED` reads of the camera's whole block at once: answers pile up fast for a client that never reads."""
    return b"".join(_mbap(transaction + i, struct.pack(">BHH", 3, 0, 16)) for i in range(PIPELINED))


Answers = Literal["unread", "skimmed", "awaited"]  # what an abuser does with edged's answers


class _Abuser:
    """One misbehaving client in a thread: ``frame(n)`` sent at most `ABUSE_HZ` times a second, its
    answers never read, read as far as they have come, or each awaited (for at most a second); a new
    connection whenever edged closes the old one."""

    def __init__(self, port: int, frame: Callable[[int], bytes], answers: Answers, stop: threading.Event) -> None:
        self.port, self.frame, self.answers, self.stop = port, frame, answers, stop
        self.sent = 0
        self.answered = 0  # awaited answers that came
        self.connections = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                    self.connections += 1
                    if self.answers == "unread":
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                    while not self.stop.is_set() and self._send(s):
                        time.sleep(1 / ABUSE_HZ)
            except OSError:
                self.stop.wait(0.01)

    def _send(self, s: socket.socket) -> bool:
        """One frame, and its answer as this abuser takes answers; False once edged closed the connection."""
        s.sendall(self.frame(self.sent))
        self.sent += 1
        if self.answers == "awaited":
            try:
                if s.recv(4096) == b"":
                    return False
                self.answered += 1
            except TimeoutError:
                pass
        elif self.answers == "skimmed":
            s.setblocking(False)
            try:
                if s.recv(4096) == b"":
                    return False
            except BlockingIOError:
                pass
            s.setblocking(True)
        return True


def _abuse(port: int, seconds: float) -> dict[str, Any]:
    """Run the abusive clients for ``seconds``; what they did."""
    stop = threading.Event()
    abusers = {
        "malformed": _Abuser(port, _malformed, "skimmed", stop),
        # Each answered before the next goes: a flood of them, read in one piece by a busy server,
        # would be dropped by pymodbus unanswered (it discards a backlog over 516 bytes).
        "unknown_function": _Abuser(port, _unknown_function, "awaited", stop),
        "never_reads": _Abuser(port, _unread, "unread", stop),
    }
    for a in abusers.values():
        a.thread.start()
    # The abusers first, so that the held connections leave them their slots: each connected, and
    # one served (its first answer in).
    connected = time.monotonic() + 5.0
    served = abusers["unknown_function"]
    while (any(a.connections == 0 for a in abusers.values()) or not served.answered) and time.monotonic() < connected:
        time.sleep(0.01)
    held: list[socket.socket] = []
    failed = 0  # connects that timed out or were reset: the listen backlog full while edged closes the others
    for _ in range(HOLDERS):
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=1.0))
        except OSError:
            failed += 1
    stop.wait(seconds)
    stop.set()
    for a in abusers.values():
        a.thread.join(5.0)
    for s in held:
        s.close()
    return {
        "held_opened": len(held),
        "held_failed": failed,
        **{name: {"sent": a.sent, "answered": a.answered, "connections": a.connections} for name, a in abusers.items()},
    }


def run_modbus_abuse_bench(model: Path, fps: float, seconds: float, spinning: Spinning) -> dict[str, Any]:
    """The daemon's frame rate for ``seconds`` quiet, ``seconds`` abused, ``seconds`` quiet again."""
    keys = f"max_connections = {MAX_CONNECTIONS}\n"
    with modbus_daemon(model, fps, spinning, b"edged/status/", keys) as (child, sub, port):
        wait_for_frames(sub, child)
        return measure_phases(sub, seconds, fps, lambda s: _abuse(port, s), "modbus")


def wait_for_frames(
    sub: zmq.Socket[bytes], child: subprocess.Popen[bytes], ready: Callable[[dict[str, Any]], bool] = lambda s: True
) -> None:
    """Return once a status message counts a frame processed and says ``ready`` (the server under test
    listens); ColdStartError if ``child`` never does."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and child.poll() is None:
        if sub.poll(500):
            status = json.loads(sub.recv_multipart()[1])
            if status["frames_processed"] > 0 and ready(status):
                return
    raise ColdStartError(f"abuse bench: edged run (exit {child.poll()}) never processed a frame with its server ready")


def measure_phases(
    sub: zmq.Socket[bytes], seconds: float, fps: float, abuse: Callable[[float], dict[str, Any]], output: str
) -> dict[str, Any]:
    """The rate quiet, while ``abuse(seconds)`` runs in a thread, and quiet again; beside it the status'
    ``output`` counters, their peak of clients and their last values."""
    clients: dict[str, Any] = {}
    abusing = threading.Thread(target=lambda: clients.update(abuse(seconds)), daemon=True)
    statuses = {"quiet": _statuses(sub, seconds)}
    abusing.start()
    statuses["abuse"] = _statuses(sub, seconds)
    abusing.join(60.0)
    statuses["quiet after"] = _statuses(sub, seconds)
    rates = {phase: _rate(s) for phase, s in statuses.items()}
    quiet = [r["fps"] for phase, r in rates.items() if phase != "abuse" and r["fps"] is not None]
    quiet_mean = sum(quiet) / len(quiet) if quiet else None
    abused = rates["abuse"]["fps"]
    change = None if quiet_mean is None or abused is None else (abused - quiet_mean) / quiet_mean * 100
    counters = [s[output] for s in statuses["abuse"] + statuses["quiet after"] if s.get(output)]
    return {
        "camera_fps": fps,
        "phase_s": seconds,
        "phases": rates,
        "quiet_mean_fps": quiet_mean,
        "change_pct": change,
        "within_target": None if change is None else abs(change) <= TARGET_PCT,
        "target_pct": TARGET_PCT,
        "abusers": clients,
        "server": {"peak_clients": max((c["clients"] for c in counters), default=0), **(counters[-1] if counters else {})},
    }


def _statuses(sub: zmq.Socket[bytes], seconds: float) -> list[dict[str, Any]]:
    """Every status message that arrives in the next ``seconds``."""
    out: list[dict[str, Any]] = []
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if sub.poll(int(left * 1000) + 1):
            out.append(json.loads(sub.recv_multipart()[1]))
    return out


def _rate(statuses: list[dict[str, Any]]) -> dict[str, Any]:
    """Frames over time between a phase's first and last status message."""
    if len(statuses) < 2:
        return {"frames": 0, "fps": None}
    first, last = statuses[0], statuses[-1]
    frames = last["frames_processed"] - first["frames_processed"]
    return {"frames": frames, "fps": frames / ((last["time_ns"] - first["time_ns"]) / 1e9)}


def format_phases(server: str, r: dict[str, Any]) -> list[str]:
    """The lines every abuse bench (`measure_phases`) starts with: each phase's rate, and the change."""
    lines = [
        f"{server} under abuse: camera at {r['camera_fps']:g} fps, {r['phase_s']:g} s per phase",
        *(
            f"  {phase:<12} {p['frames']:>6} frames  " + ("n/a" if p["fps"] is None else f"{p['fps']:.2f} fps")
            for phase, p in r["phases"].items()
        ),
    ]
    if r["change_pct"] is not None:
        verdict = "within" if r["within_target"] else "beyond"
        lines.append(f"  abused against the quiet mean: {r['change_pct']:+.1f} % ({verdict} {r['target_pct']:g} %)")
    return lines


def format_modbus_abuse(r: dict[str, Any]) -> str:
    a, s = r["abusers"], r["server"]
    lines = format_phases("modbus", r)
    if a:
        lines.append(
            f"  clients: {a['held_opened']} connections held ({a['held_failed']} failed to connect), "
            f"malformed frames {a['malformed']['sent']}, unknown function codes {a['unknown_function']['sent']}, "
            f"unread requests {a['never_reads']['sent'] * PIPELINED} "
            f"over {a['never_reads']['connections']} connection(s)"
        )
    lines.append(
        f"  server: peak {s['peak_clients']} clients, {s['refused']} refused, {s['reclaimed']} reclaimed, "
        f"{s['unread']} closed unread, {s['exceptions']} exceptions of {s['requests']} answers"
    )
    return "\n".join(lines)
