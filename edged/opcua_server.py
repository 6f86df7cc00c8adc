"""The OPC UA server behind `edged.opcua`: asyncua on a thread of its own, with its own event loop.

The frame loop never waits for it. Each verdict and each camera's state reach it as a `Change`
through a bounded, locked line (`UaServer.put`, the oldest dropped and counted beyond the bound)
and one wake-up of its loop, which writes all the nodes of one change before anything else runs
there: a subscription's publishing cycle sees the whole change or none of it, so a subscriber's
data-change notifications for one verdict arrive in one set. Each value carries the frame's
capture time as its source timestamp. A ``Trigger`` call is handed to the request desk
(`edged.trigger.TriggerServer.offer`) and awaits its reply, which the loop's thread hands back
with ``call_soon_threadsafe``, within ``trigger.timeout_s`` and a little more.

Security (`edged.settings.opcua`): without ``users_file`` only anonymous, unencrypted sessions
(which the settings allow on loopback alone); with it, only Basic256Sha256 SignAndEncrypt with a
user name and password from that file, under a certificate made here on first start.
Connections, subscriptions, queued notifications and unacknowledged messages are capped, so
that many clients, or one that never acknowledges, cost a bounded amount of memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hmac
import ipaddress
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncua import ua
from asyncua.common.node import Node
from asyncua.crypto.permission_rules import User, UserRole
from asyncua.server import binary_server_asyncio
from asyncua.server.internal_server import InternalServer
from asyncua.server.internal_session import InternalSession
from asyncua.server.server import Server
from asyncua.server.user_managers import UserManager
from asyncua.ua.attribute_ids import AttributeIds
from asyncua.ua.object_ids import ObjectIds
from asyncua.ua.status_codes import StatusCodes
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pydantic import ValidationError

from edged.accept import AcceptFailures, quiet_accept_failures
from edged.errors import KeyFileError, OutputFileError
from edged.files import fsync_folder, part_file, parts_of, remove_parts
from edged.keys import check_secret_file
from edged.listen import BIND_RETRY_S, every_address, retry_bind
from edged.lograte import LogRate
from edged.messages import TriggerError, TriggerRequest, VerdictMessage
from edged.settings.opcua import OpcuaConfig, listen_host_port
from edged.stats import LatencyWindow

log = logging.getLogger(__name__)

NAMESPACE = "urn:edged"
CERT_FILE = "server.der"
KEY_FILE = "server.pem"
CERT_DAYS = 3650
# A certificate is valid from before any clock a board boots to: one made on a clock set wrongly
# ahead is still valid once the clock is set right (clients that check the dates refuse it otherwise).
CERT_VALID_FROM = datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc)
MAX_CHANGES = 64  # changes waiting for the server's loop; beyond, the oldest are dropped and counted
MAX_PENDING_MESSAGES = 16  # requests parsed and waiting per connection; beyond, the connection is closed
MAX_SESSION_TIMEOUT_MS = 60_000  # a session whose client went silent is closed after at most this
ACTIVATION_S = 10.0  # a connection without an activated session after this is closed
REPLY_MARGIN_S = 1.0  # beyond trigger.timeout_s, how long a Trigger call waits for the desk's reply
START_TIMEOUT_S = 30.0  # what `UaServer.close` waits at most for a server still starting
STOP_TIMEOUT_S = 5.0
REFUSED_LOG_INTERVAL_S = 60.0
DROPPED_LOG_INTERVAL_S = 60.0
ASYNCUA_LOG_INTERVAL_S = 60.0
MIN_PUBLISHING_MS = 10.0  # the shortest publishing interval a subscription gets
# Monitored items one subscription may hold (OPC UA's MaxMonitoredItemsPerSubscription): asyncua has no
# cap, and each item costs about 2 KB and a callback per value written, so a client asking for items by
# the thousand (anonymous on loopback) took edged's memory towards MemoryMax; beyond, each item asked
# is refused Bad_TooManyMonitoredItems. Every node of many cameras, several times over, still fits.
MAX_MONITORED_ITEMS = 1000
MAX_CHUNK_BYTES = 65535 + 12  # the largest chunk the server takes (limits.max_recv_buffer), with its header
SUBSCRIPTION_LOGGERS = "asyncua.server.monitored_item_service."  # + a subscription's id: one logger each
SERVICE_FAULT = "sending service fault response"  # asyncua's record, at error, of each request it refuses
# asyncua's record, at error, of a session activated with a kind of user token the server does not offer
REJECTED_TOKEN = "Rejected active session UserIdentityToken not supported"
SERVER_FAULTS = frozenset({"BadInternalError", "BadUnexpectedError", "BadOutOfMemory"})  # the server's, not a client's

Answer = Callable[[VerdictMessage | TriggerError], None]
# (origin, camera, part id, answer): `edged.trigger.TriggerServer.offer`
Offer = Callable[[str, str, str | None, Answer], None]

VARIABLES: dict[str, ua.VariantType] = {
    "Verdict": ua.VariantType.String,
    "Sequence": ua.VariantType.UInt64,
    "PartId": ua.VariantType.String,
    "OkCount": ua.VariantType.UInt64,
    "NgCount": ua.VariantType.UInt64,
    "State": ua.VariantType.String,
    "CaptureToVerdictMs": ua.VariantType.Double,
    "LastMessage": ua.VariantType.String,
}
INITIAL: dict[str, Any] = {
    "Verdict": "",
    "Sequence": 0,
    "PartId": "",
    "OkCount": 0,
    "NgCount": 0,
    "State": "starting",
    "CaptureToVerdictMs": 0.0,
    "LastMessage": "",
}


AWAITING = frozenset({"Verdict", "Sequence", "PartId", "CaptureToVerdictMs", "LastMessage"})
WAITING = ua.StatusCode(ua.UInt32(StatusCodes.BadWaitingForInitialData))


@dataclass(frozen=True, slots=True)
class Change:
    """Values of one camera's variables written together, at ``source_ns`` (wall clock); ``capture_ns``
    (monotonic) of a verdict's frame, 0 for other changes, times the update."""

    camera_id: str
    values: dict[str, Any]
    source_ns: int
    capture_ns: int = 0


class BoundedLog(logging.Handler):
    """asyncua's records, each of its messages at most once per `ASYNCUA_LOG_INTERVAL_S`, passed on
    to edged's own handlers: a client decides how often asyncua logs (a refused connection, a
    malformed message with its traceback), so it must not decide how much goes to the journal."""

    def __init__(self) -> None:
        super().__init__()
        self._rates: dict[tuple[str, str, int], LogRate] = {}  # by logger, message template, level: a bounded set
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        record = client_fault_as_warning(record)
        key = (logger_family(record.name), str(record.msg), record.levelno)
        with self._lock:
            rate = self._rates.setdefault(key, LogRate(ASYNCUA_LOG_INTERVAL_S))
            allowed = rate.allows()
        if allowed:
            logging.getLogger().handle(record)


class Gone:
    """The transport of a connection its client dropped: asyncua's session outlives it (OPC UA keeps
    a session's subscriptions for a reconnect) and goes on answering into it, which asyncio would
    log as ``socket.send() raised exception.``, a line that says nothing of who went: dropped."""

    def write(self, data: bytes) -> None:
        pass


class CappedProtocol(binary_server_asyncio.OPCUAProtocol):
    """asyncua's connection, which keeps what a peer sends until the chunk its header announces is
    complete (up to 4 GiB, before any session): here a connection whose unfinished chunk outgrows
    `MAX_CHUNK_BYTES`, the chunk size the server negotiates, is closed, so no peer decides what
    edged holds for it. A client that goes away with its session open (killed, unplugged) is said."""

    dropped_log = LogRate(DROPPED_LOG_INTERVAL_S)  # a client decides how often: one line a minute for all
    closed_by_server = False  # set as the server stops: the client did not go away, edged closed it

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # every complete chunk taken off; what is left is one unfinished
        if len(self._buffer) > MAX_CHUNK_BYTES and self.transport is not None:
            self._buffer = b""
            self.transport.close()

    def connection_lost(self, ex: BaseException | None) -> None:
        processor = self.processor
        if processor is not None:
            session = processor.session
            if (
                session is not None
                and session.is_activated()
                and not self.closed_by_server
                and CappedProtocol.dropped_log.allows()
            ):
                log.warning(
                    "OPC UA: client %s went away without closing its session (%s); %s for it to reconnect "
                    "until the session times out (%g s at most), and every other client is served (more "
                    "within %g s unlogged)",
                    _peer(self.peer_name),
                    ex or "connection closed",
                    _kept(session),
                    session.session_timeout or MAX_SESSION_TIMEOUT_MS / 1000,
                    DROPPED_LOG_INTERVAL_S,
                )
            processor._transport = Gone()
        super().connection_lost(ex)


async def _end_tasks() -> None:
    """End the tasks a stopped asyncua server leaves: the sessions it keeps for a reconnect (their
    timeouts) and their subscriptions' loops. Left pending on the closed loop, each would be an
    ERROR in the log of a clean stop ("Task was destroyed but it is pending!")."""
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


def client_fault_as_warning(record: logging.LogRecord) -> logging.LogRecord:
    """asyncua logs each service fault it answers at error, but nearly all answer a client's request
    it refuses (a wrong password, a session unknown or not activated, too many subscriptions): the
    client's mistake, which must not page whoever alerts on edged's errors. Those are passed on as
    warnings, as is its record of a client signing in with a kind of token not offered (anonymous
    where only user names are); a fault that says the server itself failed (`SERVER_FAULTS`) stays
    an error."""
    if record.levelno <= logging.WARNING or not str(record.msg).startswith((SERVICE_FAULT, REJECTED_TOKEN)):
        return record
    args = record.args if isinstance(record.args, tuple) else ()
    if SERVER_FAULTS.intersection(str(arg) for arg in args):
        return record
    warning = logging.makeLogRecord(record.__dict__)
    warning.levelno, warning.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
    return warning


def logger_family(name: str) -> str:
    """``name`` without a subscription's id: one rate for the records of every subscription's logger."""
    return SUBSCRIPTION_LOGGERS if name.startswith(SUBSCRIPTION_LOGGERS) else name


def forget_subscription_loggers(live: Collection[int]) -> None:
    """asyncua makes a logger for each subscription, named by its id (which only grows), and `logging`
    keeps every logger it has made for good: a client that subscribes anew each time it connects
    would have edged hold one more per connection, for months. Those of subscriptions not ``live``
    are dropped. Their parent is made a logger of its own first: as `logging`'s placeholder it would
    hold every one of them too."""
    logging.getLogger(SUBSCRIPTION_LOGGERS.removesuffix("."))
    loggers = logging.Logger.manager.loggerDict
    with logging._lock:  # type: ignore[attr-defined]  # getLogger's and setLevel's, over this dict
        for name in [name for name in loggers if name.startswith(SUBSCRIPTION_LOGGERS)]:
            suffix = name.removeprefix(SUBSCRIPTION_LOGGERS)
            if not suffix.isdigit() or int(suffix) not in live:
                del loggers[name]


def cap_chunks() -> None:
    """Every OPC UA connection of this process is a `CappedProtocol`: asyncua's server makes its
    connections by that module-level name, and edged runs one server."""
    binary_server_asyncio.OPCUAProtocol = CappedProtocol  # type: ignore[misc]


def quiet_asyncua() -> None:
    """asyncua logs every connection and request at info: warnings and above only, each of its
    messages at most once a minute (`BoundedLog`)."""
    asyncua = logging.getLogger("asyncua")
    asyncua.setLevel(logging.WARNING)
    if not any(isinstance(handler, BoundedLog) for handler in asyncua.handlers):
        asyncua.addHandler(BoundedLog())
    asyncua.propagate = False


def application_uri() -> str:
    return f"urn:edged:{socket.gethostname()}"


def cert_dir_problem(directory: Path) -> str | None:
    """Why `server_certificate` could not make or take the pair in ``directory``, known without writing:
    it or a folder above it is a file, it holds half a pair, or a pair the server could not load."""
    above = next((p for p in (directory, *directory.parents) if p.exists()), None)
    if above is not None and not above.is_dir():
        return f"opcua.cert_dir: {above} is not a folder: set opcua.cert_dir to a folder (made when absent)"
    cert, key = directory / CERT_FILE, directory / KEY_FILE
    if cert.exists() != key.exists() and not _finishable(cert, key):
        return (
            f"opcua.cert_dir: {directory} holds only one of {CERT_FILE} and {KEY_FILE}: remove it to have "
            "both made again, or put back the other"
        )
    if cert.is_file() and key.is_file():
        try:
            _check_pair(cert, key)
        except KeyFileError as e:
            return str(e)
        except OSError:  # not readable by this user: `server_certificate` says so as the service
            pass
    return None


def server_certificate(directory: Path) -> tuple[Path, Path]:
    """The server's certificate and key in ``directory``, made there (RSA 2048, self-signed, ten
    years) when absent, as ``edged keygen`` makes CURVE keys: the key 0600, the folder 0750. A pair
    there is kept as it is (clients were told to trust it), whatever edged would make now. Raises
    `KeyFileError` naming ``opcua.cert_dir`` for a pair it cannot use, `OutputFileError` where the
    disk takes no file now (full, read-only: the server tries again, `UaServer`)."""
    cert, key = directory / CERT_FILE, directory / KEY_FILE
    try:
        _finish_pair(cert, key)
        if cert.is_file() and key.is_file():
            check_secret_file(key, "opcua.cert_dir")
            _say_what_clients_refuse(cert, _check_pair(cert, key))
            return cert, key
    except OSError as e:
        raise KeyFileError(f"opcua.cert_dir: cannot read the server certificate in {directory}: {e.strerror or e}") from None
    if (problem := cert_dir_problem(directory)) is not None:
        raise KeyFileError(problem)
    try:
        _make_pair(directory, cert, key)
    except OSError as e:
        raise OutputFileError(
            f"opcua.cert_dir: cannot make the server certificate in {directory}: {e.strerror or e}"
        ) from None
    log.info("OPC UA: made the server certificate %s (clients must trust it) and its key %s", cert, key)
    return cert, key


def _make_pair(directory: Path, cert: Path, key: Path) -> None:
    """The pair made whole or not at all: both written beside their places and on the disk before
    either is renamed there, the certificate first, so that a power cut leaves no pair, or the
    certificate with its key beside it, which the next start puts in place (`_finish_pair`)."""
    directory.mkdir(mode=0o750, parents=True, exist_ok=True)
    remove_parts(cert)
    remove_parts(key)
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )
    der = _self_signed(private).public_bytes(serialization.Encoding.DER)
    written: list[Path] = []
    try:
        for path, data, mode in ((key, pem, 0o600), (cert, der, 0o644)):
            fd, part = part_file(path, mode)
            written.append(part)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        key_part, cert_part = written
        cert_part.chmod(0o644)  # whatever the umask: clients are given it
        fsync_folder(directory)
        os.replace(cert_part, cert)
        written[1] = cert
        os.replace(key_part, key)
        fsync_folder(directory)
    except BaseException:
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink()
        raise


def _finishable(cert: Path, key: Path) -> bool:
    """Whether ``cert`` is there without ``key`` only because a power cut stopped `_make_pair` between
    its renames: the key, made and synced with it, is still beside it."""
    return cert.is_file() and not key.exists() and len(parts_of(key)) == 1


def _finish_pair(cert: Path, key: Path) -> None:
    """Put in place the key a power cut left beside its certificate (`_finishable`)."""
    if _finishable(cert, key):
        os.replace(parts_of(key)[0], key)
        fsync_folder(key.parent)
        log.info("OPC UA: put in place the server key %s, made with its certificate before a power cut", key)


def _check_pair(cert: Path, key: Path) -> x509.Certificate:
    """The certificate of a pair the server can load; `KeyFileError` for one it could not, found now
    rather than as the OPC UA server stopping with a traceback: one cut short or damaged (an earlier
    edged wrote them in place, and a power cut could leave either so), or a key that is not the
    certificate's."""
    renew = "remove both to have a new pair made at the next start (clients must then trust the new certificate)"
    try:
        made = x509.load_der_x509_certificate(cert.read_bytes())
    except ValueError:
        raise KeyFileError(f"opcua.cert_dir: {cert} is not a DER certificate (cut short or damaged?): {renew}") from None
    try:
        private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    except (ValueError, TypeError):  # TypeError: a key that wants a password
        why = "is not a PEM private key without a password (cut short or damaged?)"
        raise KeyFileError(f"opcua.cert_dir: {key} {why}: {renew}") from None
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if private.public_key().public_bytes(*spki) != made.public_key().public_bytes(*spki):
        raise KeyFileError(f"opcua.cert_dir: {key} is not the key of {cert}: {renew}")
    return made


def _say_what_clients_refuse(cert: Path, made: x509.Certificate) -> None:
    """What some clients refuse in a certificate kept: dates the clock reads outside its validity
    (made on a clock set wrongly, or simply old), as a warning; no key identifiers (made by an
    edged that did not add them), which stacks that build chains want, as a note. Each with the way out.
    ``made``: ``cert`` as `_check_pair` read it."""
    renew = (
        f"Remove it and {cert.with_name(KEY_FILE)} to have a new pair made at the next start "
        "(clients must then trust the new one)"
    )
    kinds = {type(extension.value) for extension in made.extensions}
    if not {x509.SubjectKeyIdentifier, x509.AuthorityKeyIdentifier} <= kinds:
        log.info(
            "OPC UA: the server certificate %s lacks the Subject and Authority Key Identifiers, which clients that "
            "build certificate chains (UaExpert, the OPC Foundation .NET stack, open62541) may require. %s",
            cert,
            renew,
        )
    now = datetime.datetime.now(datetime.timezone.utc)
    if not made.not_valid_before_utc <= now <= made.not_valid_after_utc:
        log.warning(
            "OPC UA: the server certificate %s is valid from %s to %s, but the clock reads %s: clients that "
            "check the dates refuse it. %s",
            cert,
            f"{made.not_valid_before_utc:%Y-%m-%d}",
            f"{made.not_valid_after_utc:%Y-%m-%d}",
            f"{now:%Y-%m-%d}",
            renew,
        )


def _self_signed(private: rsa.RSAPrivateKey) -> x509.Certificate:
    host = socket.gethostname()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"edged@{host}")])
    key_id = x509.SubjectKeyIdentifier.from_public_key(private.public_key())
    serial = x509.random_serial_number()
    now = datetime.datetime.now(datetime.timezone.utc)
    names: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(application_uri()),
        x509.DNSName(host),
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(serial)
        .not_valid_before(CERT_VALID_FROM)
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=True,
                key_encipherment=True,
                data_encipherment=True,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(key_id, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier(key_id.digest, [x509.DirectoryName(name)], serial), critical=False)
        .sign(private, hashes.SHA256())
    )


def read_users(path: Path) -> dict[str, str]:
    """USER:PASSWORD lines (blank lines and ``#`` comments skipped) of a secret file; raises `KeyFileError`."""
    label = "opcua.users_file"
    check_secret_file(path, label, group_readable=True)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"{label}: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    users: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, password = line.partition(":")
        if not sep or not name.strip() or not password:
            raise KeyFileError(f"{label}: line {number} of {path} is not USER:PASSWORD")
        users[name.strip()] = password
    if not users:
        raise KeyFileError(f"{label}: {path} holds no USER:PASSWORD line")
    return users


class Users(UserManager):
    """asyncua's user manager: the users of ``users_file`` (None: anonymous clients, on loopback).
    A refused sign-in is counted, and logged at most once a minute: a client decides how often."""

    def __init__(self, users: dict[str, str] | None) -> None:
        self._users = users
        self.refused = 0
        self._log = LogRate(REFUSED_LOG_INTERVAL_S)

    def replace(self, users: dict[str, str]) -> None:
        """Another users file's users, from the next sign-in on (sessions signed in stay)."""
        self._users = users

    def get_user(
        self, iserver: Any, username: str | None = None, password: str | None = None, certificate: Any = None
    ) -> User | None:
        if self._users is None:
            return User(role=UserRole.User)
        known = self._users.get(username or "")
        if known is None or password is None or not hmac.compare_digest(known.encode(), password.encode()):
            self.refused += 1
            if self._log.allows():
                log.warning(
                    "OPC UA: sign-in refused for user %r (wrong user or password; counted in opcua.refused, "
                    "more within %g s unlogged)",
                    username,
                    REFUSED_LOG_INTERVAL_S,
                )
            return None
        return User(role=UserRole.User, name=username)


class UaServer:
    """asyncua's server for ``cameras``, on its own thread and event loop; ``requesting`` get a
    ``Trigger`` method, answered through `offer` once set. ``try_listen`` binds ``opcua.listen`` and
    returns its release, or raises `BindError` saying why (`edged.opcua.try_listen`)."""

    def __init__(
        self,
        cfg: OpcuaConfig,
        cameras: Sequence[str],
        requesting: Sequence[str],
        trigger_timeout_s: float,
        try_listen: Callable[[], Callable[[], None]],
    ) -> None:
        quiet_asyncua()
        cap_chunks()
        self.cfg = cfg
        self._try_listen = try_listen
        self.cameras = tuple(cameras)
        self.requesting = tuple(requesting)
        self.offer: Offer | None = None  # set by the loop's thread (`Output.carry_requests`)
        self.users = Users(read_users(cfg.users_file) if cfg.users_file is not None else None)
        self._cert: tuple[Path, Path] | None = None
        self._unmade: OutputFileError | None = None  # the disk took no certificate: made again in `_serve`
        if cfg.secured:
            try:
                self._cert = server_certificate(cfg.cert_dir)
            except OutputFileError as e:
                self._unmade = e
        self._reply_s = trigger_timeout_s + REPLY_MARGIN_S
        self._lock = threading.Lock()
        self._changes: deque[Change] = deque()
        self._kicked = False
        self.dropped = 0  # changes dropped: the server's loop fell behind
        self.requests = 0  # Trigger calls answered
        self.updates = 0  # verdicts written to the nodes
        self.latency = LatencyWindow()  # capture to node update, ms, of frames captured while serving
        self._serving_since_ns = 0  # monotonic: frames captured before, queued while the server started, are not timed
        self._nodes: dict[tuple[str, str], ua.NodeId] = {}
        self._server: Server | None = None
        self._loop = asyncio.new_event_loop()
        self.accept_failures = AcceptFailures("OPC UA")
        quiet_accept_failures(self._loop, self.accept_failures)  # said once, not a traceback per try
        self._stop = asyncio.Event()  # bound to the server's loop when it first waits on it
        self._started = threading.Event()  # it listens, or has given up
        self._thread = threading.Thread(target=self._run, name="edged-opcua", daemon=True)
        self._thread.start()

    # ---- any thread ---------------------------------------------------------------------------

    def put(self, change: Change) -> None:
        """Queue ``change`` for the server's loop; never blocks."""
        with self._lock:
            if len(self._changes) >= MAX_CHANGES:
                self._changes.popleft()
                self.dropped += 1
            self._changes.append(change)
            kick, self._kicked = not self._kicked, True
        if kick:
            with contextlib.suppress(RuntimeError):  # the loop is closed: edged is stopping
                self._loop.call_soon_threadsafe(self._write_changes)

    @property
    def serving(self) -> bool:
        """Listening, and taking clients."""
        return self._server is not None

    @property
    def clients(self) -> int:
        """Client connections now."""
        server = self._server
        return len(server.bserver.clients) if server is not None and server.bserver is not None else 0

    def carry_on(self, previous: UaServer) -> None:
        """The counters of the server a reload replaces (stopped) go on here, before this one serves:
        the status says them since start."""
        with self._lock:
            self.dropped += previous.dropped
            self.requests += previous.requests
            self.updates += previous.updates
        self.users.refused += previous.users.refused

    def update_ms(self) -> tuple[float, float]:
        with self._lock:
            summary = self.latency.summary()
        return summary.p50_ms, summary.p99_ms

    def close(self) -> None:
        """Stop the server (sessions closed) within `STOP_TIMEOUT_S`; one still starting is waited for
        within `START_TIMEOUT_S`, and stops as soon as it has started."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server has stopped already
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(START_TIMEOUT_S if not self._started.is_set() else STOP_TIMEOUT_S)

    # ---- the server's thread ------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except Exception:  # a bug: OPC UA stops, every other output goes on
            log.exception("OPC UA: the server stopped; every other output goes on")
        finally:
            self._started.set()
            self._loop.close()

    async def _serve(self) -> None:
        if self._unmade is not None:
            self._cert = await self._certificate(self._unmade)
            if self._cert is None:  # closed while waiting
                return
        server = Server(user_manager=self.users)
        await server.init()
        server.set_server_name(f"edged on {socket.gethostname()}")
        await server.set_application_uri(application_uri())
        server.set_endpoint(self.cfg.listen)
        host, port = listen_host_port(self.cfg.listen)
        if every_address(host):  # asyncio binds "::" for IPv6 alone; "" is every address of both
            server.socket_address = ("", port)
        self._limit(server)
        answer_not_writable(server.iserver)
        if self._cert is not None:
            await server.load_certificate(str(self._cert[0]))
            await server.load_private_key(str(self._cert[1]))
            server.set_security_policy([ua.SecurityPolicyType.Basic256Sha256_SignAndEncrypt])
            server.set_identity_tokens([ua.UserNameIdentityToken])
        else:
            server.set_security_policy([ua.SecurityPolicyType.NoSecurity])
            server.set_identity_tokens([ua.AnonymousIdentityToken])
        await self._build(server)
        if not await self._listenable():  # closed while starting
            return
        try:
            await server.start()
        except OSError as e:  # taken again since `_listenable` tried it: status says not serving
            log.error("OPC UA: opcua.listen %s: cannot listen there: %s; every other output goes on", self.cfg.listen, e)
            return
        self._server = server
        self._serving_since_ns = time.monotonic_ns()
        log.info(
            "OPC UA: serving camera %s on %s (%s)",
            ", ".join(self.cameras),
            self.cfg.listen,
            "Basic256Sha256 SignAndEncrypt, users of opcua.users_file" if self._cert else "anonymous, loopback",
        )
        self._started.set()
        self._loop.create_task(self._apply())  # what was queued while the server was starting
        try:
            await self._stop.wait()
        finally:
            self._server = None
            for protocol in server.bserver.clients if server.bserver is not None else ():
                if isinstance(protocol, CappedProtocol):
                    protocol.closed_by_server = True
            await server.stop()
            await _end_tasks()

    async def _certificate(self, failed: OutputFileError) -> tuple[Path, Path] | None:
        """The certificate and key that ``failed`` to be made when the server was set up (a full or
        read-only disk), made again every `BIND_RETRY_S` until the disk takes them, as a taken
        address is tried again: the server starts then, and every other output goes on meanwhile.
        None once closed."""
        log.error("OPC UA: %s; every other output goes on; retrying every %.0f s", failed, BIND_RETRY_S)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), BIND_RETRY_S)

        async def attempt() -> tuple[Path, Path]:
            return server_certificate(self.cfg.cert_dir)

        return await retry_bind(attempt, self._stop, lambda _: None, errors=(OutputFileError,))

    async def _listenable(self) -> bool:
        """Wait until ``opcua.listen`` can be bound (held by another program, or an edged still
        stopping), trying every `BIND_RETRY_S` as the Modbus server and the live view do; False once
        closed. A server that failed to start cannot be started again, so the address is tried first."""

        async def attempt() -> bool:
            self._try_listen()()
            return True

        def said(e: Exception) -> None:
            log.error("OPC UA: %s; every other output goes on; retrying every %.0f s", e, BIND_RETRY_S)

        return await retry_bind(attempt, self._stop, said) is not None

    def _limit(self, server: Server) -> None:
        """Caps on what clients may make the server hold (`edged.settings.opcua`)."""
        internal = server.iserver
        internal.allow_remote_admin = False
        internal.max_connections = self.cfg.max_clients
        internal.max_pending_messages_per_connection = MAX_PENDING_MESSAGES
        internal.max_pending_activation_seconds = ACTIVATION_S
        internal.max_session_timeout_ms = MAX_SESSION_TIMEOUT_MS
        internal.max_subscriptions = 4 * self.cfg.max_clients
        internal.max_unacked_messages_per_subscription = self.cfg.max_queued
        internal.max_monitored_item_queue_size = self.cfg.max_queued
        InternalSession.max_connections = self.cfg.max_clients  # activated sessions: the class keeps the count
        service = internal.subscription_service
        create, delete = service.create_subscription, service.delete_subscriptions

        async def create_at_most_as_often(params: ua.CreateSubscriptionParameters, *args: Any, **kwargs: Any) -> Any:
            """asyncua grants any publishing interval, 0 (a publish per value written: no sets) or a
            microsecond (a loop that never sleeps): it is revised to `MIN_PUBLISHING_MS` at least.
            The loggers of subscriptions gone since the last (their lifetime ran out) go first."""
            forget_subscription_loggers(service.subscriptions)
            params.RequestedPublishingInterval = max(params.RequestedPublishingInterval, MIN_PUBLISHING_MS)
            return await create(params, *args, **kwargs)

        async def delete_with_loggers(ids: list[int]) -> list[ua.StatusCode]:
            """A client's delete, or its session closing: the subscriptions' loggers go with them."""
            try:
                return await delete(ids)
            finally:
                forget_subscription_loggers(service.subscriptions)

        create_items = service.create_monitored_items

        async def create_items_within_the_cap(params: ua.CreateMonitoredItemsParameters) -> Any:
            """The items asked for, as many as `MAX_MONITORED_ITEMS` leaves room for in their
            subscription; each beyond answered Bad_TooManyMonitoredItems, in its place."""
            subscription = service.subscriptions.get(params.SubscriptionId)
            if subscription is None:  # asyncua's own answer: Bad_SubscriptionIdInvalid
                return await create_items(params)
            room = max(MAX_MONITORED_ITEMS - len(subscription.monitored_item_srv._monitored_items), 0)
            asked = list(params.ItemsToCreate)
            params.ItemsToCreate = asked[:room]
            made = await create_items(params) if params.ItemsToCreate else []
            refused = ua.StatusCode(ua.UInt32(StatusCodes.BadTooManyMonitoredItems))
            return [*made, *(ua.MonitoredItemCreateResult(StatusCode=refused) for _ in asked[room:])]

        service.create_subscription = create_at_most_as_often  # type: ignore[method-assign]
        service.create_monitored_items = create_items_within_the_cap  # type: ignore[method-assign]
        service.delete_subscriptions = delete_with_loggers  # type: ignore[method-assign]
        server.limits.max_message_size = 1 << 20
        server.limits.max_chunk_count = (1 << 20) // server.limits.max_recv_buffer + 1

    async def _build(self, server: Server) -> None:
        """``Objects/edged/<camera_id>/`` with every variable of `VARIABLES`, and ``Trigger`` in request mode.

        Those of a verdict (`AWAITING`) are Bad_WaitingForInitialData until the first: the first
        verdict then changes their status whatever its values, so that a subscriber monitoring
        ``Sequence`` hears of verdict 0 too."""
        ns = await server.register_namespace(NAMESPACE)
        root = await server.nodes.objects.add_object(_node_id("edged", ns), ua.QualifiedName("edged", ns))
        for camera_id in self.cameras:
            camera = await root.add_object(_node_id(camera_id, ns), ua.QualifiedName(camera_id, ns))
            for name, kind in VARIABLES.items():
                node = await camera.add_variable(
                    _node_id(f"{camera_id}.{name}", ns), ua.QualifiedName(name, ns), INITIAL[name], kind
                )
                self._nodes[camera_id, name] = node.nodeid
                if name in AWAITING:
                    await server.write_attribute_value(node.nodeid, ua.DataValue(StatusCode=WAITING))
            if camera_id in self.requesting:
                await self._add_trigger(camera, ns, camera_id)

    async def _add_trigger(self, camera: Node, ns: int, camera_id: str) -> None:
        async def trigger(parent: ua.NodeId, *arguments: ua.Variant) -> list[ua.Variant] | ua.CallMethodResult:
            refused = refused_call(parent, camera.nodeid, arguments)
            if refused is not None:
                return refused
            reply = await self._trigger(camera_id, arguments[0].Value)
            self.requests += 1
            return [ua.Variant(reply.model_dump_json(), ua.VariantType.String)]

        part = ua.Argument(Name="partId", DataType=ua.NodeId(ua.Int32(ObjectIds.String)), ValueRank=-1)
        part.Description = ua.LocalizedText("The part's id, returned in the verdict; empty: none.")
        answer = ua.Argument(Name="verdict", DataType=ua.NodeId(ua.Int32(ObjectIds.String)), ValueRank=-1)
        answer.Description = ua.LocalizedText("The verdict message (JSON), or the error saying why there is none.")
        await camera.add_method(
            _node_id(f"{camera_id}.Trigger", ns), ua.QualifiedName("Trigger", ns), trigger, [part], [answer]
        )

    async def _trigger(self, camera_id: str, value: str | None) -> VerdictMessage | TriggerError:
        """One inspection of a frame captured after the call, through the request desk."""
        try:
            part_id = TriggerRequest(part_id=value or None).part_id
        except ValidationError as e:
            detail = e.errors()[0]["msg"]
            return TriggerError(camera_id=camera_id, part_id=None, error="bad_request", detail=f"partId: {detail}")
        offer = self.offer
        if offer is None:
            return TriggerError(
                camera_id=camera_id, part_id=part_id, error="stopping", detail="edged is not taking requests"
            )
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[VerdictMessage | TriggerError] = loop.create_future()

        def answer(message: VerdictMessage | TriggerError) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
                loop.call_soon_threadsafe(_resolve, reply, message)

        offer("opcua", camera_id, part_id, answer)
        try:
            return await asyncio.wait_for(reply, self._reply_s)
        except TimeoutError:
            return TriggerError(
                camera_id=camera_id, part_id=part_id, error="timeout", detail=f"no verdict within {self._reply_s:g} s"
            )

    def _write_changes(self) -> None:
        """On the server's loop: take every change queued and write each, whole, before anything else runs."""
        self._loop.create_task(self._apply())

    async def _apply(self) -> None:
        with self._lock:
            changes = list(self._changes)
            self._changes.clear()
            self._kicked = False
        server = self._server
        if server is None:  # not listening yet: kept for when it is (`_serve`)
            with self._lock:
                self._changes.extendleft(reversed(changes))
            return
        for change in changes:
            await self._write(server, change)

    async def _write(self, server: Server, change: Change) -> None:
        """Every value of ``change``; nothing here awaits anything that yields to the loop, so no
        publishing cycle runs between two of them."""
        stamp = ua.DateTime.fromtimestamp(change.source_ns / 1e9, datetime.timezone.utc)
        now = ua.DateTime.now(datetime.timezone.utc)
        for name, value in change.values.items():
            nodeid = self._nodes.get((change.camera_id, name))
            if nodeid is None:
                continue
            data = ua.DataValue(ua.Variant(value, VARIABLES[name]), SourceTimestamp=stamp, ServerTimestamp=now)
            await server.write_attribute_value(nodeid, data)
        if change.capture_ns:
            ms = (time.monotonic_ns() - change.capture_ns) / 1e6
            with self._lock:
                self.updates += 1
                if change.capture_ns >= self._serving_since_ns:
                    self.latency.add(ms)


def answer_not_writable(internal: InternalServer) -> None:
    """asyncua refuses every write its user may not make with BadUserAccessDenied, which says the
    user lacks a right: a write to a node that does not exist, to an attribute the node does not have
    (a Variable's Executable), to one its WriteMask keeps closed, to a value its AccessLevel makes
    read-only. OPC UA (Part 4, Write) answers BadNodeIdUnknown, BadAttributeIdInvalid and BadNotWritable
    there, and PLC tools and Node-RED show that status to whoever wires them up. Only those answers
    change: every other write result is asyncua's."""
    service, aspace = internal.attribute_service, internal.aspace
    write = service.write

    def read(nodeid: ua.NodeId, attribute: AttributeIds) -> Any:
        """The attribute's value, None where the node has none."""
        data = aspace.read_attribute_value(nodeid, attribute)
        if data.StatusCode is None or not data.StatusCode.is_good() or data.Value is None:
            return None
        return data.Value.Value

    def has(item: ua.WriteValue) -> bool:
        """Whether the node has the attribute: asyncua holds only those of its node class."""
        status = aspace.read_attribute_value(item.NodeId, item.AttributeId).StatusCode
        return status is None or status.value != StatusCodes.BadAttributeIdInvalid

    def opens(item: ua.WriteValue) -> bool | None:
        """Whether the node lets anyone write the attribute; None where it does not say."""
        if item.AttributeId == AttributeIds.Value:
            access = read(item.NodeId, AttributeIds.AccessLevel)
            return None if access is None else ua.AccessLevel.CurrentWrite in ua.AccessLevel.parse_bitfield(access)
        try:
            attribute = AttributeIds(item.AttributeId)
        except ValueError:  # no attribute of OPC UA's
            return None
        mask, bit = read(item.NodeId, AttributeIds.WriteMask), ua.AttributeWriteMask.__members__.get(attribute.name)
        if mask is None or bit is None or read(item.NodeId, attribute) is None:
            return None
        return bool(mask & bit)

    def answer(item: ua.WriteValue, result: ua.StatusCode) -> ua.StatusCode:
        if result.value != StatusCodes.BadUserAccessDenied:
            return result
        if item.NodeId not in aspace:
            return ua.StatusCode(ua.UInt32(StatusCodes.BadNodeIdUnknown))
        if not has(item):
            return ua.StatusCode(ua.UInt32(StatusCodes.BadAttributeIdInvalid))
        if opens(item) is not False:
            return result  # writable, but not by this user (or the node does not say): asyncua's answer
        return ua.StatusCode(ua.UInt32(StatusCodes.BadNotWritable))

    async def write_answering_not_writable(params: ua.WriteParameters, *args: Any, **kwargs: Any) -> list[ua.StatusCode]:
        results = await write(params, *args, **kwargs)
        return [answer(item, result) for item, result in zip(params.NodesToWrite, results, strict=True)]

    service.write = write_answering_not_writable  # type: ignore[method-assign]


def refused_call(parent: ua.NodeId, camera: ua.NodeId, arguments: Sequence[ua.Variant]) -> ua.CallMethodResult | None:
    """OPC UA's answer (Part 4, Call) to a ``Trigger`` call that is not one String argument on its own
    camera, which asyncua passes on unchecked: clients read the call's status, not a reply's text.
    None for a call to serve."""
    results: list[ua.StatusCode] = []
    if parent != camera:
        code = StatusCodes.BadMethodInvalid
    elif not arguments:
        code = StatusCodes.BadArgumentsMissing
    elif len(arguments) > 1:
        code = StatusCodes.BadTooManyArguments
    elif arguments[0].VariantType != ua.VariantType.String or not isinstance(arguments[0].Value, str | None):
        code = StatusCodes.BadInvalidArgument
        results = [ua.StatusCode(ua.UInt32(StatusCodes.BadTypeMismatch))]
    else:
        return None
    return ua.CallMethodResult(StatusCode=ua.StatusCode(ua.UInt32(code)), InputArgumentResults=results)


def _node_id(name: str, ns: int) -> ua.NodeId:
    """A string node id in edged's namespace: ``ns=N;s=cam0.Verdict``."""
    return ua.NodeId(ua.String(name), ua.Int16(ns))


def _kept(session: InternalSession) -> str:
    """What a session its client dropped keeps, as the log says it: its subscriptions, if any."""
    held = sum(1 for sub in session.subscription_service.subscriptions.values() if sub.session_id == session.session_id)
    if not held:
        return "its session, which holds no subscription, is kept"
    return f"its session and {held} subscription{'s' if held > 1 else ''} are kept"


def _peer(name: Any) -> str:
    """``HOST:PORT`` of a peer's address (asyncio's tuple), or what it is."""
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) and len(name) >= 2 else str(name)


def _resolve(future: asyncio.Future[VerdictMessage | TriggerError], reply: VerdictMessage | TriggerError) -> None:
    if not future.done():  # a reply after the call gave up waiting has nobody to go to
        future.set_result(reply)
