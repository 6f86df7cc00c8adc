"""Publish: ZeroMQ PUB sockets that fan detections out to any number of subscribers.

A PUB socket never blocks and never grows without bound: each subscriber has a queue of at most
``hwm`` messages and, once it is full, libzmq drops that subscriber's new messages silently (it
does not raise ``zmq.Again``). The publisher therefore cannot see those drops; every message
carries a per-topic ``seq`` so a subscriber sees its own gaps. What the publisher can see (a send
error, a socket that refuses) is counted and never raised into the pipeline.

Security. ipc:// endpoints are protected by the filesystem: the socket file is 0660 in a 0750
directory, so only the service's group can connect. tcp:// endpoints are encrypted and
authenticated with CurveZMQ when ``publish.curve_server_key`` and ``publish.curve_clients_dir``
are set: only subscribers whose public key is in that directory get anything. A ZeroMQ socket
has one security mechanism for all its endpoints, so with keys configured the tcp endpoints get
a CURVE socket of their own and the ipc endpoints stay on a plain one; every message goes to
both. Local consumers need no keys, and nothing on the network is plaintext. Without keys,
tcp on a non-loopback address is refused unless ``publish.insecure`` says otherwise.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections import Counter
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from edged.config import PublishConfig
from edged.errors import PublishError
from edged.keys import load_allowed_clients, load_secret_key

log = logging.getLogger(__name__)


def detections_topic(prefix: str, camera_id: str) -> bytes:
    return f"{prefix}/detections/{camera_id}".encode()


def status_topic(prefix: str, camera_id: str) -> bytes:
    return f"{prefix}/status/{camera_id}".encode()


def verdict_topic(prefix: str, camera_id: str) -> bytes:
    return f"{prefix}/verdict/{camera_id}".encode()


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:  # an interface name or hostname: loopback only if it resolves there
            return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


def check_exposure(endpoint: str, insecure: bool) -> None:
    """Refuse plaintext tcp on a non-loopback address unless the config says so explicitly."""
    if not endpoint.startswith("tcp://") or insecure:
        return
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
    if not _is_loopback(host):
        raise PublishError(
            f"{endpoint} would publish unencrypted detections to the network; bind a loopback "
            "address or ipc://, or set publish.insecure = true to accept that"
        )


def prepare_ipc(endpoint: str) -> Path | None:
    """The socket's directory: created 0750 (whatever the umask) if missing, left alone if not."""
    if not endpoint.startswith("ipc://"):
        return None
    path = Path(endpoint[len("ipc://") :])
    try:
        path.parent.mkdir(parents=True, mode=0o750)
        path.parent.chmod(0o750)  # mkdir's mode passes through the umask
    except FileExistsError:
        pass
    except OSError as e:
        raise PublishError(f"cannot create the directory for {endpoint}: {e.strerror}") from None
    return path


class Publisher:
    """Binds the configured endpoints and sends multipart [topic, payload] without ever blocking.

    Raises `PublishError` for an endpoint it cannot bind and `KeyFileError` for unusable keys.
    With CURVE it runs the context's ZAP authenticator, so one such publisher per context.
    """

    def __init__(self, cfg: PublishConfig, context: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self.cfg = cfg
        self.drops: Counter[str] = Counter()
        self.sent = 0
        self.endpoints: list[str] = []
        self._context = context or zmq.Context.instance()
        self._sockets: dict[bool, zmq.Socket[bytes]] = {}  # keyed by "uses CURVE"
        self._auth: ThreadAuthenticator | None = None
        self._server_keys = self._load_server_keys()
        try:
            for endpoint in cfg.endpoints:
                self._bind(endpoint)
        except BaseException:
            self._release(linger=0)
            raise

    def _load_server_keys(self) -> tuple[bytes, bytes] | None:
        if self.cfg.curve_server_key is None or self.cfg.curve_clients_dir is None:
            return None
        return load_secret_key(self.cfg.curve_server_key, "publish.curve_server_key")

    def _secure(self, endpoint: str) -> bool:
        return self._server_keys is not None and endpoint.startswith("tcp://")

    def _socket_for(self, secure: bool) -> zmq.Socket[bytes]:
        if secure not in self._sockets:
            sock = self._context.socket(zmq.PUB)
            self._sockets[secure] = sock
            sock.setsockopt(zmq.SNDHWM, self.cfg.hwm)
            sock.setsockopt(zmq.LINGER, self.cfg.linger_ms)
            if secure and self._server_keys is not None:
                self._start_curve(sock, self._server_keys)
        return self._sockets[secure]

    def _start_curve(self, sock: zmq.Socket[bytes], server_keys: tuple[bytes, bytes]) -> None:
        """Authenticator first, then the server keys: both must be in place before bind."""
        self._auth = ThreadAuthenticator(self._context, log=logging.getLogger("edged.auth"))
        try:
            self._auth.start()
        except zmq.ZMQError as e:
            raise PublishError(f"cannot start the CURVE authenticator: {e.strerror}") from None
        self.reload_client_keys()
        sock.curve_publickey, sock.curve_secretkey = server_keys
        sock.curve_server = True

    def reload_client_keys(self) -> int:
        """Re-read the allow-list directory after subscribers' keys were added or removed.

        Returns how many keys are allowed; a directory that fails its check raises
        `KeyFileError` and leaves the previous allow-list in force.
        """
        if self._auth is None or self.cfg.curve_clients_dir is None:
            return 0
        count = load_allowed_clients(self.cfg.curve_clients_dir, "publish.curve_clients_dir")
        self._auth.configure_curve(domain="*", location=str(self.cfg.curve_clients_dir))
        if count == 0:
            log.warning("no client keys in %s: no subscriber can connect over tcp", self.cfg.curve_clients_dir)
        else:
            log.info("CURVE: %d subscriber key(s) allowed from %s", count, self.cfg.curve_clients_dir)
        return count

    def _bind(self, endpoint: str) -> None:
        secure = self._secure(endpoint)
        if not secure:
            check_exposure(endpoint, self.cfg.insecure)
        sock = self._socket_for(secure)
        ipc_path = prepare_ipc(endpoint)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise PublishError(f"cannot bind {endpoint}: {e.strerror}") from None
        if ipc_path is not None:
            os.chmod(ipc_path, 0o660)  # the service's group may subscribe, nobody else
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoints.append(bound)
        log.info("publishing on %s%s", bound, " with CURVE" if secure else "")

    def send(self, topic: bytes, payload: bytes) -> bool:
        """Queue one message for every subscriber; False (and counted) when it could not go out."""
        results = [self._send_on(sock, topic, payload) for sock in self._sockets.values()]
        if all(results):
            self.sent += 1
        return all(results)

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
        for sock in self._sockets.values():
            sock.close(linger=linger)
        self._sockets.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
