"""Publish: ZeroMQ XPUB sockets that fan detections out to any number of subscribers.

Each socket works as a PUB socket whose subscriptions edged applies itself (below). It never
blocks and never grows without bound: each subscriber has a queue of at most ``hwm`` messages
and, once it is full, libzmq drops that subscriber's new messages silently (it does not raise
``zmq.Again``). The publisher therefore cannot see those drops; every message carries a
per-topic ``seq`` so a subscriber sees its own gaps. What the publisher can see (a send error, a
socket that refuses) is counted and never raised into the pipeline.

Security. ipc:// endpoints are protected by the filesystem: the socket file is 0660 in a 0750
directory, so only the service's group can connect. tcp:// endpoints are encrypted and
authenticated with CurveZMQ when ``publish.curve_server_key`` and ``publish.curve_clients_dir``
are set: only subscribers whose public key is in that directory get anything. A ZeroMQ socket
has one security mechanism for all its endpoints, so with keys configured the tcp endpoints get
a CURVE socket of their own and the ipc endpoints stay on a plain one; every message goes to
both. Local consumers need no keys, and nothing on the network is plaintext. Without keys,
tcp on a non-loopback address is refused unless ``publish.insecure`` says otherwise. A key
removed from the allow-list is cut off at the next reload (`Publisher.reload_client_keys`).
Every socket is an `edged.listen.Listener`: size-limited, and never stealing a live ipc path.

Subscriptions. libzmq keeps every subscription a peer sends in a trie with a node per byte, in
the socket's own memory, before the application sees it; thousands of distinct ones grow the
daemon by hundreds of MB. The sockets are therefore XPUB in manual mode: before each send,
edged reads each subscription and applies only those that are a prefix of a topic it publishes
("", "edged/", a full topic); the others are refused and counted. libzmq still holds what a
connected peer sent until that peer goes, so once the refused subscriptions since the socket was
bound add up to `REFUSED_BYTES_BEFORE_REBIND`, or a peer sends something that is not a
subscription at all, the socket is bound afresh, as for a revoked key: every peer is cut off and
honest subscribers reconnect and subscribe again by themselves. A reload that adds or removes
cameras keeps the sockets, so the kept cameras' subscribers miss nothing; only a subscription
refused since the socket was bound that a camera the reload adds now matches has it bound afresh
(libzmq applies a subscription only as it arrives, so its peer must send it again).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
from zmq.auth.thread import ThreadAuthenticator

from edged.config import PublishConfig
from edged.errors import PublishError
from edged.keys import load_allowed_clients, load_secret_key, open_to_others
from edged.listen import Listener, as_bound, try_bind
from edged.lograte import LogRate
from edged.output import Endpoint, MessageKind, MessageOutput, OutputReport, Services
from edged.settings.endpoints import exposure, unresolved

if TYPE_CHECKING:
    from edged.config import Settings
    from edged.journal import JournalOutput

log = logging.getLogger(__name__)

SUBSCRIPTION_HWM = 16  # subscription messages libzmq queues from one peer before it stops reading that peer
READ_AT_MOST = 4096  # subscription messages read before one send, so that no peer can hold the loop
REFUSED_BYTES_BEFORE_REBIND = 64 * 1024  # ~50 bytes of libzmq's trie per byte: about 3 MB held at most
REFUSAL_LOG_INTERVAL_S = 60.0
# How long a source that ends waits for subscribers started before edged: each retries its
# connection every 100 ms (libzmq's reconnect interval), so it subscribes within about that of the
# bind; once one has, the others trying in the same interval are given one more.
SUBSCRIBERS_WAITING_S = 0.5
SUBSCRIBERS_SETTLE_S = 0.15


def detections_topic(prefix: str, camera_id: str) -> bytes:
    return f"{prefix}/detections/{camera_id}".encode()


def status_topic(prefix: str, camera_id: str) -> bytes:
    return f"{prefix}/status/{camera_id}".encode()


def verdict_topic(prefix: str, camera_id: str) -> bytes:
    return f"{prefix}/verdict/{camera_id}".encode()


TOPICS = {"detections": detections_topic, "verdict": verdict_topic, "status": status_topic}


def topics_of(prefix: str, camera_ids: Sequence[str]) -> tuple[bytes, ...]:
    """Every topic edged publishes for its cameras: what a subscription must be a prefix of."""
    return tuple(topic(prefix, camera) for camera in camera_ids for topic in (detections_topic, status_topic, verdict_topic))


def _try_bind(endpoint: str, insecure: bool) -> Callable[[], None]:
    """`Endpoint.bind` of one publish endpoint: refused as `Publisher` refuses it, else bound once."""
    check_exposure(endpoint, insecure)
    return try_bind(endpoint, "publish.endpoints", zmq.XPUB)


def check_exposure(endpoint: str, insecure: bool) -> None:
    """Refuse plaintext tcp on a non-loopback address unless the config says so explicitly, and on a
    name that resolves to nothing now, which may be either once it does (judged again at the next start)."""
    if insecure or (exposed := exposure(endpoint)) is False:
        return
    if exposed is None:
        raise PublishError(f"publish.endpoints: cannot bind {endpoint}: {unresolved(endpoint)}")
    raise PublishError(
        f"{endpoint} would publish unencrypted detections to the network; bind a loopback "
        "address or ipc://, or set publish.insecure = true to accept that"
    )


class AllowList:
    """The subscriber keys the CURVE authenticator admits; replaced whole on reload."""

    def __init__(self) -> None:
        self.keys: frozenset[bytes] = frozenset()

    def callback(self, domain: str, key: bytes) -> bool:
        """zmq.auth's credentials-provider hook: is this Z85 public key allowed?"""
        return key in self.keys


class Authenticator:
    """The CURVE server keys and the ZAP handler of one ZeroMQ context, which admits the subscriber
    keys of ``publish.curve_clients_dir``.

    libzmq asks a context's one ZAP handler about each CURVE peer of any socket in it, as the peer
    connects; the publisher's sockets and the trigger server's share the publisher's authenticator.
    A connected peer is never asked about again, so every socket it serves is told of a key a reload
    removes (`watch`) and is bound afresh. Raises `KeyFileError` for unusable keys and `PublishError`
    when the handler cannot start (``where`` names the socket in that message).
    """

    def __init__(
        self, context: zmq.Context[zmq.Socket[bytes]], server_key: Path, clients_dir: Path, where: str = ""
    ) -> None:
        self.context = context
        self._server_keys = load_secret_key(server_key, "publish.curve_server_key")
        self._clients_dir = clients_dir
        self._allowed = AllowList()
        self._revoked: list[Callable[[int], None]] = []
        self._thread = ThreadAuthenticator(context, log=logging.getLogger("edged.auth"))
        try:
            self._thread.start()
        except zmq.ZMQError as e:
            raise PublishError(f"cannot start the CURVE authenticator{where}: {e.strerror}") from None
        self._thread.configure_curve_callback(domain="*", credentials_provider=self._allowed)
        try:
            self.reload_client_keys()
        except BaseException:
            self.close()
            raise

    @classmethod
    def configured(
        cls, cfg: PublishConfig, context: zmq.Context[zmq.Socket[bytes]], where: str = ""
    ) -> Authenticator | None:
        """The authenticator ``cfg``'s keys call for, or None without them."""
        if cfg.curve_server_key is None or cfg.curve_clients_dir is None:
            return None
        return cls(context, cfg.curve_server_key, cfg.curve_clients_dir, where)

    def serve(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` a CURVE server with these keys, before it binds."""
        sock.curve_publickey, sock.curve_secretkey = self._server_keys
        sock.curve_server = True

    def watch(self, revoked: Callable[[int], None]) -> None:
        """Have ``revoked`` called with how many keys a reload removed, so that its socket is bound afresh."""
        self._revoked.append(revoked)

    def unwatch(self, revoked: Callable[[int], None]) -> None:
        self._revoked.remove(revoked)

    def reload_client_keys(self) -> int:
        """Re-read the allow-list directory; returns how many keys are allowed.

        A directory that fails its check raises `KeyFileError` and leaves the previous allow-list
        in force. When a key was removed, every socket `watch`ing is told.
        """
        keys = load_allowed_clients(self._clients_dir, "publish.curve_clients_dir")
        if (others := open_to_others(self._clients_dir)) is not None:
            log.warning(
                "publish.curve_clients_dir %s may be written by %s: whoever can put a key there lets a subscriber "
                "in at the next reload (chmod go-w %s)",
                self._clients_dir,
                others,
                self._clients_dir,
            )
        revoked = self._allowed.keys - keys
        self._allowed.keys = keys
        if not keys:
            log.warning("no client keys in %s: no subscriber can connect over tcp", self._clients_dir)
        else:
            log.info("CURVE: %d subscriber key(s) allowed from %s", len(keys), self._clients_dir)
        if revoked:
            for tell in list(self._revoked):
                tell(len(revoked))
        return len(keys)

    def close(self) -> None:
        self._thread.stop()


class Publisher(MessageOutput):
    """Binds the configured endpoints and sends multipart [topic, payload] without ever blocking.

    Raises `PublishError` for an endpoint it cannot bind and `KeyFileError` for unusable keys.
    With CURVE it runs the context's ZAP authenticator, so one such publisher per context.
    """

    def __init__(
        self, cfg: PublishConfig, camera_ids: Sequence[str], context: zmq.Context[zmq.Socket[bytes]] | None = None
    ) -> None:
        self.cfg = cfg
        self.drops: Counter[str] = Counter()
        self.sent = 0
        self.endpoints: list[str] = []
        self._topics = topics_of(cfg.topic_prefix, camera_ids)
        self._context = context or zmq.Context.instance()
        self._listeners: dict[bool, Listener] = {}  # keyed by "uses CURVE"
        self._refused_bytes: Counter[bool] = Counter()  # refused subscription bytes since the socket was bound
        self._refused: dict[bool, set[bytes]] = {True: set(), False: set()}  # those a camera's topic could match
        self._camera_topics = topics_of(cfg.topic_prefix, [""])  # what every camera's topic starts with
        self._refusal_log = LogRate(REFUSAL_LOG_INTERVAL_S)  # one per kind of warning: a peer decides how often they come
        self._cut_off_log = LogRate(REFUSAL_LOG_INTERVAL_S)
        self._journal: JournalOutput | None = None  # with it, each verdict waits until recorded (`use_journal`)
        self.auth = Authenticator.configured(cfg, self._context)  # the trigger server's CURVE socket shares it
        try:
            if self.auth is not None:
                self.auth.watch(self._keys_revoked)
            for endpoint in cfg.endpoints:
                self._bind(endpoint)
        except BaseException:
            self._release(linger=0)
            raise

    # ---- as an output (`edged.output`) --------------------------------------------------------

    @classmethod
    def from_settings(cls, settings: Settings, services: Services) -> Publisher:
        """With a source that ends (a file or folder read once), the subscribers already waiting are
        heard first: its frames would all go out before they had connected (`hear_waiting`)."""
        publisher = cls(settings.publish, settings.camera_ids())
        if any(cfg.ends for cfg in settings.source):
            publisher.hear_waiting(SUBSCRIBERS_WAITING_S)
        return publisher

    @classmethod
    def listening(cls, settings: Settings) -> list[Endpoint]:
        cfg = settings.publish
        return [Endpoint("publish.endpoints", ep, partial(_try_bind, ep, cfg.insecure)) for ep in cfg.endpoints]

    @property
    def publish_empty(self) -> bool:
        return self.cfg.publish_empty

    def deliver(self, kind: MessageKind, camera_id: str, payload: bytes) -> None:
        """A verdict goes out once the journal has it, if there is one (`JournalOutput.after_recorded`)."""
        topic = TOPICS[kind](self.cfg.topic_prefix, camera_id)
        if kind == "verdict" and self._journal is not None:
            self._journal.after_recorded(partial(self.send, topic, payload))
        else:
            self.send(topic, payload)

    def use_journal(self, journal: JournalOutput | None) -> None:
        self._journal = journal

    def report(self, camera_id: str) -> OutputReport:
        return OutputReport(drops=self.drops)

    def reread_secrets(self) -> None:
        self.reload_client_keys()

    def reload(self, settings: Settings, services: Services) -> Publisher:
        """The endpoints stay bound as they are (`edged.reload` keeps ``[publish]``); the topics follow the cameras."""
        self.follow_cameras(settings.camera_ids())
        return self

    def _secure(self, endpoint: str) -> bool:
        return self.auth is not None and endpoint.startswith("tcp://")

    def _configure(self, sock: zmq.Socket[bytes], auth: Authenticator | None) -> None:
        """Options set before bind; the CURVE authenticator is already running."""
        sock.setsockopt(zmq.XPUB_MANUAL, 1)
        sock.setsockopt(zmq.RCVHWM, SUBSCRIPTION_HWM)
        sock.setsockopt(zmq.SNDHWM, self.cfg.hwm)
        sock.setsockopt(zmq.LINGER, self.cfg.linger_ms)
        if auth is not None:
            auth.serve(sock)

    def _listener_for(self, secure: bool) -> Listener:
        if secure not in self._listeners:
            configure = partial(self._configure, auth=self.auth if secure else None)
            self._listeners[secure] = Listener(self._context, zmq.XPUB, configure, "publish.endpoints")
        return self._listeners[secure]

    def reload_client_keys(self) -> int:
        """Re-read the allow-list directory after subscribers' keys were added or removed.

        Returns how many keys are allowed; a directory that fails its check raises
        `KeyFileError` and leaves the previous allow-list in force. When a key was removed, the
        CURVE sockets (this one, and the trigger server's) are bound afresh: libzmq authenticates
        a peer only when it connects, so this is what cuts a revoked subscriber off. The others
        reconnect by themselves, and see the messages sent meanwhile as a gap in ``seq``.
        """
        return 0 if self.auth is None else self.auth.reload_client_keys()

    def _keys_revoked(self, revoked: int) -> None:
        if True in self._listeners:
            endpoints = self._rebind(True)
            log.warning(
                "%d subscriber key(s) revoked: %s bound afresh, so every subscriber authenticates again",
                revoked,
                endpoints,
            )

    def follow_cameras(self, camera_ids: Sequence[str]) -> None:
        """A reload changed the cameras: their topics are the ones subscriptions may match from now on.

        The sockets stay bound, subscribers and their queues with them; a socket that refused a
        subscription an added camera's topic now matches is bound afresh, so that its peer sends it again.
        """
        topics = topics_of(self.cfg.topic_prefix, camera_ids)
        if topics == self._topics:
            return
        self._topics = topics
        for secure in list(self._listeners):
            if any(ours.startswith(topic) for topic in self._refused[secure] for ours in topics):
                cameras = ", ".join(camera_ids)
                log.info(
                    "cameras are now %s: %s bound afresh, for the subscriptions refused until now",
                    cameras,
                    self._rebind(secure),
                )

    def _rebind(self, secure: bool) -> str:
        """The socket for ``secure`` closed and bound afresh; returns its endpoints, for the log."""
        listener = self._listeners.pop(secure)
        self._listeners[secure] = listener.reopen()
        self._refused_bytes[secure] = 0
        self._refused[secure].clear()
        return ", ".join(listener.endpoints)

    def _bind(self, endpoint: str) -> None:
        secure = self._secure(endpoint)
        if not secure:
            check_exposure(endpoint, self.cfg.insecure)
        bound = self._listener_for(secure).bind(endpoint)
        self.endpoints.append(bound)
        log.info("publishing on %s%s", as_bound(endpoint, bound), " with CURVE" if secure else "")

    def send(self, topic: bytes, payload: bytes) -> bool:
        """Queue one message for every subscriber; False (and counted) when it could not go out.

        The subscriptions peers sent since the last send are applied (or refused) first.
        """
        results = []
        for secure in list(self._listeners):
            self._read_subscriptions(secure)
            results.append(self._send_on(self._listeners[secure].socket, topic, payload))
        if all(results):
            self.sent += 1
        return all(results)

    def hear_waiting(self, timeout_s: float) -> int:
        """Wait at most ``timeout_s`` for subscribers trying to connect, applying their subscriptions:
        once one has subscribed, until `SUBSCRIBERS_SETTLE_S` passes with no other. Returns how many
        subscriptions were applied. An ``edged subscribe`` started before ``edged run`` then sees
        the first frame of a folder read as fast as the model goes, not only what came after it connected."""
        heard = 0
        end = deadline = time.monotonic() + timeout_s
        while (left_s := deadline - time.monotonic()) > 0:
            poller = zmq.Poller()  # made afresh: a peer's garbage has a socket bound anew
            for listener in self._listeners.values():
                poller.register(listener.socket, zmq.POLLIN)
            if not poller.poll(max(1, round(left_s * 1000))):
                break
            got = sum(self._read_subscriptions(secure) for secure in list(self._listeners))
            if got:
                deadline = min(end, time.monotonic() + SUBSCRIBERS_SETTLE_S)
            heard += got
        log.debug("heard %d subscription(s) before the first frame", heard)
        return heard

    def _read_subscriptions(self, secure: bool) -> int:
        """Apply the subscriptions that can match a topic of ours, refuse the rest (module docstring).

        In manual mode libzmq hands each (un)subscription up in the order the peers sent them,
        and applies ``ZMQ_SUBSCRIBE`` / ``ZMQ_UNSUBSCRIBE`` to the peer of the one read last. A
        peer has at most `SUBSCRIPTION_HWM` of them waiting between two sends; libzmq stops
        reading that peer's connection until they are read, so what waits in libzmq's list of
        subscriptions to hand up is what the peers sent since the last send, and no more than
        `READ_AT_MOST` are read before the message goes out. Returns the subscriptions applied.
        """
        sock = self._listeners[secure].socket
        applied = 0
        for _ in range(READ_AT_MOST):
            try:
                if not sock.poll(0):
                    return applied
                request = sock.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                return applied  # the send that follows counts what is wrong with the socket
            kind, topic = request[:1], request[1:]
            if kind not in (b"\x00", b"\x01"):
                # A message, not a subscription, which libzmq does not record against its peer:
                # which peer the next subscription came from is no longer known.
                self.drops["subscription_refused"] += 1
                self._cut_off(secure, "a peer sent a message that is not a subscription")
                return applied
            if any(ours.startswith(topic) for ours in self._topics):
                sock.setsockopt(zmq.SUBSCRIBE if kind == b"\x01" else zmq.UNSUBSCRIBE, topic)
                applied += kind == b"\x01"
            elif kind == b"\x01":  # unsubscribing from a refused topic: libzmq has already forgotten it
                self._refuse(topic)
                if topic.startswith(self._camera_topics):  # a camera a reload adds may match it: kept, at most 64 KiB
                    self._refused[secure].add(topic)
                self._refused_bytes[secure] += len(topic)
                if self._refused_bytes[secure] >= REFUSED_BYTES_BEFORE_REBIND:
                    self._cut_off(secure, f"{REFUSED_BYTES_BEFORE_REBIND // 1024} KiB of subscriptions that match no topic")
                    return applied
        return applied

    def _refuse(self, request: bytes) -> None:
        self.drops["subscription_refused"] += 1
        shown = request[:64] + (b"..." if len(request) > 64 else b"")
        self._now_and_then(self._refusal_log, "refused a subscription to %r: edged publishes no topic it matches", shown)

    def _cut_off(self, secure: bool, why: str) -> None:
        self._now_and_then(
            self._cut_off_log, "%s: %s bound afresh, so every subscriber reconnects", why, self._rebind(secure)
        )

    def _now_and_then(self, rate: LogRate, message: str, *args: object) -> None:
        """A warning as often as ``rate`` allows (each kind has its own), with the count of refusals so far."""
        if rate.allows():
            log.warning(
                "%s (%d subscription(s) refused so far; logged at most once a minute)",
                message % args,
                self.drops["subscription_refused"],
            )

    def _send_on(self, sock: zmq.Socket[bytes], topic: bytes, payload: bytes) -> bool:
        try:
            sock.send_multipart((topic, payload), flags=zmq.NOBLOCK, copy=True)
        except zmq.Again:
            self.drops["publish_full"] += 1
            return False
        except zmq.ZMQError as e:
            self.drops["publish_error"] += 1
            if self.drops["publish_error"] == 1:
                log.error("publishing failed: %s (further failures are only counted)", e.strerror)
            return False
        return True

    def close(self) -> None:
        """Flush what is queued for at most ``linger_ms``, then release the endpoints."""
        self._release(linger=self.cfg.linger_ms)

    def _release(self, linger: int) -> None:
        for listener in self._listeners.values():
            listener.close(linger=linger)
        self._listeners.clear()
        if self.auth is not None:
            self.auth.close()
            self.auth = None
