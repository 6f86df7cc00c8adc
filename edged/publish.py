"""Publish: one ZeroMQ PUB socket that fans detections out to any number of subscribers.

A PUB socket never blocks and never grows without bound: each subscriber has a queue of at most
``hwm`` messages and, once it is full, libzmq drops that subscriber's new messages silently (it
does not raise ``zmq.Again``). The publisher therefore cannot see those drops; every message
carries a per-topic ``seq`` so a subscriber sees its own gaps. What the publisher can see (a send
error, a socket that refuses) is counted and never raised into the pipeline.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections import Counter
from pathlib import Path

import zmq

from edged.config import PublishConfig

log = logging.getLogger(__name__)


class PublishError(Exception):
    """The socket cannot be set up as configured (address in use, forbidden exposure)."""


def detections_topic(prefix: str, camera_id: str) -> bytes:
    return f"{prefix}/detections/{camera_id}".encode()


def status_topic(prefix: str, camera_id: str) -> bytes:
    return f"{prefix}/status/{camera_id}".encode()


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:  # an interface name or hostname: loopback only if it resolves there
            return all(ipaddress.ip_address(info[4][0]).is_loopback
                       for info in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


def check_exposure(endpoint: str, insecure: bool) -> None:
    """Refuse plaintext tcp on a non-loopback address unless the config says so explicitly."""
    if not endpoint.startswith("tcp://") or insecure:
        return
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
    if not _is_loopback(host):
        raise PublishError(
            f"{endpoint} would publish unencrypted detections to the network; bind a loopback "
            "address or ipc://, or set publish.insecure = true to accept that"
        )


def _prepare_ipc(endpoint: str) -> Path | None:
    if not endpoint.startswith("ipc://"):
        return None
    path = Path(endpoint[len("ipc://"):])
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    except OSError as e:
        raise PublishError(f"cannot create the directory for {endpoint}: {e.strerror}") from None
    return path


class Publisher:
    """Binds the configured endpoints and sends multipart [topic, payload] without ever blocking."""

    def __init__(self, cfg: PublishConfig, context: zmq.Context | None = None) -> None:
        self.cfg = cfg
        self.drops: Counter[str] = Counter()
        self.sent = 0
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._socket.setsockopt(zmq.LINGER, cfg.linger_ms)
        self.endpoints: list[str] = []
        try:
            for endpoint in cfg.endpoints:
                self._bind(endpoint)
        except PublishError:
            self._socket.close(linger=0)
            raise

    def _bind(self, endpoint: str) -> None:
        check_exposure(endpoint, self.cfg.insecure)
        ipc_path = _prepare_ipc(endpoint)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            raise PublishError(f"cannot bind {endpoint}: {e.strerror}") from None
        if ipc_path is not None:
            os.chmod(ipc_path, 0o660)  # the service's group may subscribe, nobody else
        bound = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoints.append(bound)
        log.info("publishing on %s", bound)

    def send(self, topic: bytes, payload: bytes) -> bool:
        """Queue one message for every subscriber; False (and counted) when it could not go out."""
        try:
            self._socket.send_multipart((topic, payload), flags=zmq.NOBLOCK, copy=True)
        except zmq.Again:
            self.drops["publish_full"] += 1
            return False
        except zmq.ZMQError as e:
            self.drops["publish_error"] += 1
            if self.drops["publish_error"] == 1:
                log.error("publishing failed: %s (further failures are only counted)", e.strerror)
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        """Flush what is queued for at most ``linger_ms``, then release the endpoints."""
        self._socket.close(linger=self.cfg.linger_ms)
