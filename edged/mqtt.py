"""MQTT output: the same messages as the ZeroMQ stream, handed to a broker for a fleet's dashboards.

A peer of `edged.publish`, never a replacement: the daemon gives it each message's JSON bytes and
it owns everything else. The frame loop only appends to a bounded outbox (`Outbox`); one thread
owns the paho client, connects, reconnects with capped exponential backoff and jitter, and hands
messages over while the broker is there. Disconnected, the outbox keeps at most ``max_queued``
messages, events before detections, and drops the oldest beyond that, counted per topic; only
the newest status of each camera waits, as the broker retains only the last one anyway. With the
journal on, verdicts skip the outbox: they go out from the journal (`edged.replay`), so none is
lost to an outage. Replies to trigger requests refused on arrival (``busy``, ...) wait in a
bounded line of their own, so that a flood of requests never pushes a verdict, a detection or a
request's answer out.
One output, one connection, serves every camera of the board; each camera has its own topics.

Topics, under ``topic_prefix`` (default ``edged/<hostname>``)::

    PREFIX/state              online / offline, retained; offline is also the Last Will
    PREFIX/CAMERA/detections  each processed frame (qos_detections)
    PREFIX/CAMERA/status      the status message, retained (qos_events); cleared when a reload removes the camera
    PREFIX/CAMERA/verdict     an inspection verdict (qos_events)
    PREFIX/CAMERA/trigger     subscribed for each camera in request mode: a trigger request, as on ZeroMQ (qos_events)
    PREFIX/CAMERA/trigger/error  why a request from the broker got no verdict (qos_events)

A trigger's payload goes, with the camera its topic names, to the handler `take_requests` was
given, on this output's thread; the handler queues it and returns at once (`edged.trigger`), so
the broker connection never waits for an inspection. The subscriptions follow the cameras the
handler was last given (a reload changes them on the live connection) and are made again on
every connection, as a clean session ends them: a trigger sent while edged is disconnected is
not seen (the requester's timeout covers it, and an inspection long after its part has passed
would be of the wrong part anyway). paho reads through `PacketCap`, which discards a payload over
`MAX_TRIGGER_BYTES` as it arrives (counted as `TOO_LARGE`), so no publisher decides what edged allocates.

paho-mqtt (2.x) is an optional dependency, imported only when a configuration has ``[mqtt]``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import socket
import ssl
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from edged.backoff import Backoff
from edged.errors import BrokerError, EdgedError, KeyFileError, MissingDependency
from edged.keys import check_secret_file
from edged.lograte import LogRate
from edged.output import MessageKind, MessageOutput, OutputReport, Services
from edged.settings.endpoints import address_of
from edged.settings.mqtt import MqttConfig
from edged.wake import Wake, ready

if TYPE_CHECKING:
    from edged.config import Settings
    from edged.journal import JournalOutput
    from edged.replay import VerdictFeed
    from edged.trigger import TriggerServer

log = logging.getLogger(__name__)

Kind = Literal["detections", "status", "verdict", "trigger/error"]
KINDS: tuple[Kind, ...] = ("detections", "status", "verdict", "trigger/error")
TRIGGER = "trigger"  # the topic requests arrive on, and their drops' key: those refused unread
REFUSALS = "refusals"  # the drops' key of replies to requests refused on arrival (busy, ...) beyond their bound
MAX_REFUSALS = 100  # such replies waiting for the broker: a flood of requests fills this, never the outbox
MqttState = Literal["connected", "disconnected"]

BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0
CONNECT_TIMEOUT_S = 5.0  # one TCP connect plus TLS handshake; the thread alone waits for it
CLOSE_TIMEOUT_S = 0.5  # at stop, how long the last status and the offline state may take to go out
INFLIGHT = 20  # QoS 1/2 messages handed to paho and not yet acknowledged
LOG_EVERY_N_FAILURES = 10  # the same failure again is logged once per this many attempts
MAX_TRIGGER_BYTES = 1024  # a trigger's payload is a few dozen bytes; ZeroMQ's requests are capped the same
READ_BYTES = 1 << 16  # what `PacketCap` reads from the socket at once
TOO_LARGE = "mqtt_too_large"  # the status drop counting messages `PacketCap` cut
TOO_LARGE_LOG_INTERVAL_S = 60.0
CUT_TOPIC = "+"  # the topic of a message `PacketCap` cut: no broker delivers a topic with a wildcard
PUBLISH = 3  # the MQTT packet type of a message
TICK_S = 1.0  # the thread comes round at least this often (keepalive pings, stop)


# How to get paho 2 where edged runs. edged is not on PyPI, and Debian 12's pip refuses to install
# into the system's Python (PEP 668): into a checkout's virtualenv, or into the .deb's own.
INSTALL_PAHO = (
    "in a checkout, .venv/bin/python -m pip install -e '.[mqtt]'; with the .deb, "
    "sudo apt install python3-paho-mqtt where it is 2.x (Debian 13 and later), else (Debian 12, "
    "Raspberry Pi OS bookworm: 1.6) sudo pip --python /usr/lib/edged/venv/bin/python install 'paho-mqtt>=2,<3'"
)


def load_paho() -> ModuleType:
    """paho's client module (2.x), or `MissingDependency` saying how to install it."""
    try:
        client = importlib.import_module("paho.mqtt.client")
        version = importlib.import_module("paho.mqtt").__version__
    except ImportError as e:
        raise MissingDependency(
            f"an [mqtt] section needs paho-mqtt 2.x, which this Python cannot import ({e}): {INSTALL_PAHO}"
        ) from e
    if not str(version).startswith("2."):
        raise MissingDependency(f"an [mqtt] section needs paho-mqtt 2.x, this Python has {version}: {INSTALL_PAHO}")
    return client


def broker_problems(cfg: MqttConfig) -> list[str]:
    """What would stop the output from ever connecting, one line each, reported when the config loads."""
    problems = []
    try:
        load_paho()
    except MissingDependency as e:
        problems.append(f"mqtt: {e}")
    for key in ("ca_file", "cert_file"):
        path = getattr(cfg, key)
        if path is None:
            continue
        try:
            directory, missing = path.is_dir(), not path.is_file()
        except OSError as e:  # e.g. a name too long for the filesystem
            problems.append(f"mqtt.{key}: cannot read {path}: {e.strerror}")
            continue
        if directory:
            problems.append(f"mqtt.{key}: {path} is a directory, not a file")
        elif missing:
            problems.append(f"mqtt.{key}: {path} does not exist")
    for key in ("password_file", "key_file"):
        path = getattr(cfg, key)
        try:
            if path is not None:
                check_secret_file(path, f"mqtt.{key}", group_readable=True)
        except KeyFileError as e:
            problems.append(str(e))
    return problems


def read_password(cfg: MqttConfig) -> str | None:
    if cfg.password_file is None:
        return None
    check_secret_file(cfg.password_file, "mqtt.password_file", group_readable=True)
    try:
        return cfg.password_file.read_text().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"mqtt.password_file: cannot read {cfg.password_file}: {e}") from None


def _this_machine(host: str) -> bool:
    """Whether ``host`` is this machine by its spelling alone (``localhost``, a loopback address):
    a name is not looked up here, where a silent DNS server would hold the start."""
    address = address_of(host)
    return host == "localhost" or (address is not None and address.is_loopback)


def new_client(cfg: MqttConfig, client_id: str) -> Any:
    """A paho client set up from the config (credentials, TLS, timeouts), not yet connected."""
    paho = load_paho()
    client = paho.Client(
        callback_api_version=paho.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=paho.MQTTv311,
        reconnect_on_failure=False,
    )
    client.connect_timeout = CONNECT_TIMEOUT_S
    if cfg.username is not None:
        client.username_pw_set(cfg.username, read_password(cfg))
        if cfg.password_file is not None and not cfg.tls and not _this_machine(cfg.host):
            log.warning(
                "mqtt: %s's password goes to %s in the clear (mqtt://): anyone on the network between can read it; "
                "use mqtts://",
                cfg.username,
                cfg.where,
            )
    if cfg.tls:
        try:
            client.tls_set(
                ca_certs=str(cfg.ca_file) if cfg.ca_file else None,
                certfile=str(cfg.cert_file) if cfg.cert_file else None,
                keyfile=str(cfg.key_file) if cfg.key_file else None,
            )
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            raise KeyFileError(f"mqtt: cannot load the TLS files: {e}") from None
    return client


def connect_problem(e: Exception, cfg: MqttConfig) -> str:
    """Why a connection attempt failed, in words an operator acts on."""
    where = cfg.where
    if isinstance(e, ssl.SSLCertVerificationError):
        return f"TLS: the certificate of {where} is not trusted ({e.verify_message}): check mqtt.ca_file"
    if isinstance(e, ssl.SSLError):
        return f"TLS handshake with {where} failed ({e.reason or e}): is it an mqtts:// listener?"
    if isinstance(e, ConnectionRefusedError):
        return f"{where} refused the connection: is the broker running and listening there?"
    if isinstance(e, TimeoutError):
        return f"no answer from {where} within {CONNECT_TIMEOUT_S:g} s"
    if isinstance(e, socket.gaierror):
        return f"cannot resolve {cfg.host}: {e.strerror}"
    return f"cannot connect to {where}: {getattr(e, 'strerror', None) or e}"


def refusal(reason_code: Any) -> str:
    """The broker's CONNACK refusal with its reason code and what to check."""
    hint = ""
    if reason_code.value in (4, 5, 0x86, 0x87):
        hint = ": check mqtt.username and mqtt.password_file against the broker's users"
    elif reason_code.value in (2, 0x85):
        hint = ": the broker does not accept this mqtt.client_id"
    return f"the broker refused the connection: {reason_code} (reason code {reason_code.value}){hint}"


def _unseen_by_select(sock: Any) -> Callable[[], int]:
    """How many bytes ``sock`` has read that ``select`` no longer sees (`PacketCap.pending`); none
    for a socket that keeps no such bytes."""
    return getattr(sock, "pending", lambda: 0)


class PacketCap:
    """paho's socket, read through a filter that passes on no message payload over ``limit`` bytes.

    paho reads a whole packet into memory before it looks at it, so a peer allowed to publish on a
    trigger topic could make edged allocate whatever the remaining length says (up to 256 MB). This
    reads the stream's packets as they come: a PUBLISH whose payload is over ``limit`` reaches paho
    as the same packet (flags, packet id) with topic `CUT_TOPIC` and no payload, which paho
    acknowledges as it would the message, and the payload is discarded as it arrives, never held;
    ``cut`` is told the topic and the payload's size. Any other packet over ``limit`` (only a
    broker sends them, and none is that big) loses the connection. MQTT 3.1.1, as `new_client`
    speaks it.
    """

    def __init__(self, sock: Any, limit: int, cut: Callable[[str, int], None]) -> None:
        self._sock = sock
        self._limit = limit
        self._cut = cut
        self._ready = bytearray()  # filtered bytes paho has not read yet
        self._header = bytearray()  # the fixed header being read, then a big PUBLISH's variable header
        self._big: tuple[bytes, int] | None = None  # a big PUBLISH: its fixed header and remaining length
        self._passing = 0  # bytes of the packet in hand still to pass on as they are
        self._skipping = 0  # bytes of a cut payload still to discard

    def recv(self, bufsize: int) -> bytes:
        """At most ``bufsize`` filtered bytes; raises what the socket raises (BlockingIOError, TLS's wants)."""
        while not self._ready:
            data = self._sock.recv(READ_BYTES)
            if not data:
                return b""
            self._feed(data)
        out = bytes(self._ready[:bufsize])
        del self._ready[:bufsize]
        return out

    def pending(self) -> int:
        """Bytes already read that ``select`` no longer sees: filtered ones, and TLS's decrypted ones."""
        return len(self._ready) + (self._sock.pending() if hasattr(self._sock, "pending") else 0)

    def send(self, data: bytes) -> int:
        return int(self._sock.send(data))

    def fileno(self) -> int:
        return int(self._sock.fileno())

    def close(self) -> None:
        self._sock.close()

    def _feed(self, data: bytes) -> None:
        pos = 0
        while pos < len(data):
            if self._passing or self._skipping:
                n = min(self._passing or self._skipping, len(data) - pos)
                if self._passing:
                    self._ready += data[pos : pos + n]
                    self._passing -= n
                else:
                    self._skipping -= n
                pos += n
            elif self._big is not None:
                pos = self._variable_header(data, pos)
            else:
                self._header.append(data[pos])
                pos += 1
                self._fixed_header()

    def _fixed_header(self) -> None:
        """Once the fixed header is complete: pass on a packet within the limit, hold back a big PUBLISH."""
        header = self._header
        if len(header) > 5:  # the remaining length has at most four bytes
            raise ConnectionError("the broker sent a packet with a malformed length")
        if len(header) < 2 or header[-1] & 0x80:
            return
        remaining = sum((byte & 0x7F) << (7 * i) for i, byte in enumerate(header[1:]))
        if remaining > self._limit and header[0] >> 4 != PUBLISH:
            raise ConnectionError(f"the broker sent a {remaining}-byte packet of type {header[0] >> 4}")
        if remaining > self._limit:
            self._big = (bytes(header), remaining)
        else:
            self._ready += header
            self._passing = remaining
        self._header = bytearray()

    def _variable_header(self, data: bytes, pos: int) -> int:
        """Read a big PUBLISH's topic and packet id; then cut its payload, or pass it on when within the limit."""
        assert self._big is not None
        fixed, remaining = self._big
        header = self._header
        qos = (fixed[0] >> 1) & 3
        if len(header) < 2:  # the topic's length first
            take = min(2 - len(header), len(data) - pos)
            header += data[pos : pos + take]
            pos += take
            if len(header) < 2:
                return pos
        need = 2 + int.from_bytes(header[:2], "big") + (2 if qos else 0)
        take = min(need - len(header), len(data) - pos)
        header += data[pos : pos + take]
        pos += take
        if len(header) < need:
            return pos
        payload = remaining - need
        if payload < 0:
            raise ConnectionError("the broker sent a message shorter than its topic")
        if payload > self._limit:
            topic = bytes(header[2 : need - (2 if qos else 0)]).decode(errors="replace")
            packet_id = header[need - 2 : need] if qos else b""
            self._ready += bytes((fixed[0], 2 + len(CUT_TOPIC) + len(packet_id)))
            self._ready += len(CUT_TOPIC).to_bytes(2, "big") + CUT_TOPIC.encode() + packet_id
            self._skipping = payload
            self._cut(topic, payload)
        else:
            self._ready += fixed + header
            self._passing = payload
        self._big = None
        self._header = bytearray()
        return pos


@dataclass(frozen=True, slots=True)
class Queued:
    """One message waiting for the broker: its camera and kind pick the topic, its kind QoS and retain."""

    kind: Kind
    payload: bytes
    camera_id: str
    refusal: bool = False  # the reply to a request refused on arrival


class Outbox:
    """Messages waiting for the broker: bounded, events before detections, the newest status of each camera only.

    Beyond ``limit`` (events and detections together) the oldest detection goes first, an event
    only when no detection is left; every message dropped or superseded is counted by kind.
    Replies to requests refused on arrival wait apart, at most `MAX_REFUSALS` (the oldest
    dropped beyond, counted as `REFUSALS`), and go after the events: whoever floods the trigger
    topic fills their line alone, never pushing out a verdict, a detection or a request's answer.
    Called from the frame loop and the MQTT thread alike, so every method takes the lock.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.drops: Counter[str] = Counter()
        self._events: deque[Queued] = deque()
        self._detections: deque[Queued] = deque()
        self._refusals: deque[Queued] = deque()
        self._status: dict[str, Queued] = {}  # by camera, oldest first
        self._lock = threading.Lock()

    def put(self, kind: Kind, payload: bytes, camera_id: str) -> None:
        item = Queued(kind, payload, camera_id)
        with self._lock:
            if kind == "status":
                if self._status.pop(camera_id, None) is not None:
                    self.drops["status"] += 1
                self._status[camera_id] = item
                return
            (self._detections if kind == "detections" else self._events).append(item)
            if len(self._events) + len(self._detections) > self.limit:
                oldest = (self._detections or self._events).popleft()
                self.drops[oldest.kind] += 1

    def put_refusal(self, payload: bytes, camera_id: str) -> None:
        """Queue the ``trigger/error`` reply to a request refused on arrival, in its own bounded line."""
        with self._lock:
            self._refusals.append(Queued("trigger/error", payload, camera_id, refusal=True))
            if len(self._refusals) > MAX_REFUSALS:
                self._refusals.popleft()
                self.drops[REFUSALS] += 1

    def take(self) -> Queued | None:
        """The next message to send: the statuses, then events, refusals and detections, oldest first."""
        with self._lock:
            if self._status:
                return self._status.pop(next(iter(self._status)))
            for line in (self._events, self._refusals, self._detections):
                if line:
                    return line.popleft()
            return None

    def put_back(self, item: Queued) -> None:
        """A message the client could not take yet goes back to the front of its line."""
        with self._lock:
            if item.kind == "status":
                if item.camera_id in self._status:
                    self.drops["status"] += 1
                else:
                    self._status = {item.camera_id: item, **self._status}
            elif item.refusal:
                self._refusals.appendleft(item)
            else:
                (self._detections if item.kind == "detections" else self._events).appendleft(item)

    def refused(self, topic: str) -> None:
        """Count a message that arrived on ``topic`` and was dropped unread."""
        with self._lock:
            self.drops[topic] += 1

    def counts(self) -> dict[str, int]:
        """Drops by topic, and the refusals', every key named (zero included) so that dashboards see stable keys."""
        with self._lock:
            return {topic: self.drops[topic] for topic in (*KINDS, TRIGGER, REFUSALS)}


class MqttOutput(MessageOutput):
    """Sends the daemon's messages to the broker from a thread of its own; `send` never blocks.

    The thread owns the paho client (paho is driven through ``loop_read``/``loop_write``/
    ``loop_misc`` on its socket and a wake-up socket pair), so no paho call ever happens on the
    frame loop. A refused connection or a TLS failure is logged with its reason and retried
    with backoff, as is a broker that is down; none of them stops edged.
    """

    def __init__(self, cfg: MqttConfig, camera_ids: Sequence[str], forget: Collection[str] = ()) -> None:
        """``camera_ids``: the board's cameras; the first names the client (`MqttConfig.client_id_for`).
        ``forget``: cameras a reload removed, whose retained status this output clears once connected."""
        self.cfg = cfg
        self.camera_ids = list(camera_ids)
        self._forget = set(forget) - set(camera_ids)  # read and cleared by this output's thread once connected
        prefix = cfg.prefix()
        camera_id = camera_ids[0]
        self._state_topic = f"{prefix}/state"
        self._topics: dict[tuple[str, Kind], str] = {
            (camera, kind): f"{prefix}/{camera}/{kind}" for camera in camera_ids for kind in KINDS
        }
        self._qos: dict[Kind, int] = {kind: cfg.qos_events for kind in KINDS}
        self._qos["detections"] = cfg.qos_detections
        self._prefix = prefix
        self._requests: Callable[[str, bytes], bool] | None = None
        self._trigger_topics: dict[str, str] = {}  # topic -> camera, replaced whole by `take_requests`
        self._subscribed: set[str] = set()  # trigger topics subscribed to (or being) on this connection
        self._subscribing: dict[int, str] = {}  # message id -> trigger topic, until the broker answers
        self.outbox = Outbox(cfg.max_queued)
        self._client = new_client(cfg, cfg.client_id_for(camera_id))
        self._client.will_set(self._state_topic, b"offline", qos=cfg.qos_events, retain=True)
        # One place more than edged fills (`INFLIGHT`): the offline state at stop goes straight out past a
        # full window. paho 2 refuses to change the window on an open connection.
        self._client.max_inflight_messages_set(INFLIGHT + 1)
        self._client.on_connect = self._on_connect
        self._client.on_publish = self._on_publish
        self._client.on_subscribe = self._on_subscribe
        self._client.on_message = self._on_message
        self._connected = False
        self._answered = False  # the broker answered this connection attempt, yes or no
        self._unacked: set[int] = set()  # QoS 1/2 messages paho holds until the broker acknowledges them
        self._journal: JournalOutput | None = None  # with it, verdicts come from the journal (`use_journal`)
        self._feeds: deque[VerdictFeed | None] = deque()  # handed over by the loop, taken up by this thread
        self._feed: VerdictFeed | None = None  # the journal's in use (None: none), last of `_sending`
        self._sending: deque[VerdictFeed] = deque()  # feeds with verdicts to send, the oldest journal's first
        self._forwarding: dict[int, tuple[VerdictFeed, int]] = {}  # message id -> feed and row, until acknowledged
        self.too_large = 0  # messages from the broker cut by `PacketCap`
        self._too_large_log = LogRate(TOO_LARGE_LOG_INTERVAL_S)  # a publisher decides how often they come
        self._stop = threading.Event()
        self._wake = Wake()
        self._backoff = Backoff(BACKOFF_INITIAL_S, BACKOFF_MAX_S)
        self._failures = 0
        self._attempts = 0  # connection attempts since the last successful one
        self._last_problem = ""
        self._thread = threading.Thread(target=self._run, name="edged-mqtt", daemon=True)
        self._thread.start()
        log.info("MQTT: publishing to %s as %s under %s/", cfg.url, cfg.client_id_for(camera_id), prefix)

    # ---- as an output (`edged.output`) --------------------------------------------------------

    @classmethod
    def from_settings(cls, settings: Settings, services: Services) -> MqttOutput | None:
        return cls(settings.mqtt, settings.camera_ids()) if settings.mqtt is not None else None

    @property
    def publish_empty(self) -> bool:
        return self.cfg.publish_empty

    def deliver(self, kind: MessageKind, camera_id: str, payload: bytes) -> None:
        if kind == "verdict" and self._journal is not None:
            return  # it goes out from the journal once recorded
        self.send(kind, payload, camera_id)

    def use_journal(self, journal: JournalOutput | None) -> None:
        """With the journal, verdicts go out from it at QoS 1 at least, in order, and after an
        outage those not yet acknowledged go again (`edged.replay`)."""
        if journal is self._journal:
            return
        self._journal = journal
        self._feeds.append(journal.feed("mqtt", self._wake) if journal is not None else None)
        self._wake.set()

    def report(self, camera_id: str) -> OutputReport:
        state = self.state
        return OutputReport(
            drops={TOO_LARGE: self.too_large},
            fields={"mqtt_state": state, "mqtt_drops": self.outbox.counts()},
            summary=f"mqtt {state}",
        )

    def carry_requests(self, server: TriggerServer) -> None:
        server.attach(self)

    def reload(self, settings: Settings, services: Services) -> MqttOutput | None:
        """The same broker settings and cameras keep this connection; others replace it."""
        if (settings.mqtt, settings.camera_ids()) == (self.cfg, self.camera_ids):
            return self
        self.close()
        if settings.mqtt is None:
            return None
        # The retained status of a camera removed here (or by a reload before, not yet cleared) would show
        # it to every dashboard that connects later as it last was: the next connection clears it.
        same_prefix = settings.mqtt.prefix() == self._prefix
        forget = (self._forget | set(self.camera_ids)) - set(settings.camera_ids()) if same_prefix else set()
        try:
            return MqttOutput(settings.mqtt, settings.camera_ids(), forget)
        except EdgedError as e:  # the password file went between the check and here
            log.error("MQTT output off until the next reload: %s", e)
            return None

    # ---- the frame loop's side -----------------------------------------------------------------

    def send(self, kind: Kind, payload: bytes, camera_id: str) -> None:
        """Queue one message (the JSON bytes sent on ZeroMQ) of camera ``camera_id`` for the broker.

        A camera this output has no topics for (an error reply to a trigger that came in for a
        camera a reload has since removed) is counted as dropped.
        """
        if (camera_id, kind) not in self._topics:
            self.outbox.refused(kind)
            return
        self.outbox.put(kind, payload, camera_id)
        if self._connected:
            self._wake.set()

    def refuse(self, payload: bytes, camera_id: str) -> None:
        """Queue the ``trigger/error`` reply to a request of ``camera_id`` refused on arrival (`Outbox.put_refusal`)."""
        if (camera_id, "trigger/error") not in self._topics:
            self.outbox.refused(REFUSALS)
            return
        self.outbox.put_refusal(payload, camera_id)
        if self._connected:
            self._wake.set()

    def take_requests(self, handler: Callable[[str, bytes], bool], camera_ids: Sequence[str]) -> None:
        """Subscribe to the trigger topic of each of ``camera_ids`` (and from no other camera's), now
        and on every reconnection; each payload goes to ``handler`` with its topic's camera, on this
        output's thread, which returns False for one it refused unread (counted)."""
        self._requests = handler
        self._trigger_topics = {f"{self._prefix}/{camera}/{TRIGGER}": camera for camera in camera_ids}
        self._wake.set()

    @property
    def state(self) -> MqttState:
        return "connected" if self._connected else "disconnected"

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is queued for at most ``timeout_s``, say offline (retained) and disconnect."""
        self._stop.set()
        self._wake.set()
        # A thread still inside a connect attempt is abandoned (it is a daemon thread).
        self._thread.join(timeout_s + 0.2)
        if not self._thread.is_alive():
            self._wake.close()

    # ---- the MQTT thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._failures and self._stop.wait(self._backoff.delay_s(self._failures)):
                    break
                if self._open():
                    self._serve()
            self._finish(time.monotonic() + CLOSE_TIMEOUT_S)
            for feed in {*self._sending, *(feed for feed, _ in self._forwarding.values())}:
                feed.close()
        except Exception:  # a bug here must not end the daemon: the stream stops, ZeroMQ goes on
            log.exception("the MQTT output failed and stops; ZeroMQ publishing goes on")
            self._connected = False

    def _open(self) -> bool:
        """One connection attempt (TCP, TLS, CONNECT sent); False, logged and counted when it fails."""
        self._answered = False
        self._attempts += 1
        try:
            self._client.connect(self.cfg.host, self.cfg.port, keepalive=self.cfg.keepalive_s)
        except (OSError, ValueError) as e:
            self._failed(connect_problem(e, self.cfg))
            return False
        # paho has no hook for what it reads: it reads through the socket it holds, so it holds this.
        self._client._sock = PacketCap(self._client.socket(), MAX_TRIGGER_BYTES, self._cut)
        return True

    def _serve(self) -> None:
        """Run the connection until it drops or edged stops."""
        sock = self._client.socket()
        pending = _unseen_by_select(sock)
        while not self._stop.is_set():
            self._take_feeds()
            if self._connected:
                self._follow_trigger_topics()
                self._forward()
                self._hand_over()
                if self._client.socket() is None:  # a publish met a dead link, and paho closed it
                    self._dropped(f"connection to {self.cfg.where} lost while sending")
                    return
            writing = [sock] if self._client.want_write() else []
            readable, writable = ready([sock, self._wake], writing, 0.0 if pending() else TICK_S)
            if self._wake in readable:
                self._wake.clear()
            rc = 0
            if sock in readable or pending():
                rc = rc or self._client.loop_read()
            if writable:
                rc = rc or self._client.loop_write()
            rc = rc or self._client.loop_misc()
            if rc or self._client.socket() is None:
                self._dropped(f"connection to {self.cfg.where} lost ({self._error_text(rc)})")
                return

    def _follow_trigger_topics(self) -> None:
        """Subscribe to the trigger topics wanted and not yet subscribed, unsubscribe from the others."""
        wanted = self._trigger_topics
        for topic in [topic for topic in wanted if topic not in self._subscribed]:
            self._subscribed.add(topic)
            rc, mid = self._client.subscribe(topic, qos=self.cfg.qos_events)
            if rc == 0:
                self._subscribing[mid] = topic
        for topic in [topic for topic in self._subscribed if topic not in wanted]:
            self._subscribed.discard(topic)
            self._client.unsubscribe(topic)
            log.info("MQTT: no longer taking trigger requests on %s", topic)

    def _take_feeds(self) -> None:
        while self._feeds:
            self._take_feed(self._feeds.popleft())

    def _take_feed(self, feed: VerdictFeed | None) -> None:
        """The journal's feed after a start or reload (None: the journal is off). A reload that moves
        the journal leaves verdicts not yet acknowledged in the file before (an outage's): they go
        out first, in order, then the new file's (`_forward`). A feed of the file in hand changes
        nothing: the one in hand goes on where it stands, rather than a second reading its cursor."""
        last = self._sending[-1] if self._sending else None
        if feed is not None and last is not None and feed.path == last.path:
            feed.close()
            self._feed = last
            return
        self._feed = feed
        if feed is not None:
            self._sending.append(feed)
            if self._connected:
                feed.connected_before()

    def _let_go(self, feed: VerdictFeed) -> None:
        """A feed of a journal before a reload, with all its verdicts handed out, is closed (its cursor
        written) once the broker has acknowledged them."""
        if feed not in self._sending and not feed.in_flight:
            feed.close()

    def _forward(self) -> None:
        """Give paho the journals' next verdicts while its in-flight window has room; at least QoS 1,
        as a journal moves on only on the broker's acknowledgement."""
        qos = max(1, self._qos["verdict"])
        while self._sending and not self._client.want_write() and (room := INFLIGHT - len(self._unacked)) > 0:
            feed = self._sending[0]
            batch = feed.take(room)
            if not batch:
                if feed is self._feed:
                    return
                # An earlier journal's verdicts are all handed out (or it cannot be read: they wait
                # there, behind its cursor): the next journal's go.
                self._sending.popleft()
                self._let_go(feed)
                continue
            for i, verdict in enumerate(batch):
                topic = self._topics.get((verdict.camera_id, "verdict"))
                if topic is None:  # a camera a reload removed: nobody to send it to
                    feed.acked(verdict.row_id)
                    continue
                info = self._client.publish(topic, verdict.payload, qos=qos)
                if info.rc not in (0, load_paho().MQTT_ERR_NO_CONN):  # paho did not take it
                    feed.give_back(verdict.row_id)
                    return
                # Taken: sent, or (the link just went) held by paho for the next connection.
                self._unacked.add(info.mid)
                self._forwarding[info.mid] = (feed, verdict.row_id)
                if info.rc != 0:
                    if i + 1 < len(batch):
                        feed.give_back(batch[i + 1].row_id)
                    return

    def _hand_over(self) -> None:
        """Give paho queued messages while its socket keeps up and its in-flight window has room."""
        while not self._client.want_write() and (item := self.outbox.take()) is not None:
            qos = self._qos[item.kind]
            if qos and len(self._unacked) >= INFLIGHT:
                self.outbox.put_back(item)
                return
            info = self._client.publish(
                self._topics[item.camera_id, item.kind], item.payload, qos=qos, retain=item.kind == "status"
            )
            if info.rc != 0:  # the link just went: the message waits for the next one
                self.outbox.put_back(item)
                return
            if qos:
                self._unacked.add(info.mid)

    def _drain(self, deadline: float) -> None:
        """At stop: hand over and write what is queued until the outbox is empty, paho's in-flight
        window is full, or ``deadline`` comes (`_hand_over` alone stops at the first message the
        socket has not taken yet, which at stop would be the last status)."""
        sock = self._client.socket()
        while sock is not None and (left := deadline - time.monotonic()) > 0:
            self._hand_over()
            if not self._client.want_write():
                return
            if ready([], [sock], left)[1] and self._client.loop_write():
                return
            sock = self._client.socket()

    def _await_acks(self, deadline: float) -> None:
        """At stop: read the broker's acknowledgements of the QoS 1/2 messages handed over until none
        is outstanding, or ``deadline`` comes. A socket closed under messages not yet acknowledged
        makes the broker fail writing the acknowledgement and drop the connection with the rest of
        what it had received unread: with mosquitto, the second of two "edged is stopping" replies,
        the offline state and the DISCONNECT (its Last Will said offline instead)."""
        sock = self._client.socket()
        pending = _unseen_by_select(sock)
        while self._unacked and sock is not None and (left := deadline - time.monotonic()) > 0:
            if (pending() or ready([sock], [], left)[0]) and self._client.loop_read():
                return
            sock = self._client.socket()

    def _finish(self, deadline: float) -> None:
        """At stop: the last messages and a retained offline, then a clean disconnect, all within ``deadline``."""
        if self._connected:
            self._drain(deadline)
            self._await_acks(deadline)
            # At qos_events, as the Last Will and online: a broker queues no QoS 0 message for a
            # persistent session, so a historian away now would find edged online when back. Past
            # a full in-flight window (paho's has a place kept for it), straight into the stream
            # ahead of DISCONNECT (which makes the broker discard the Last Will), and acknowledged
            # before it where the deadline allows.
            info = self._client.publish(self._state_topic, b"offline", qos=self.cfg.qos_events, retain=True)
            if self.cfg.qos_events:
                self._unacked.add(info.mid)
                self._await_acks(deadline)
            self._client.disconnect()
            sock = self._client.socket()
            while sock is not None and self._client.want_write() and (left := deadline - time.monotonic()) > 0:
                if ready([], [sock], left)[1] and self._client.loop_write():
                    break
                sock = self._client.socket()
        self._connected = False
        with contextlib.suppress(OSError):
            sock = self._client.socket()
            if sock is not None:
                sock.close()

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        self._answered = True
        if reason_code.is_failure:
            self._failed(refusal(reason_code))
            return
        client.publish(self._state_topic, b"online", qos=self.cfg.qos_events, retain=True)
        for camera in sorted(self._forget):  # an empty retained message deletes the broker's retained one
            client.publish(f"{self._prefix}/{camera}/status", b"", qos=self.cfg.qos_events, retain=True)
        self._forget = set()
        self._take_feeds()  # each feed handed over by now learns of this connection just below
        self._connected = True
        self._subscribed = set()
        self._subscribing = {}
        for feed in self._sending:
            feed.connected()
        after = f" at attempt {self._attempts}" if self._attempts > 1 else ""
        log.info("MQTT: connected to %s%s", self.cfg.url, after)
        self._attempts = 0
        self._failures = 0
        self._last_problem = ""

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
        self._unacked.discard(mid)
        forwarded = self._forwarding.pop(mid, None)
        if forwarded is not None:
            feed, row_id = forwarded
            feed.acked(row_id)
            self._let_go(feed)

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reason_codes: Any, properties: Any) -> None:
        topic = self._subscribing.pop(mid, "a trigger topic")
        refused = [code for code in reason_codes if code.is_failure]
        if refused:
            log.error("MQTT: the broker refused the subscription to %s: %s", topic, refused[0])
        else:
            log.info("MQTT: taking trigger requests on %s", topic)

    def _cut(self, topic: str, size: int) -> None:
        """`PacketCap` refused a message too large to be a trigger, before reading it: counted, logged at a bounded rate."""
        self.too_large += 1
        if self._too_large_log.allows():
            log.warning(
                "MQTT: a %d-byte message on %s refused unread: a trigger is at most %d bytes "
                "(counted in drops.%s; more within %g s unlogged)",
                size,
                topic,
                MAX_TRIGGER_BYTES,
                TOO_LARGE,
                TOO_LARGE_LOG_INTERVAL_S,
            )

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        camera_id = self._trigger_topics.get(message.topic)
        if message.topic == CUT_TOPIC:  # what is left of a message `PacketCap` cut, counted then
            return
        if message.retain:  # kept by the broker from an earlier publish: replayed on every subscription
            self.outbox.refused(TRIGGER)
            log.warning("MQTT: a retained trigger on %s ignored: publish triggers without retain", message.topic)
        elif camera_id is None or self._requests is None:  # sent before the unsubscription took effect
            self.outbox.refused(TRIGGER)
        elif not self._requests(camera_id, bytes(message.payload)):
            self.outbox.refused(TRIGGER)

    def _dropped(self, problem: str) -> None:
        was_connected = self._connected
        self._connected = False
        if was_connected:
            log.warning("MQTT: %s; reconnecting with backoff, up to %d messages held", problem, self.cfg.max_queued)
            self._failures = 1
            self._last_problem = problem
        elif not self._answered:  # the broker closed the connection without answering
            self._failed(problem)

    def _failed(self, problem: str) -> None:
        """One more failed attempt: logged when the reason changes and every few attempts, retried with backoff."""
        self._connected = False
        self._failures += 1
        if problem != self._last_problem or self._failures % LOG_EVERY_N_FAILURES == 0:
            log.error(
                "MQTT: %s (attempt %d; retrying with backoff up to %g s, ZeroMQ publishing goes on)",
                problem,
                self._attempts,
                BACKOFF_MAX_S,
            )
        self._last_problem = problem

    def _error_text(self, rc: int) -> str:
        return str(load_paho().error_string(rc)) if rc else "closed"


def probe_broker(cfg: MqttConfig, camera_id: str, timeout_s: float = CONNECT_TIMEOUT_S * 2) -> str:
    """``edged check``: connect once (own client id, no Last Will), wait for the broker's answer, disconnect.

    Returns how it went; raises `BrokerError` with the reason (refused, reason code, TLS) when
    the broker cannot be used.
    """
    answer: list[Any] = []
    client = new_client(cfg, f"{cfg.client_id_for(camera_id)}-check")
    client.on_connect = lambda c, u, f, reason_code, p: answer.append(reason_code)
    try:
        client.connect(cfg.host, cfg.port, keepalive=cfg.keepalive_s)
    except (OSError, ValueError) as e:
        raise BrokerError(f"mqtt: {connect_problem(e, cfg)}") from None
    deadline = time.monotonic() + timeout_s
    try:
        while not answer and time.monotonic() < deadline:
            if client.loop(timeout=0.1) != 0 and not answer:
                raise BrokerError(f"mqtt: {cfg.where} closed the connection before answering")
        if not answer:
            raise BrokerError(f"mqtt: {cfg.where} did not answer within {timeout_s:g} s")
        if answer[0].is_failure:
            raise BrokerError(f"mqtt: {refusal(answer[0])}")
        client.disconnect()
    finally:
        sock = client.socket()
        if sock is not None:
            sock.close()
    return f"{cfg.url} accepted {'TLS ' if cfg.tls else ''}connection as {cfg.username or 'anonymous'}"
