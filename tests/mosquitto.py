"""A real MQTT broker for the tests: Debian's Mosquitto on a free loopback port, with a config the test writes.

`Broker` runs ``mosquitto -c`` as a subprocess (anonymous, with a password file made by
``mosquitto_passwd``, or TLS with a CA and server certificate made by `make_ca`/`make_server_cert`
with ``openssl``), waits until it accepts connections, and can be killed and started again on the
same port. `Listener` is an independent paho client that records everything under a topic filter.
`Gate` forwards one client's connection to the broker, so that a test can cut that link alone.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from waiting import wait_for

MOSQUITTO = "/usr/sbin/mosquitto"
STOP_TIMEOUT_S = 90.0  # a clean stop saves a persistent broker's sessions, synced: slow on a disk the suite keeps busy


@dataclass(frozen=True)
class Tls:
    """The files of a TLS listener: the CA that signed the server's certificate, and the server's pair."""

    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key)."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
        "-keyout", key, "-out", cert,
    )  # fmt: skip
    return cert, key


def make_server_cert(directory: Path, ca: tuple[Path, Path]) -> Tls:
    """A server certificate for 127.0.0.1 and localhost, signed by ``ca``."""
    key, csr, cert = directory / "server.key", directory / "server.csr", directory / "server.crt"
    ext = directory / "server.ext"
    ext.write_text("subjectAltName = IP:127.0.0.1, DNS:localhost\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", key, "-out", csr)
    _openssl(
        "x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial", "-days", "2",
        "-extfile", ext, "-out", cert,
    )  # fmt: skip
    return Tls(ca[0], cert, key)


def make_password_file(path: Path, user: str, password: str) -> Path:
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(path), user, password], check=True, capture_output=True, timeout=30)
    return path


class Broker:
    """Mosquitto on ``port``: anonymous, or with ``password_file``, or TLS; `close` always stops it."""

    def __init__(
        self,
        directory: Path,
        port: int,
        *,
        password_file: Path | None = None,
        tls: Tls | None = None,
        persistent: bool = False,
    ) -> None:
        """``persistent``: sessions and all their queued messages survive a `stop` and `start` (saved at a clean stop)."""
        self.port = port
        self.log_path = directory / f"mosquitto-{port}.log"
        self.config = directory / f"mosquitto-{port}.conf"
        lines = [
            f"listener {port} 127.0.0.1",
            # persistent: an absent subscriber's messages all wait for it (Mosquitto keeps 1000 by default)
            f"persistence true\npersistence_location {directory}/\nmax_queued_messages 0"
            if persistent
            else "persistence false",
            "user root",  # started as root, Mosquitto would switch to its own user, who cannot read the test's files
            f"allow_anonymous {'false' if password_file else 'true'}",
        ]
        if password_file:
            lines.append(f"password_file {password_file}")
        if tls:
            lines += [f"cafile {tls.ca}", f"certfile {tls.cert}", f"keyfile {tls.key}"]
        self.config.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self, timeout_s: float = 20.0) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.config)], stdout=log, stderr=subprocess.STDOUT)
        if not wait_for(self._accepting, timeout_s):
            self.close()
            raise AssertionError(f"mosquitto did not listen on {self.port} in {timeout_s} s:\n{self.log()}")

    def _accepting(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"mosquitto exited with {self.proc.returncode}:\n{self.log()}")
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM: a clean stop, which saves a persistent broker's sessions. Sent again each second:
        Mosquitto sets its run flag only after installing its handler, as its loop begins, so a
        SIGTERM just after it began to listen is lost (it then ran on for good)."""
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"mosquitto did not stop in {timeout_s} s after SIGTERM:\n{self.log()}")
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(1.0)

    def kill(self) -> None:
        """SIGKILL: every connection drops at once, nothing is said to the clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Received:
    topic: str
    payload: bytes
    retain: bool


@dataclass
class Listener:
    """An independent paho subscriber on ``topic_filter``; every message it gets lands in ``messages``."""

    port: int
    topic_filter: str = "#"
    username: str | None = None
    password: str | None = None
    ca: Path | None = None
    messages: list[Received] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self.client = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2)
        if self.username:
            self.client.username_pw_set(self.username, self.password)
        if self.ca:
            self.client.tls_set(ca_certs=str(self.ca))
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *args: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", self.port, keepalive=10)
        self.client.loop_start()
        assert self._subscribed.wait(20), "the listener did not subscribe"

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        client.subscribe(self.topic_filter, qos=1)

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        with self._lock:
            self.messages.append(Received(message.topic, bytes(message.payload), bool(message.retain)))

    def on(self, topic: str) -> list[Received]:
        with self._lock:
            return [m for m in self.messages if m.topic == topic]

    def wait(self, topic: str, count: int = 1, timeout_s: float = 30.0) -> list[Received]:
        """The messages on ``topic`` once there are ``count`` of them; AssertionError after ``timeout_s``."""
        if not wait_for(lambda: len(self.on(topic)) >= count, timeout_s):
            with self._lock:
                seen = sorted({m.topic for m in self.messages})
            raise AssertionError(
                f"{len(self.on(topic))} of {count} message(s) on {topic} in {timeout_s} s; topics seen: {seen}"
            )
        return self.on(topic)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class Gate:
    """A TCP forwarder from a free loopback port to the broker's that the test can cut: whoever connects
    through it loses the link (and cannot connect again until `reopen`), while the broker stays up for
    everyone else, such as a `Listener` connected to it directly."""

    def __init__(self, broker_port: int) -> None:
        self.broker_port = broker_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.open = True
        self._lock = threading.Lock()
        self._links: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed
                return
            if not self.open:
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.broker_port), timeout=10)
            upstream.settimeout(None)
            with self._lock:
                self._links += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        source.close()

    def cut(self) -> None:
        self.open = False
        with self._lock:
            links, self._links = self._links, []
        for sock in links:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def reopen(self) -> None:
        self.open = True

    def close(self) -> None:
        self.cut()
        self.server.close()
