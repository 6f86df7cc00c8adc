"""A real resolver path for tests: a tiny DNS server on a loopback address of its own, and commands
run in a mount namespace of their own (``unshare -m``) where /etc/resolv.conf (and, if given,
/etc/hosts) are bind-mounted files pointing at it. The machine's own files are never touched.

The server answers each name as told (`Answer`): addresses (A and AAAA), NXDOMAIN, SERVFAIL, or
nothing at all (a resolver that times out), after a delay if asked; what it answers can change while
it runs (`DnsServer.answer`), as a network's DNS comes back.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import random
import shutil
import socket
import struct
import subprocess
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from daemon import RunningDaemon

NOERROR, SERVFAIL, NXDOMAIN = 0, 2, 3
A, AAAA = 1, 28


@dataclass(frozen=True)
class Answer:
    """What the server says of a name: its ``addresses`` (IPv4 and IPv6), or ``rcode`` (NXDOMAIN,
    SERVFAIL), or nothing when ``silent``; after ``delay_s``."""

    addresses: Sequence[str] = ()
    rcode: int = NOERROR
    delay_s: float = 0.0
    silent: bool = False


NO_SUCH_NAME = Answer(rcode=NXDOMAIN)
BROKEN = Answer(rcode=SERVFAIL)
TIMES_OUT = Answer(silent=True)


def _question(packet: bytes) -> tuple[str, int, int]:
    """(name, qtype, the offset after the question) of a query."""
    labels, pos = [], 12
    while (length := packet[pos]) != 0:
        labels.append(packet[pos + 1 : pos + 1 + length].decode("ascii", "replace").lower())
        pos += 1 + length
    qtype = struct.unpack_from("!H", packet, pos + 1)[0]
    return ".".join(labels), qtype, pos + 5


def _reply(query: bytes, answer: Answer) -> bytes:
    name, qtype, end = _question(query)
    del name
    records = b""
    count = 0
    if answer.rcode == NOERROR:
        for text in answer.addresses:
            address = ipaddress.ip_address(text)
            kind = A if address.version == 4 else AAAA
            if kind == qtype:
                records += struct.pack("!HHHIH", 0xC00C, kind, 1, 5, len(address.packed)) + address.packed
                count += 1
    flags = 0x8180 | (query[2] & 0x01) << 8 | answer.rcode  # a response, recursion desired as asked and available
    header = struct.pack("!HHHHHH", struct.unpack_from("!H", query)[0], flags, 1, count, 0, 0)
    return header + query[12:end] + records


@dataclass
class DnsServer:
    """UDP DNS on ``address``:53 (a loopback address no one else uses); names not in `answers` get NXDOMAIN."""

    answers: dict[str, Answer] = field(default_factory=dict)
    queries: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for _ in range(20):
            self.address = f"127.{random.randrange(64, 250)}.{random.randrange(1, 250)}.{random.randrange(2, 250)}"
            try:
                self._socket.bind((self.address, 53))
                break
            except OSError:
                continue
        else:
            self._socket.close()
            pytest.skip("no loopback address with port 53 free for a test DNS server")
        self._socket.settimeout(0.1)  # the serving thread sees `close` within this
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="test-dns", daemon=True)
        self._thread.start()

    def answer(self, name: str, answer: Answer) -> None:
        with self._lock:
            self.answers[name.lower()] = answer

    def asked(self, name: str) -> int:
        with self._lock:
            return self.queries[name.lower()]

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                query, peer = self._socket.recvfrom(512)
                name, _, _ = _question(query)
            except (OSError, IndexError, struct.error):
                continue
            with self._lock:
                self.queries[name] += 1
                answer = self.answers.get(name, NO_SUCH_NAME)
            if answer.silent:
                continue
            reply = _reply(query, answer)
            if answer.delay_s:
                timer = threading.Timer(answer.delay_s, self._send, (reply, peer))
                timer.daemon = True
                timer.start()
            else:
                self._send(reply, peer)

    def _send(self, reply: bytes, peer: tuple[str, int]) -> None:
        if not self._closed.is_set():
            try:
                self._socket.sendto(reply, peer)
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        self._socket.close()


_count = itertools.count()


class Resolver:
    """Files for a namespace of its own: a resolv.conf naming ``server`` (one try, ``timeout_s`` each)
    and an /etc/hosts of ``hosts`` (name -> address) besides localhost; `command` runs a command there."""

    def __init__(self, directory: Path, server: DnsServer, hosts: dict[str, str] | None = None, timeout_s: int = 1) -> None:
        if os.geteuid() != 0 or shutil.which("unshare") is None:
            pytest.skip("a resolver of its own needs root and unshare (mount namespaces)")
        n = next(_count)
        self.resolv_conf = directory / f"resolv-{n}.conf"
        self.resolv_conf.write_text(f"nameserver {server.address}\noptions timeout:{timeout_s} attempts:1\n")
        self.hosts = directory / f"hosts-{n}"
        lines = ["127.0.0.1 localhost"] + [f"{address} {name}" for name, address in (hosts or {}).items()]
        self.hosts.write_text("\n".join(lines) + "\n")
        probe = subprocess.run(self.command(["true"]), capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            pytest.skip(f"cannot run in a mount namespace of its own here: {probe.stderr.strip()}")

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run with this resolver: its own mount namespace, the two files bind-mounted there."""
        script = 'mount --bind "$1" /etc/resolv.conf && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                str(self.resolv_conf), str(self.hosts), *argv]  # fmt: skip


class ResolvedDaemon(RunningDaemon):
    """`RunningDaemon`, with ``edged run`` in ``resolver``'s namespace."""

    def __init__(self, config: Path, endpoint: str, resolver: Resolver, env: dict[str, str] | None = None) -> None:
        super().__init__(config, endpoint, env, wrap=resolver.command)
