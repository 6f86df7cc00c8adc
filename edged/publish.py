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
tcp on a non-loopback address is refused unless ``publish.insecure`` says otherwise. A key
removed from the allow-list is cut off at the next reload (`Publisher.reload_client_keys`).
Every socket is an `edged.listen.Listener`: size-limited, and never stealing a live ipc path.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections import Counter
from functools import partial

import zmq
from zmq.auth.thread import ThreadAuthenticator

from edged.config import PublishConfig
from edged.errors import PublishError
from edged.keys import load_allowed_clients, load_secret_key
from edged.listen import Listener

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


class AllowList:
    """The subscriber keys the CURVE authenticator admits; replaced whole on reload."""

    def __init__(self) -> None:
        self.keys: frozenset[bytes] = frozenset()

    def callback(self, domain: str, key: bytes) -> bool:
        """zmq.auth's credentials-provider hook: is this Z85 public key allowed?"""
        return key in self.keys


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
        self._listeners: dict[bool, Listener] = {}  # keyed by "uses CURVE"
        self._auth: ThreadAuthenticator | None = None
        self._allowed = AllowList()
        self._server_keys = self._load_server_keys()
        try:
            if self._server_keys is not None:
                self._start_authenticator()
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

    def _configure(self, sock: zmq.Socket[bytes], curve: tuple[bytes, bytes] | None) -> None:
        """Options set before bind; the CURVE authenticator is already running."""
        sock.setsockopt(zmq.SNDHWM, self.cfg.hwm)
        sock.setsockopt(zmq.LINGER, self.cfg.linger_ms)
        if curve is not None:
            sock.curve_publickey, sock.curve_secretkey = curve
            sock.curve_server = True

    def _listener_for(self, secure: bool) -> Listener:
        if secure not in self._listeners:
            configure = partial(self._configure, curve=self._server_keys if secure else None)
            self._listeners[secure] = Listener(self._context, zmq.PUB, configure)
        return self._listeners[secure]

    def _start_authenticator(self) -> None:
        self._auth = ThreadAuthenticator(self._context, log=logging.getLogger("edged.auth"))
        try:
            self._auth.start()
        except zmq.ZMQError as e:
            raise PublishError(f"cannot start the CURVE authenticator: {e.strerror}") from None
        self._auth.configure_curve_callback(domain="*", credentials_provider=self._allowed)
        self.reload_client_keys()

    def reload_client_keys(self) -> int:
        """Re-read the allow-list directory after subscribers' keys were added or removed.

        Returns how many keys are allowed; a directory that fails its check raises
        `KeyFileError` and leaves the previous allow-list in force. When a key was removed, the
        CURVE socket is bound afresh: libzmq authenticates a peer only when it connects, so this
        is what cuts a revoked subscriber off. The others reconnect by themselves, and see the
        messages sent meanwhile as a gap in ``seq``.
        """
        if self._auth is None or self.cfg.curve_clients_dir is None:
            return 0
        keys = load_allowed_clients(self.cfg.curve_clients_dir, "publish.curve_clients_dir")
        revoked = self._allowed.keys - keys
        self._allowed.keys = keys
        if not keys:
            log.warning("no client keys in %s: no subscriber can connect over tcp", self.cfg.curve_clients_dir)
        else:
            log.info("CURVE: %d subscriber key(s) allowed from %s", len(keys), self.cfg.curve_clients_dir)
        curve = self._listeners.pop(True, None) if revoked else None
        if curve is not None:
            self._listeners[True] = curve.reopen()
            log.warning(
                "%d subscriber key(s) revoked: %s bound afresh, so every subscriber authenticates again",
                len(revoked),
                ", ".join(curve.endpoints),
            )
        return len(keys)

    def _bind(self, endpoint: str) -> None:
        secure = self._secure(endpoint)
        if not secure:
            check_exposure(endpoint, self.cfg.insecure)
        bound = self._listener_for(secure).bind(endpoint)
        self.endpoints.append(bound)
        log.info("publishing on %s%s", bound, " with CURVE" if secure else "")

    def send(self, topic: bytes, payload: bytes) -> bool:
        """Queue one message for every subscriber; False (and counted) when it could not go out."""
        results = [self._send_on(listener.socket, topic, payload) for listener in self._listeners.values()]
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
        for listener in self._listeners.values():
            listener.close(linger=linger)
        self._listeners.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
