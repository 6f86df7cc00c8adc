"""Triggered inspection (``trigger.mode = "request"``): the request socket, and ``edged trigger``.

A request is a ZeroMQ message ``{"part_id": "..."}`` (part id optional) on a REP/ROUTER endpoint;
the daemon answers with the `VerdictMessage` of a frame captured after the request arrived, or a
`TriggerError` saying why not. `TriggerServer` owns the ROUTER socket: it stamps each request with
its arrival time as it reads it, keeps the waiting ones in order, at most ``trigger.queue`` behind
the one in progress, and answers "busy" beyond that at once, so no requester ever hangs. The daemon
loop services it between frames (`edged.daemon`): the loop alone touches the socket, which is
bound as every socket edged binds (`edged.listen.Listener`: a message-size limit, no taking over
a live ipc path).

Security: a tcp endpoint takes the publisher's CURVE server key and allow-list when
``publish.curve_*`` are set (with a ZAP authenticator of its own, in a context of its own); without
keys a non-loopback tcp endpoint is refused unless ``publish.insecure`` says otherwise, as for the stream.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TextIO

import zmq
from zmq.auth.thread import ThreadAuthenticator

from edged.config import PublishConfig, TriggerConfig
from edged.errors import MessageError, PublishError, TriggerFailed, UsageError
from edged.keys import ClientKeys, load_allowed_clients, load_secret_key
from edged.listen import Listener
from edged.messages import TriggerError, TriggerProblem, VerdictMessage, parse_message
from edged.publish import AllowList, check_exposure
from edged.subscribe import format_verdict

log = logging.getLogger(__name__)

MAX_PART_ID = 128
EXIT_NG = 3  # `edged trigger`: 0 is OK, 3 NG, 1 no verdict (an error reply or none)


@dataclass(frozen=True, slots=True)
class Request:
    """One request: where the reply goes, its part id, and when it was read (monotonic ns)."""

    envelope: tuple[bytes, ...]
    part_id: str | None
    arrived_ns: int


class TriggerServer:
    """The ROUTER socket requests arrive on, and the ordered, bounded list of those waiting.

    Raises `PublishError` for an endpoint it cannot bind or may not expose, `KeyFileError` for
    unusable keys.
    """

    def __init__(self, cfg: TriggerConfig, publish: PublishConfig, camera_id: str) -> None:
        self._camera_id = camera_id
        self._bound = cfg.queue + 1  # the one in progress and those behind it
        self._waiting: deque[Request] = deque()
        self._serving = False  # a request was handed out by `next` and not yet answered
        self._allowed = AllowList()
        self._clients_dir = publish.curve_clients_dir
        secure = cfg.endpoint.startswith("tcp://") and publish.curve_server_key is not None and self._clients_dir is not None
        keys = None
        if secure and publish.curve_server_key is not None:
            keys = load_secret_key(publish.curve_server_key, "publish.curve_server_key")
        else:
            check_exposure(cfg.endpoint, publish.insecure)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._listener = Listener(self._context, zmq.ROUTER, partial(_configure, curve=keys))
        try:
            if keys is not None:
                self._start_authenticator()  # before bind: a CURVE peer is only ever let in by it
            self.endpoint = self._listener.bind(cfg.endpoint)
        except BaseException:
            self.close()
            raise
        log.info("taking inspection requests on %s%s", self.endpoint, " with CURVE" if secure else "")

    def _start_authenticator(self) -> None:
        """The publisher's allow-list, checked by a ZAP handler in this server's own context."""
        self._auth = ThreadAuthenticator(self._context, log=logging.getLogger("edged.auth"))
        try:
            self._auth.start()
        except zmq.ZMQError as e:
            raise PublishError(f"cannot start the CURVE authenticator for trigger.endpoint: {e.strerror}") from None
        self._auth.configure_curve_callback(domain="*", credentials_provider=self._allowed)
        self.reload_client_keys()

    def reload_client_keys(self) -> None:
        """Re-read the publisher's allow-list (SIGHUP); a bad directory raises `KeyFileError`.

        A removed key gets the socket bound afresh, as the publisher does: libzmq authenticates
        a peer only when it connects.
        """
        if self._auth is None or self._clients_dir is None:
            return
        keys = load_allowed_clients(self._clients_dir, "publish.curve_clients_dir")
        revoked = self._allowed.keys - keys
        self._allowed.keys = keys
        if revoked:
            self._listener = self._listener.reopen()

    def next(self, timeout_s: float) -> Request | None:
        """The oldest waiting request, waiting up to ``timeout_s`` for one; None when none came."""
        if not self._waiting and self._listener.socket.poll(int(timeout_s * 1000)):
            self.collect()
        if not self._waiting:
            return None
        self._serving = True
        return self._waiting.popleft()

    def collect(self) -> None:
        """Read every request that has arrived: stamp and queue it, or answer it at once
        (malformed: ``bad_request``; beyond the bound: ``busy``)."""
        while True:
            try:
                frames = self._listener.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            arrived_ns = time.monotonic_ns()
            envelope, payload = tuple(frames[:-1]), frames[-1]
            try:
                part_id = _part_id(payload)
            except MessageError as e:
                self._send(envelope, self.error(None, "bad_request", str(e)))
                continue
            if len(self._waiting) + self._serving >= self._bound:
                self._send(envelope, self.error(part_id, "busy", f"{self._bound} request(s) already in hand"))
                continue
            self._waiting.append(Request(envelope, part_id, arrived_ns))

    def error(self, part_id: str | None, problem: TriggerProblem, detail: str) -> TriggerError:
        return TriggerError(camera_id=self._camera_id, part_id=part_id, error=problem, detail=detail)

    def answer(self, request: Request, reply: VerdictMessage | TriggerError) -> None:
        self._serving = False
        self._send(request.envelope, reply)

    def _send(self, envelope: tuple[bytes, ...], reply: VerdictMessage | TriggerError) -> None:
        try:
            self._listener.socket.send_multipart([*envelope, reply.model_dump_json().encode()], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the requester is gone: nobody is left to tell
            log.warning("trigger reply not sent: %s", e.strerror)

    def close(self) -> None:
        """Tell every request still waiting that edged is stopping, then release the endpoint."""
        self.collect()
        while self._waiting:
            request = self._waiting.popleft()
            self._send(request.envelope, self.error(request.part_id, "stopping", "edged is stopping"))
        self._listener.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._context.term()


def _configure(sock: zmq.Socket[bytes], curve: tuple[bytes, bytes] | None) -> None:
    """Options set before bind: no lingering replies, and the CURVE server keys when secured."""
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey = curve
        sock.curve_server = True


def _part_id(payload: bytes) -> str | None:
    """The part id of a request payload (empty, ``{}`` or ``{"part_id": "..."}``); raises MessageError."""
    if not payload.strip():
        return None
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise MessageError('a request is JSON: {"part_id": "..."}, part id optional') from None
    if not isinstance(data, dict) or set(data) - {"part_id"}:
        raise MessageError('a request is a JSON object with at most one key, "part_id"')
    part_id = data.get("part_id")
    if part_id is not None and (not isinstance(part_id, str) or not 0 < len(part_id) <= MAX_PART_ID):
        raise MessageError(f"part_id must be a string of 1 to {MAX_PART_ID} characters")
    return part_id


# ---- edged trigger ---------------------------------------------------------------------------


def request_verdict(endpoint: str, part_id: str | None, timeout_s: float, curve: ClientKeys | None = None) -> VerdictMessage:
    """Send one request and return its verdict; raises `TriggerFailed` for an error reply or none."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(sock)
        sock.connect(endpoint)
        sock.send(json.dumps({"part_id": part_id} if part_id is not None else {}).encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise TriggerFailed(f"no reply from {endpoint} within {timeout_s:g} s (is edged running in request mode there?)")
        reply = parse_message(sock.recv())
    except MessageError as e:
        raise TriggerFailed(f"the reply from {endpoint} is not an edged verdict: {e}") from None
    finally:
        sock.close(linger=0)
        context.term()
    if isinstance(reply, TriggerError):
        raise TriggerFailed(f"no verdict ({reply.error}): {reply.detail}")
    if not isinstance(reply, VerdictMessage):
        raise TriggerFailed(f"the reply from {endpoint} is a {reply.kind} message, not a verdict")
    return reply


def run_trigger(
    endpoint: str,
    part_id: str | None,
    timeout_s: float,
    *,
    raw_json: bool = False,
    server_key: Path | None = None,
    client_key: Path | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """``edged trigger``: prints the verdict; exits 0 for OK, `EXIT_NG` for NG, raises `TriggerFailed` otherwise."""
    if (server_key is None) != (client_key is None):
        raise UsageError("--server-key and --client-key go together")
    if timeout_s <= 0:
        raise UsageError(f"--timeout must be above 0, got {timeout_s:g}")
    curve = ClientKeys.from_files(server_key, client_key) if server_key and client_key else None
    verdict = request_verdict(endpoint, part_id, timeout_s, curve)
    print(verdict.model_dump_json() if raw_json else format_verdict(verdict), file=out, flush=True)
    return 0 if verdict.verdict == "ok" else EXIT_NG
