"""``edged promote`` and ``edged rollback``: the local control socket and its client.

The daemon binds a ZeroMQ REP socket on ``model.candidate.control``, an ipc:// path made 0660 by
`edged.listen.Listener`: only root and the service's group may connect. The loop reads it among
its other sockets and answers each command between frames (`ControlSocket.serve`), with what is
live now. A promotion is refused, naming why, unless the shadow trial passed its gate
(`edged.shadow.Shadow.gate`) or ``--force`` is given, which is logged with the user and reason.
The user is the one the client runs as (its process's login name): the socket's mode already
limits who that can be.
"""

from __future__ import annotations

import getpass
import json
import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import zmq

from edged.config import Settings
from edged.errors import ControlError, PublishError
from edged.listen import Listener, try_bind
from edged.messages import ModelInfo
from edged.output import Endpoint

if TYPE_CHECKING:  # the client (edged promote) loads no model runtime
    from edged.journal import JournalOutput
    from edged.shadow import Shadow, Swap

log = logging.getLogger(__name__)

MAX_REASON = 300  # characters of a --reason: the request must stay under the socket's message limit
COMMANDS = ("promote", "rollback")
KEY = "model.candidate.control"


def listening(settings: Settings) -> list[Endpoint]:
    """The control socket with ``[model.candidate]``: what ``edged check`` binds and releases."""
    candidate = settings.model.candidate
    if candidate is None:
        return []
    return [Endpoint(KEY, candidate.control, partial(try_bind, candidate.control, KEY, zmq.REP))]


class ControlSocket:
    """The daemon's end: a REP socket the loop polls (`fds`) and serves between frames."""

    def __init__(self, endpoint: str) -> None:
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._listener = Listener(
            self._context, zmq.REP, lambda sock: sock.setsockopt(zmq.LINGER, 0), "model.candidate.control"
        )
        try:
            self._listener.bind(endpoint)
        except PublishError:
            self.close()
            raise

    @property
    def fds(self) -> list[Any]:
        return [self._listener.socket]

    def serve(
        self,
        shadow: Shadow,
        current: Callable[[], Swap],
        apply: Callable[[Swap], None],
        blocked: str | None,
        journal: JournalOutput | None,
    ) -> None:
        """Answer every command waiting: ``current`` is the model and frame paths serving now,
        ``apply`` swaps in others between frames; ``blocked`` says why no swap can be made now.
        The ``journal``, when on, records each promotion and rollback with both models' sha256."""
        sock = self._listener.socket
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)  # every part: a REP socket answers whole requests
            except zmq.Again:
                return
            reply = _answer(parts[0] if len(parts) == 1 else b"", shadow, current, apply, blocked)
            if journal is not None and reply["ok"]:
                done: Literal["promotion", "rollback"] = "promotion" if reply["done"] == "promote" else "rollback"
                record = {key: reply.get(key) for key in ("user", "reason", "forced", "gate")}
                live = current().model.info.sha256
                journal.model_change(done, live, {"from_sha256": reply["from"]["sha256"], "to_sha256": live, **record})
            reply["live"] = current().model.info.model_dump()
            previous = shadow.previous
            reply["previous"] = previous.info.model_dump() if previous is not None else None
            sock.send(json.dumps(reply).encode())

    def close(self) -> None:
        self._listener.close(linger=0)
        self._context.term()


def _answer(
    raw: bytes, shadow: Shadow, current: Callable[[], Swap], apply: Callable[[Swap], None], blocked: str | None
) -> dict[str, Any]:
    """One command carried out, or refused naming why."""
    try:
        request = json.loads(raw)
        command, force = request["command"], request.get("force") is True
        user, reason = str(request.get("user", "?")), str(request.get("reason") or "")[:MAX_REASON]
    except (ValueError, KeyError, TypeError, AttributeError):
        return {"ok": False, "error": "not a control request"}
    if command not in COMMANDS:
        return {"ok": False, "error": f"unknown command {command!r}"}
    before = current()
    if command == "rollback":
        if shadow.previous is None:
            return {"ok": False, "error": "nothing to roll back: no model was promoted"}
        rolled = shadow.rollback() if blocked is None else None
        if rolled is None:
            return {"ok": False, "error": f"rollback refused: {blocked}"}
        apply(rolled)
        log.warning("rolled back from model %s to %s (by %s)", _short(before.model.info), _short(rolled.model.info), user)
        return {"ok": True, "done": "rollback", "from": before.model.info.model_dump(), "user": user}
    why = shadow.gate()
    if why is not None and (not force or shadow.state != "on_trial"):
        return {"ok": False, "error": f"promotion refused: {why}"}
    if why is not None and not reason:
        return {"ok": False, "error": "promotion refused: --force needs --reason, which the log keeps with the user"}
    if blocked is not None:
        return {"ok": False, "error": f"promotion refused: {blocked}"}
    promoted = shadow.promote(before)
    apply(promoted)
    names = (_short(promoted.model.info), _short(before.model.info))
    if why is None:
        log.warning("promoted model %s over %s (by %s; the trial passed its gate)", *names, user)
    else:
        log.warning("promoted model %s over %s by force (by %s: %s; gate: %s)", *names, user, reason, why)
    done = {"ok": True, "done": "promote", "from": before.model.info.model_dump(), "user": user}
    return {**done, "forced": why is not None, "reason": reason or None, "gate": why}


def _short(info: ModelInfo) -> str:
    return f"{info.name}@{info.sha256[:12]}"


def request(
    endpoint: str, command: str, *, force: bool = False, reason: str | None = None, timeout_s: float = 10.0
) -> dict[str, Any]:
    """Send one command to the daemon on ``endpoint`` and return its reply; raises `ControlError`."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        body = {"command": command, "force": force, "reason": (reason or "")[:MAX_REASON], "user": getpass.getuser()}
        sock.send(json.dumps(body).encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise ControlError(f"no answer on {endpoint} in {timeout_s:g} s: is edged running with [model.candidate]?")
        reply: dict[str, Any] = json.loads(sock.recv())
        return reply
    finally:
        sock.close(linger=0)
        context.term()


def run_control(endpoint: str, command: str, *, force: bool, reason: str | None, timeout_s: float) -> int:
    """``edged promote`` / ``edged rollback``: print what is live now; raises `ControlError` when refused."""
    reply = request(endpoint, command, force=force, reason=reason, timeout_s=timeout_s)
    live = reply.get("live") or {}
    said = f"live: {live.get('name')} sha256 {live.get('sha256')}"
    if not reply.get("ok"):
        raise ControlError(f"{reply.get('error', 'refused')} ({said})")
    print(f"{'promoted' if command == 'promote' else 'rolled back'}; {said}")
    previous = reply.get("previous")
    if previous:
        print(f"previous, kept for edged rollback: {previous.get('name')} sha256 {previous.get('sha256')}")
    return 0
