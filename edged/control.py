"""``edged promote`` and ``edged rollback``: the local control socket and its client.

The daemon binds a ZeroMQ REP socket on ``model.candidate.control``, an ipc:// path made 0660 by
`edged.listen.Listener`: only root and the service's group may connect. The loop reads it among
its other sockets and answers each command between frames (`ControlSocket.serve`), with what is
live now. A promotion is refused, naming why, unless the shadow trial passed its gate
(`edged.shadow.Shadow.gate`) or ``--force`` is given, which is logged with the user and reason.
The user is the kernel's word, not the client's: libzmq reads the connecting process's
credentials (``SO_PEERCRED``) and gives them with each message as its ``Peer-Address``
(``…:uid:gid:pid``), which `_peer` maps to a login name. The name a client sends is kept only
when it differs, as ``claimed``. A request is bounded by the socket's ``MAXMSGSIZE``
(`edged.listen`): a larger one drops that peer, and a peer that sends nothing costs the loop
nothing, since it reads only whole requests waiting; a peer that floods it is answered a few
commands a turn, between the frames.
"""

from __future__ import annotations

import getpass
import json
import logging
import pwd
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import zmq

from edged.config import Settings
from edged.errors import ControlError, PublishError, UsageError
from edged.listen import MAX_MESSAGE_BYTES, Listener, socket_with_room, try_bind
from edged.messages import ModelInfo, refused_character
from edged.output import Endpoint

if TYPE_CHECKING:  # the client (edged promote) loads no model runtime
    from edged.journal import JournalOutput
    from edged.shadow import Shadow, Swap

log = logging.getLogger(__name__)

MAX_REASON = 300  # characters of a --reason, which the request carries whole (`_payload`)
MAX_USER = 64  # characters of the user name a client claims: a claim, kept beside the kernel's word
# Commands answered per `ControlSocket.serve`: the rest of a flood waits in libzmq's bounded queue
# for the loop's next turn, rather than holding its frames, status and stop.
COMMANDS_PER_SERVE = 10
COMMANDS = ("promote", "rollback")
KEY = "model.candidate.control"


def listening(settings: Settings) -> list[Endpoint]:
    """The control socket with ``[model.candidate]``: what ``edged check`` binds and releases."""
    candidate = settings.model.candidate
    if candidate is None:
        return []
    return [Endpoint(KEY, candidate.control, partial(try_bind, candidate.control, KEY, zmq.REP))]


ONE_LINE = "say it on one line, as text"
NO_TRIAL = "refused: no [model.candidate] in the running configuration (a reload removed it)"


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
        shadow: Shadow | None,
        current: Callable[[], Swap],
        apply: Callable[[Swap], None],
        blocked: str | None,
        journal: JournalOutput | None,
    ) -> None:
        """Answer the commands waiting, at most `COMMANDS_PER_SERVE` (the rest on the loop's next
        turns): ``current`` is the model and frame paths serving now, ``apply`` swaps in others
        between frames; ``blocked`` says why no swap can be made now. The ``journal``, when on,
        records each promotion and rollback with both models' sha256.
        Without a trial (``shadow`` None: a reload removed ``[model.candidate]``, the socket stays
        bound) each command is refused: a request left unread would keep the loop's wait
        (`zmq.select`, level-triggered) returning at once, and its client waiting for nothing."""
        sock = self._listener.socket
        for _ in range(COMMANDS_PER_SERVE):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)  # every part: REP answers whole requests
            except zmq.Again:
                return
            raw = parts[0].bytes if len(parts) == 1 else b""
            reply: dict[str, Any] = {"ok": False, "error": NO_TRIAL}
            if shadow is not None:
                reply = _answer(raw, _peer(parts[0]), shadow, current, apply, blocked)
            if journal is not None and reply["ok"]:
                done: Literal["promotion", "rollback"] = "promotion" if reply["done"] == "promote" else "rollback"
                record = {key: reply.get(key) for key in ("user", "pid", "claimed", "reason", "forced", "gate")}
                live = current().model.info.sha256
                journal.model_change(done, live, {"from_sha256": reply["from"]["sha256"], "to_sha256": live, **record})
            reply["live"] = current().model.info.model_dump()
            previous = shadow.previous if shadow is not None else None
            reply["previous"] = previous.info.model_dump() if previous is not None else None
            sock.send(json.dumps(reply).encode())

    def close(self) -> None:
        self._listener.close(linger=0)
        self._context.term()


def _peer(frame: zmq.Frame) -> tuple[str, int | None]:
    """Who sent ``frame``: the login name of the process's uid (the uid itself when it has none)
    and its pid, from the credentials libzmq read with ``SO_PEERCRED`` when the peer connected.
    ``unknown`` where libzmq gave none (built without ``SO_PEERCRED``)."""
    try:
        fields = str(frame.get("Peer-Address")).rsplit(":", 3)
        uid, pid = int(fields[-3]), int(fields[-1])
    except (zmq.ZMQError, ValueError, IndexError):
        return "unknown", None
    try:
        return pwd.getpwuid(uid).pw_name, pid
    except KeyError:
        return f"uid {uid}", pid


def _answer(
    raw: bytes,
    peer: tuple[str, int | None],
    shadow: Shadow,
    current: Callable[[], Swap],
    apply: Callable[[Swap], None],
    blocked: str | None,
) -> dict[str, Any]:
    """One command carried out, or refused naming why; ``peer``: the sender's user and pid (`_peer`)."""
    try:
        request = json.loads(raw)
        command, force = request["command"], request.get("force") is True
        said, reason = request.get("user"), str(request.get("reason") or "")[:MAX_REASON]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):  # RecursionError: `[[[...` a KiB deep
        return {"ok": False, "error": "not a control request"}
    user, pid = peer
    claimed = str(said)[:MAX_REASON] if said is not None and str(said) != user else None
    by = f"{user} pid {pid}" + (f", claimed {claimed!r}" if claimed is not None else "")
    who = {"user": user, "pid": pid, "claimed": claimed}
    if command not in COMMANDS:
        return {"ok": False, "error": f"unknown command {command!r}"}
    if (found := refused_character(reason)) is not None:  # the log shows the reason as it is: it could forge lines
        refused = "promotion" if command == "promote" else "rollback"
        return {"ok": False, "error": f"{refused} refused: in the reason, {found}: {ONE_LINE}"}
    before = current()
    if command == "rollback":
        if shadow.previous is None:
            return {"ok": False, "error": "nothing to roll back: no model was promoted"}
        rolled = shadow.rollback() if blocked is None else None
        if rolled is None:
            return {"ok": False, "error": f"rollback refused: {blocked}"}
        apply(rolled)
        log.warning("rolled back from model %s to %s (by %s)", _short(before.model.info), _short(rolled.model.info), by)
        return {"ok": True, "done": "rollback", "from": before.model.info.model_dump(), **who}
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
        log.warning("promoted model %s over %s (by %s; the trial passed its gate)", *names, by)
    else:
        log.warning("promoted model %s over %s by force (by %s: %s; gate: %s)", *names, by, reason, why)
    done = {"ok": True, "done": "promote", "from": before.model.info.model_dump(), **who}
    return {**done, "forced": why is not None, "reason": reason or None, "gate": why}


def _short(info: ModelInfo) -> str:
    return f"{info.name}@{info.sha256[:12]}"


def request(
    endpoint: str, command: str, *, force: bool = False, reason: str | None = None, timeout_s: float = 10.0
) -> dict[str, Any]:
    """Send one command to the daemon on ``endpoint`` and return its reply; raises `ControlError`, or
    `UsageError` for a request refused before any connection is tried (`_payload`)."""
    payload = _payload(command, force, reason or "")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = socket_with_room(context, zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(payload)
        if not sock.poll(int(timeout_s * 1000)):
            raise ControlError(f"no answer on {endpoint} in {timeout_s:g} s: is edged running with [model.candidate]?")
        reply: dict[str, Any] = json.loads(sock.recv())
        return reply
    finally:
        sock.close(linger=0)
        context.term()


def _payload(command: str, force: bool, reason: str) -> bytes:
    """The request as sent: JSON in UTF-8, which the daemon reads only whole and within the socket's
    message limit (a larger one drops the client unanswered, as if no edged listened). Raises
    `UsageError`, before anything is sent, for what `_answer` would refuse for the arguments alone
    (a ``force`` without a ``reason``, a ``reason`` not on one line), which the user would otherwise
    learn only from the daemon, or after ``--timeout`` where none answers; and for a ``reason`` it
    cannot carry whole."""
    if force and not reason:
        raise UsageError("--force needs --reason TEXT: why the trial's gate is passed over, kept in the log with the user")
    if (found := refused_character(reason)) is not None:
        raise UsageError(f"in --reason, {found}: {ONE_LINE}")
    body = {"command": command, "force": force, "reason": reason, "user": getpass.getuser()[:MAX_USER]}
    payload = json.dumps(body, ensure_ascii=False).encode(errors="backslashreplace")  # a lone surrogate as JSON escapes it
    if len(reason) > MAX_REASON or len(payload) > MAX_MESSAGE_BYTES:
        size = len(reason.encode(errors="backslashreplace"))
        raise UsageError(
            f"--reason is {len(reason)} characters ({size} bytes in UTF-8): a request carries at most "
            f"{MAX_REASON} characters and {MAX_MESSAGE_BYTES} bytes in all; say it in fewer"
        )
    return payload


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
