"""Triggered inspection (``trigger.mode = "request"``): the request socket, and ``edged trigger``.

A request is a ZeroMQ message ``{"part_id": "...", "camera_id": "..."}`` (`edged.messages.TriggerRequest`:
both optional, the camera only while one camera takes requests) on a REP/ROUTER endpoint; the
daemon answers with the `VerdictMessage` of a frame of that camera captured after the request
arrived, or a `TriggerError` saying why not. `TriggerServer` owns the ROUTER socket: it stamps each
request with its arrival time as it reads it, routes it to its camera, keeps each camera's waiting
requests in order, at most ``trigger.queue`` behind the one in hand, and answers at once what it
cannot queue (malformed, no such camera, busy), so no requester ever hangs. The daemon loop waits
on `TriggerServer.fds`, reads with `collect` and takes each camera's next request with `next`
(`edged.daemon`): the loop alone touches the socket, which is bound as every socket edged binds
(`edged.listen.Listener`: a message-size limit, no taking over a live ipc path).

With ``[mqtt]`` requests also arrive on the broker's ``PREFIX/CAMERA/trigger`` topic of every
camera in request mode (`attach`): the MQTT thread checks and stamps each as it arrives and hands
it over through a small locked queue with a wake-up socket, so the loop takes requests from all
in the order they arrived, under the one bound per camera. Server outputs (a PLC's protocols)
hand theirs over the same way (`offer`), each with the callable that takes its reply. The topic names the camera; a payload
that names another is malformed. The verdict goes out on the verdict topic as every verdict does;
an error goes to ``PREFIX/CAMERA/trigger/error``, so that the verdict topic carries verdicts alone.
A malformed payload there has nobody to answer: it is counted (``mqtt_drops.trigger``) and logged
once per burst.

Security: a tcp endpoint takes the publisher's CURVE server key and allow-list when
``publish.curve_*`` are set (the daemon's joins the publisher's context and is served by its
`edged.publish.Authenticator`; one made alone has its own). Without
keys, a tcp endpoint other machines can reach is refused when the configuration loads
(`edged.config.Settings`) unless ``trigger.insecure`` accepts it: anyone there could trigger
inspections and read their verdicts. ``publish.insecure`` opens the stream only.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TextIO

import zmq
from pydantic import ValidationError

from edged.config import PublishConfig, Settings, TriggerConfig
from edged.errors import MessageError, TriggerFailed, UsageError
from edged.keys import ClientKeys
from edged.listen import Listener, as_bound, socket_with_room, try_bind
from edged.messages import (
    TriggerError,
    TriggerProblem,
    TriggerRequest,
    VerdictMessage,
    for_terminal,
    parse_message,
    parse_request,
)
from edged.mqtt import MqttOutput
from edged.output import Endpoint
from edged.publish import Authenticator
from edged.settings.endpoints import by_name, connect_ipv6, look_up, with_address
from edged.subscribe import format_verdict
from edged.wake import Wake

log = logging.getLogger(__name__)

MALFORMED_BURST_S = 10.0  # malformed requests from the broker this close together are one burst, one log line
EXIT_NG = 3  # `edged trigger`: 0 is OK, 3 NG, 1 no verdict (an error reply or none)
# Requests read from the socket per `TriggerServer.collect`: the rest of a flood waits in libzmq's
# bounded queue (its receive high-water mark, then TCP's flow control) for the loop's next turn,
# rather than holding the loop, its frames, status and stop, while the list of them grows unbounded.
READ_PER_COLLECT = 100


Answer = Callable[[VerdictMessage | TriggerError], None]


@dataclass(frozen=True, slots=True)
class Request:
    """One request: where it came from and the reply goes, the camera it asks for, its part id, and
    when it was read (monotonic ns).

    ``origin`` names what brought it: "zmq" (the request socket: the reply goes to ``envelope``),
    "mqtt", or the output that `TriggerServer.offer` ed it, whose ``answer`` takes the reply.
    """

    origin: str
    envelope: tuple[bytes, ...]  # the ROUTER's routing frames; none for a request from elsewhere
    camera_id: str
    part_id: str | None
    arrived_ns: int
    answer: Answer | None = None  # how an offered request's reply goes back (`TriggerServer.offer`)


class Inbox:
    """Requests from other threads (MQTT's, a server output's) to the loop: bounded, locked, with a
    `Wake` the loop's wait ends on."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._requests: deque[Request] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self.wake = Wake()

    def put(self, request: Request) -> bool:
        """Queue ``request``; False when ``limit`` are already waiting for the loop, or once closed."""
        with self._lock:
            if self._closed or len(self._requests) >= self.limit:
                return False
            self._requests.append(request)
            self.wake.set()
        return True

    def take(self) -> list[Request]:
        """Every request queued so far, oldest first."""
        with self._lock:
            self.wake.clear()
            requests = list(self._requests)
            self._requests.clear()
        return requests

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.wake.close()


class TriggerServer:
    """The ROUTER socket requests arrive on, and per camera in request mode the ordered, bounded
    list of those waiting and the one in hand.

    Raises `PublishError` for an endpoint it cannot bind, `KeyFileError` for unusable keys.
    """

    def __init__(
        self, cfg: TriggerConfig, publish: PublishConfig, camera_ids: Sequence[str], auth: Authenticator | None = None
    ) -> None:
        """``camera_ids``: the cameras in request mode, in config order. ``auth``: the publisher's
        (`Publisher.auth`), whose context the socket joins; without it a tcp endpoint with keys
        configured gets an authenticator of its own, in a context of its own."""
        self._bound = cfg.queue + 1  # per camera: the one in hand and those behind it
        self._cameras: tuple[str, ...] = ()
        self._waiting: dict[str, deque[Request]] = {}
        self._in_hand: dict[str, Request] = {}  # by camera: handed out by `next`, not yet answered
        self._inbox = Inbox(self._bound)
        self._mqtt: MqttOutput | None = None
        self._stopping = False
        self._malformed_at_ns = -int(MALFORMED_BURST_S * 1e9)  # the last malformed request from the broker
        self.follow_cameras(camera_ids)
        self._shared = auth is not None  # the context and authenticator are the publisher's
        self._context: zmq.Context[zmq.Socket[bytes]] = auth.context if auth is not None else zmq.Context()
        self._own_auth: Authenticator | None = None
        tcp = cfg.endpoint.startswith("tcp://")
        try:
            if tcp and auth is None:  # before bind: a CURVE peer is only ever let in by it
                auth = self._own_auth = Authenticator.configured(publish, self._context, " for trigger.endpoint")
            self._auth = auth if tcp else None
        except BaseException:
            if not self._shared:
                self._context.term()
            raise
        self._listener = Listener(self._context, zmq.ROUTER, partial(_configure, auth=self._auth), "trigger.endpoint")
        try:
            if self._auth is not None:
                self._auth.watch(self._keys_revoked)
            self.endpoint = self._listener.bind(cfg.endpoint)
        except BaseException:
            self.close()
            raise
        log.info(
            "taking inspection requests for camera %s on %s%s",
            ", ".join(self._cameras),
            as_bound(cfg.endpoint, self.endpoint),
            " with CURVE" if self._auth is not None else "",
        )

    @classmethod
    def listening(cls, settings: Settings) -> list[Endpoint]:
        """``trigger.endpoint`` when a camera takes requests: what ``edged check`` binds and releases."""
        if not settings.requesting():
            return []
        endpoint = settings.trigger.endpoint  # its exposure is the configuration's to refuse
        return [Endpoint("trigger.endpoint", endpoint, partial(try_bind, endpoint, "trigger.endpoint", zmq.ROUTER))]

    def _keys_revoked(self, revoked: int) -> None:
        """A reload removed keys: the socket is bound afresh, as the publisher's is."""
        self._listener = self._listener.reopen()

    def follow_cameras(self, camera_ids: Sequence[str]) -> None:
        """Take requests for ``camera_ids`` from now on (at start and after a reload).

        Requests waiting for a camera no longer among them are answered ``bad_request`` at once;
        one in hand is the loop's to answer. The broker's trigger topics follow too.
        """
        self._cameras = tuple(camera_ids)
        for camera_id in [c for c in self._waiting if c not in self._cameras]:
            for request in self._waiting.pop(camera_id):
                self.reply(request, self.error(request, "bad_request", f"camera {camera_id} no longer takes requests"))
        for camera_id in self._cameras:
            self._waiting.setdefault(camera_id, deque())
        self._inbox.limit = self._bound * len(self._cameras)
        if self._mqtt is not None:
            self._mqtt.take_requests(self._offer, self._cameras)

    def attach(self, mqtt: MqttOutput) -> None:
        """Take requests from the broker too, and send their errors there (at start and after a reload)."""
        self._mqtt = mqtt
        mqtt.take_requests(self._offer, self._cameras)

    @property
    def fds(self) -> list[zmq.Socket[bytes] | Wake]:
        """What the loop's ``zmq.select`` waits on for requests to arrive: the socket, and the inbox of
        those from other threads."""
        return [self._listener.socket, self._inbox.wake]

    def _offer(self, camera_id: str, payload: bytes) -> bool:
        """On the MQTT thread: stamp and queue one request from camera ``camera_id``'s trigger topic,
        or say why not.

        Returns False for a malformed payload (the output counts it), logged once per burst;
        beyond the bound, or once edged is stopping, the error goes straight back to the broker.
        Not `edged.lograte.LogRate`, which logs again amid a steady stream: a burst ends with `MALFORMED_BURST_S` of quiet.
        """
        arrived_ns = time.monotonic_ns()
        try:
            asked = parse_request(payload)
            if asked.camera_id not in (None, camera_id):
                raise MessageError(f"camera_id {asked.camera_id!r} on the trigger topic of camera {camera_id}")
        except MessageError as e:
            if arrived_ns - self._malformed_at_ns > MALFORMED_BURST_S * 1e9:
                log.warning(
                    "MQTT trigger skipped: %s (counted in mqtt_drops.trigger; more within %g s of one another unlogged)",
                    e,
                    MALFORMED_BURST_S,
                )
            self._malformed_at_ns = arrived_ns
            return False
        request = Request("mqtt", (), camera_id, asked.part_id, arrived_ns)
        if self._stopping:
            self._refuse(request, "stopping", "edged is stopping")
        elif not self._inbox.put(request):
            self._refuse(request, "busy", f"{self._inbox.limit} request(s) from the broker not yet taken")
        return True

    def offer(self, origin: str, camera_id: str, part_id: str | None, answer: Answer) -> None:
        """From any thread (a server output's, `Output.carry_requests`): stamp and queue a request for
        ``camera_id``, whose reply goes to ``answer``.

        ``answer`` is called once, without blocking: on the loop's thread with the verdict or the
        reason there is none, or here at once when the request is refused on arrival (beyond the
        bound, or edged is stopping). A camera that takes no requests is refused by `collect`.
        """
        request = Request(origin, (), camera_id, part_id, time.monotonic_ns(), answer)
        if self._stopping:
            self._refuse(request, "stopping", "edged is stopping")
        elif not self._inbox.put(request):
            self._refuse(request, "busy", f"{self._inbox.limit} request(s) from outside not yet taken")

    def collect(self) -> None:
        """Take the requests that have arrived, from the socket (at most `READ_PER_COLLECT`: a flood is
        read over the loop's next turns) and the broker, in arrival order: queue each behind its
        camera's, or answer it at once (malformed, or no camera of this server: ``bad_request``;
        beyond the camera's bound: ``busy``)."""
        arrived = self._read_socket() + self._inbox.take()
        arrived.sort(key=lambda request: request.arrived_ns)
        for request in arrived:
            waiting = self._waiting.get(request.camera_id)
            if waiting is None:
                self._refuse(request, "bad_request", self._unknown(request.camera_id))
            elif len(waiting) + (request.camera_id in self._in_hand) >= self._bound:
                self._refuse(request, "busy", f"{self._bound} request(s) for camera {request.camera_id} already in hand")
            else:
                waiting.append(request)

    def _read_socket(self) -> list[Request]:
        """The requests waiting on the socket, at most `READ_PER_COLLECT`, stamped as read; one that
        is malformed or names no camera while several take requests is answered here."""
        requests: list[Request] = []
        for _ in range(READ_PER_COLLECT):
            try:
                frames = self._listener.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            arrived_ns = time.monotonic_ns()
            envelope, body = _split(frames)
            only = self._cameras[0] if len(self._cameras) == 1 else ""
            try:
                if len(body) != 1:
                    raise MessageError(f"a request is one message part, not {len(body)}")
                asked = parse_request(body[0])
            except MessageError as e:
                self._send(envelope, TriggerError(camera_id=only, part_id=None, error="bad_request", detail=str(e)))
                continue
            camera_id = asked.camera_id or only
            if not camera_id:
                detail = f"name the camera: {self._unknown('')}"
                self._send(envelope, TriggerError(camera_id="", part_id=asked.part_id, error="bad_request", detail=detail))
                continue
            requests.append(Request("zmq", envelope, camera_id, asked.part_id, arrived_ns))
        return requests

    def _unknown(self, camera_id: str) -> str:
        """Why a request for ``camera_id`` is not taken, naming the cameras that are."""
        cameras = ", ".join(self._cameras) or "none"
        return f"camera_id {camera_id!r} does not take requests here; the cameras that do: {cameras}"

    def in_hand(self, camera_id: str) -> Request | None:
        """The request handed out for ``camera_id`` and not yet answered."""
        return self._in_hand.get(camera_id)

    def next(self, camera_id: str) -> Request | None:
        """The oldest request waiting for ``camera_id``, now in hand until `answer`; None when none waits.

        A camera has at most one request in hand: asking again before answering it is a bug.
        """
        assert camera_id not in self._in_hand, f"camera {camera_id} already has a request in hand"
        waiting = self._waiting.get(camera_id)
        if not waiting:
            return None
        request = self._in_hand[camera_id] = waiting.popleft()
        return request

    def error(self, request: Request, problem: TriggerProblem, detail: str) -> TriggerError:
        return TriggerError(camera_id=request.camera_id, part_id=request.part_id, error=problem, detail=detail)

    def answer(self, request: Request, reply: VerdictMessage | TriggerError) -> None:
        """Reply to the request in hand for its camera, which may then take the next."""
        self.release(request)
        self.reply(request, reply)

    def release(self, request: Request) -> None:
        """The request in hand for its camera is answered, or will be (`reply`): the camera may take the next."""
        del self._in_hand[request.camera_id]

    def _refuse(self, request: Request, problem: TriggerProblem, detail: str) -> None:
        """Answer a request refused on arrival; one from the broker in the refusals' own bounded line
        (`edged.mqtt.Outbox.put_refusal`), so that a flood of requests never displaces an answer."""
        reply = self.error(request, problem, detail)
        if request.answer is not None:
            request.answer(reply)
        elif request.origin == "zmq":
            self._send(request.envelope, reply)
        elif self._mqtt is not None:
            self._mqtt.refuse(reply.model_dump_json().encode(), request.camera_id)

    def reply(self, request: Request, reply: VerdictMessage | TriggerError) -> None:
        """To the requester's socket; to the broker only an error, the verdict having gone out on
        the verdict topic with the frame's other messages; to an offered request's ``answer``."""
        if request.answer is not None:
            request.answer(reply)
        elif request.origin == "zmq":
            self._send(request.envelope, reply)
        elif isinstance(reply, TriggerError) and self._mqtt is not None:
            self._mqtt.send("trigger/error", reply.model_dump_json().encode(), request.camera_id)

    def _send(self, envelope: tuple[bytes, ...], reply: VerdictMessage | TriggerError) -> None:
        try:
            self._listener.socket.send_multipart([*envelope, reply.model_dump_json().encode()], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the requester is gone: nobody is left to tell
            log.warning("trigger reply not sent: %s", e.strerror)

    def close(self) -> None:
        """Tell every request in hand or still waiting, and any from the broker after, that edged is
        stopping; then release the endpoint."""
        self._stopping = True
        self.collect()
        unanswered = [*self._in_hand.values(), *(request for waiting in self._waiting.values() for request in waiting)]
        self._in_hand.clear()
        for waiting in self._waiting.values():
            waiting.clear()
        for request in sorted(unanswered, key=lambda request: request.arrived_ns):
            self.reply(request, self.error(request, "stopping", "edged is stopping"))
        self._inbox.close()
        self._listener.close(linger=0)
        if self._auth is not None:
            self._auth.unwatch(self._keys_revoked)
        if self._own_auth is not None:
            self._own_auth.close()
        if not self._shared:
            self._context.term()


def _split(frames: list[bytes]) -> tuple[tuple[bytes, ...], list[bytes]]:
    """A message the ROUTER read, as its envelope (the routing frames: up to and with the first empty
    one, which a REQ client or a proxy puts there; the peer's identity alone from a DEALER that puts
    none) and its body. A body of several parts is no request: taking its last part would inspect
    one part id of several, and send the others back to the client as routing frames."""
    end = frames.index(b"", 1) + 1 if b"" in frames[1:-1] else 1
    return tuple(frames[:end]), frames[end:]


def _configure(sock: zmq.Socket[bytes], auth: Authenticator | None) -> None:
    """Options set before bind: no lingering replies, and the CURVE server keys when secured."""
    sock.setsockopt(zmq.LINGER, 0)
    if auth is not None:
        auth.serve(sock)


# ---- edged trigger ---------------------------------------------------------------------------


def request_verdict(
    endpoint: str, request: TriggerRequest, timeout_s: float, curve: ClientKeys | None = None
) -> VerdictMessage:
    """Send one request and return its verdict; raises `TriggerFailed` for an error reply or none."""
    deadline = time.monotonic() + timeout_s
    address = _address(endpoint, timeout_s)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = socket_with_room(context, zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, int(connect_ipv6(address)))
        if curve is not None:
            curve.apply(sock)
        sock.connect(address)
        sock.send(request.model_dump_json(exclude_none=True).encode())
        if not sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            raise TriggerFailed(f"no reply from {endpoint} within {timeout_s:g} s (is edged running in request mode there?)")
        reply = parse_message(sock.recv())
    except MessageError as e:
        raise TriggerFailed(f"the reply from {endpoint} is not an edged verdict: {e}") from None
    finally:
        sock.close(linger=0)
        context.term()
    if isinstance(reply, VerdictMessage | TriggerError) and not _answers(reply, request):
        raise TriggerFailed(
            f"the reply from {endpoint} is for {for_terminal(_naming(reply.camera_id, reply.part_id))}, "
            f"not {_naming(request.camera_id, request.part_id)}: "
            "something other than edged's request server answers there, or it mixed up its requests"
        )
    if isinstance(reply, TriggerError):  # the reply's words, as a terminal may be given them
        raise TriggerFailed(f"no verdict ({reply.error}): {for_terminal(reply.detail)}")
    if not isinstance(reply, VerdictMessage):
        raise TriggerFailed(f"the reply from {endpoint} is a {reply.kind} message, not a verdict")
    return reply


def _address(endpoint: str, timeout_s: float) -> str:
    """``endpoint`` as connected to: a host name looked up here, within ``timeout_s``, and one of its
    addresses connected to. libzmq would look it up in its I/O thread, where a resolver that does not
    answer holds the command past its timeout, however short, as it closes."""
    if (host := by_name(endpoint)) is None:
        return endpoint
    found = look_up(host, timeout_s)
    if isinstance(found, str):
        raise TriggerFailed(f"cannot reach {endpoint}: {found}")
    # Its IPv4 address where it has one, as edged binds a name (`edged.listen.Listener`): localhost is
    # ::1 first in the resolver's order, and edged's tcp://localhost:5557 listens on 127.0.0.1.
    return with_address(endpoint, next((a for a in found if ":" not in a), found[0]))


def _answers(reply: VerdictMessage | TriggerError, request: TriggerRequest) -> bool:
    """Whether ``reply`` is for ``request``: its part, and its camera where the request named one. A
    verdict for another part would pass or fail the wrong part."""
    return reply.part_id == request.part_id and request.camera_id in (None, reply.camera_id)


def _naming(camera_id: str | None, part_id: str | None) -> str:
    camera = f"camera {camera_id}" if camera_id is not None else "any camera"
    return f"{camera} part {part_id if part_id is not None else '(none)'}"


def run_trigger(
    endpoint: str,
    part_id: str | None,
    timeout_s: float,
    *,
    camera_id: str | None = None,
    raw_json: bool = False,
    server_key: Path | None = None,
    client_key: Path | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """``edged trigger``: prints the verdict; exits 0 for OK, `EXIT_NG` for NG, raises `TriggerFailed` otherwise.

    A part id or camera the daemon would refuse is a `UsageError` here, before anything is sent.
    """
    if timeout_s <= 0:
        raise UsageError(f"--timeout must be above 0, got {timeout_s:g}")
    try:
        request = TriggerRequest(part_id=part_id, camera_id=camera_id)
    except ValidationError as e:
        problem = e.errors()[0]
        option = {"part_id": "--part-id", "camera_id": "--camera"}[str(problem["loc"][0])]
        why = problem["ctx"]["error"] if problem["type"] == "value_error" else problem["msg"]
        raise UsageError(f"{option}: {why}") from None
    curve = ClientKeys.from_options(server_key, client_key)
    verdict = request_verdict(endpoint, request, timeout_s, curve)
    print(verdict.model_dump_json() if raw_json else format_verdict(verdict), file=out, flush=True)
    return 0 if verdict.verdict == "ok" else EXIT_NG
