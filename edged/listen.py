"""Listening sockets: what every ZeroMQ socket edged binds gets, whatever it carries.

A bound socket faces whoever can reach its endpoint, so each one (`Listener`) is built the same way:

- ``ZMQ_MAXMSGSIZE`` of `MAX_MESSAGE_BYTES`. libzmq otherwise allocates whatever size a peer
  declares, and a PUB socket stores subscriptions in a trie with a node per byte: one peer could
  make the daemon allocate gigabytes. A subscription is a topic prefix (at most ~350 bytes with
  the longest ``topic_prefix`` and ``camera_id``), a CURVE handshake command a few hundred
  bytes; a peer that declares more is disconnected before anything is allocated.
- An ipc:// path with a live listener is refused: libzmq would silently replace the socket file,
  and the process listening there would keep running, unreachable. A connection is tried first;
  a refused one means a stale file (a crash), which is replaced as before. A path where anything
  but a socket is (a file, a folder, a link: libzmq would delete it), or one too long for a
  socket's address, is refused too (`edged.settings.endpoints.ipc_path_problem`).
- The missing folder of an ipc:// path is made only under the service's runtime directory
  (``$RUNTIME_DIRECTORY``, else /run/edged): a path elsewhere is refused when the configuration
  loads (`edged.config`), since edged running as root would make any folder it names.
- Accept failures are watched (`AcceptWatch`): out of file descriptors, libzmq leaves new
  connections waiting in the backlog and retries them, so edged keeps serving the subscribers it
  has; the journal gets one line when that starts and one when connections are accepted again.
  (While it lasts, libzmq's retries keep one core busy and every descriptor the process frees is
  taken by the next accept: the unit's ``LimitNOFILE=`` is set well above what subscribers need.)
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import zmq
from zmq.utils.monitor import parse_monitor_message, recv_monitor_message

from edged.accept import ZMQ_BIND_ROOM, ZMQ_SOCKET_ROOM, make_room
from edged.errors import BindError, PublishError
from edged.files import MadeFolders
from edged.settings.endpoints import address_of, ipc_path, ipc_path_problem, ours_to_make, tcp_host, wants_ipv6

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_MESSAGE_BYTES = 1024
PROBE_TIMEOUT_S = 1.0  # a live listener accepts at once, even when its process is stopped
REBIND_TIMEOUT_S = 5.0  # libzmq closes a socket's listeners asynchronously
RECOVERY_S = 5.0  # accepting again once no accept has failed for this long
# While accepts fail, the monitor is read this often, at most `ACCEPT_EVENTS_AT_ONCE` events at a time: libzmq,
# which retries a failed accept at once, waits meanwhile for room to say the next failure, instead of spinning a core.
ACCEPT_PAUSE_S = 0.05
ACCEPT_EVENTS_AT_ONCE = 2000  # the monitor's pipe holds about 1000 (its high-water mark, each side)
BIND_RETRY_S = 5.0  # a server whose address is taken tries it again this often, while detection goes on


async def retry_bind(
    attempt: Callable[[], Awaitable[T]],
    stop: asyncio.Event,
    said: Callable[[Exception], None],
    errors: tuple[type[Exception], ...] = (BindError,),
) -> T | None:
    """``attempt`` (an asyncio server's bind) until it binds, again every `BIND_RETRY_S` while its
    address is taken and ``stop`` is clear; ``said`` is given the first failure only, one log line
    and not one per try. None once ``stop`` is set."""
    failed = False
    while not stop.is_set():
        try:
            return await attempt()
        except errors as e:
            if not failed:
                said(e)
            failed = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), BIND_RETRY_S)
    return None


def _prepare_ipc(endpoint: str, made: MadeFolders) -> Path | None:
    """The socket's path. Its folder, when missing, is made 0750 (whatever the umask) under the
    service's runtime directory and nowhere else (`edged.settings.endpoints`): elsewhere the bind
    fails, naming the endpoint. An existing folder is left alone; the folders made are in ``made``."""
    path = ipc_path(endpoint)
    if path is None or os.path.isdir(path.parent) or not ours_to_make(path.parent):
        return path
    try:
        made.parents(path.parent, mode=0o750)
        path.parent.chmod(0o750)  # mkdir's mode passes through the umask
    except FileExistsError:
        pass
    except OSError as e:
        raise PublishError(f"cannot create the directory for {endpoint}: {e.strerror}") from None
    return path


def refuse_live_ipc(path: Path, endpoint: str, key: str) -> None:
    """Raise `PublishError` when a process accepts connections on ``path``, or no socket can be
    bound there (`ipc_path_problem`: libzmq would delete a file in its place); a stale socket is
    fine. ``key``: the setting that names the endpoint, for the message."""
    if (problem := ipc_path_problem(path)) is not None:
        raise PublishError(f"{key}: cannot bind {endpoint}: {problem}")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT_S)
    try:
        probe.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        return  # nothing there, or a socket file its process left behind
    except OSError as e:
        raise PublishError(
            f"{key}: cannot bind {endpoint}: cannot tell whether another process listens on {path} "
            f"({e.strerror or e}); remove the file if nothing uses it, or choose another ipc path"
        ) from None
    finally:
        probe.close()
    raise PublishError(
        f"{key}: cannot bind {endpoint}: another process is listening on {path} (another edged with the "
        f"same {key}?); stop it, or give each instance its own ipc path",
        in_use=True,
    )


def socket_with_room(context: zmq.Context[zmq.Socket[bytes]], socket_type: int) -> zmq.Socket[bytes]:
    """A socket of ``context``, made only with room for the descriptors libzmq opens for it (`make_room`):
    where it cannot open one it aborts the process, exit 134 without a word (a tool run under a low
    ``ulimit -n``). Raises EMFILE's `OSError`, which says what ran out."""
    make_room(ZMQ_SOCKET_ROOM)
    return context.socket(socket_type)


class AcceptWatch:
    """Logs that a socket cannot accept connections (out of descriptors, say), once per episode.

    A thread reads the socket's monitor. libzmq retries a failed accept as fast as its I/O thread
    turns, a core spinning and an event each time, and blocks that thread while the monitor's pipe is
    full: so while accepts fail, the monitor is read every `ACCEPT_PAUSE_S` only, the I/O thread
    sending the subscribers' messages in between (delayed by that at most). Any descriptor freed
    meanwhile is taken by the next accept, so the episode ends only after `RECOVERY_S` without a
    failure.
    """

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._socket = sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPT_FAILED | zmq.EVENT_MONITOR_STOPPED)
        self._thread = threading.Thread(target=self._watch, name="edged-accept", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        failing: str | None = None  # the endpoint that cannot accept
        last_failure = 0.0
        while True:
            quiet_ms = None if failing is None else max(0, int((last_failure + RECOVERY_S - time.monotonic()) * 1000))
            try:
                event = recv_monitor_message(self._monitor) if self._monitor.poll(quiet_ms) else None
            except zmq.ZMQError:  # the context was destroyed under its sockets
                return
            if event is None:
                log.info("%s: accepting connections again", failing)
                failing = None
            elif event["event"] == zmq.EVENT_MONITOR_STOPPED:
                return
            else:
                last_failure = time.monotonic()
                if failing is None:
                    failing = event["endpoint"].decode(errors="replace")
                    log.error("%s: new connections wait unaccepted: %s", failing, _accept_failure(event["value"]))
                if self._pause_and_drain():
                    return

    def _pause_and_drain(self) -> bool:
        """While accepts fail: a pause, then the events that came meanwhile read (`ACCEPT_PAUSE_S`). True when
        the monitor stopped among them."""
        time.sleep(ACCEPT_PAUSE_S)
        for _ in range(ACCEPT_EVENTS_AT_ONCE):
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            except zmq.ZMQError:  # the context was destroyed under its sockets
                return True
            if parse_monitor_message(frames)["event"] == zmq.EVENT_MONITOR_STOPPED:
                return True
        return False

    def stop(self) -> None:
        self._socket.disable_monitor()  # the thread ends on the MONITOR_STOPPED event this sends
        self._thread.join()
        self._monitor.close(linger=0)


def _accept_failure(error: int) -> str:
    if error in (errno.EMFILE, errno.ENFILE):
        return (
            f"{os.strerror(error)}; subscribers already connected keep their stream. Raise the "
            "descriptor limit (LimitNOFILE= in the unit) or find who holds so many connections"
        )
    return f"{os.strerror(error)}; libzmq retries them"


class Listener:
    """One ZeroMQ socket that binds endpoints, with the limits and checks above.

    ``configure`` sets the socket's own options (HWM, CURVE, ...) before anything is bound, and
    again on the fresh socket `reopen` makes; ``key`` is the setting that names its endpoints, which
    its errors name.
    """

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        socket_type: int,
        configure: Callable[[zmq.Socket[bytes]], None],
        key: str,
    ) -> None:
        self._context = context
        self._type = socket_type
        self._configure = configure
        self.key = key
        self.endpoints: list[str] = []
        self.socket = socket_with_room(context, socket_type)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        configure(self.socket)
        self._watch = AcceptWatch(self.socket)

    def bind(self, endpoint: str, made: MadeFolders | None = None) -> str:
        """Bind one endpoint; returns it as bound (a ``*`` port resolved). Raises `PublishError`. The
        folders made for an ipc:// socket are kept in ``made``, for a try to remove (`try_bind`)."""
        ipc_path = _prepare_ipc(endpoint, MadeFolders() if made is None else made)
        if ipc_path is not None:
            refuse_live_ipc(ipc_path, endpoint, self.key)
        try:
            self._bind(endpoint)
        except zmq.ZMQError as e:
            hint = ""
            if e.errno == zmq.EADDRINUSE:
                hint = f" (another program holds it, perhaps an edged still running: stop it or change {self.key})"
            elif e.errno == errno.ENODEV:
                hint = f" ({_no_such_address(endpoint)}: change {self.key})"
            elif e.errno == errno.EADDRNOTAVAIL:
                hint = f" (no interface of this board has that address: change {self.key})"
            in_use = e.errno == zmq.EADDRINUSE
            raise PublishError(f"{self.key}: cannot bind {endpoint}: {e.strerror}{hint}", in_use=in_use) from None
        if ipc_path is not None:
            os.chmod(ipc_path, 0o660)  # the service's group may connect, nobody else
        bound = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoints.append(bound)
        return bound

    def _bind(self, endpoint: str) -> None:
        """libzmq's bind, with ``ZMQ_IPV6`` for an IPv6 address and ``*`` (`wants_ipv6`). A name binds
        its IPv4 address, as libzmq always has; one with none, on an IPv6-only network, its IPv6 one.
        The option is the socket's as each endpoint is bound: the endpoints bound before keep theirs."""
        host = tcp_host(endpoint)
        ipv6 = host is not None and wants_ipv6(host)
        self.socket.setsockopt(zmq.IPV6, int(ipv6))
        make_room(ZMQ_BIND_ROOM)
        try:
            self.socket.bind(endpoint)
        except zmq.ZMQError as e:
            if ipv6 or e.errno != errno.ENODEV or host is None or address_of(host) is not None:
                raise
            self.socket.setsockopt(zmq.IPV6, 1)  # a name with no IPv4 address: its IPv6 one
            self.socket.bind(endpoint)

    def reopen(self) -> Listener:
        """This socket closed at once and a fresh one bound to the same endpoints.

        Every peer is cut off and must connect (and authenticate) again; ZeroMQ peers reconnect
        by themselves. Raises `PublishError` when an endpoint cannot be bound again.
        """
        self.close(linger=0)
        fresh = Listener(self._context, self._type, self._configure, self.key)
        deadline = time.monotonic() + REBIND_TIMEOUT_S
        try:
            for endpoint in self.endpoints:
                while True:
                    try:
                        fresh.bind(endpoint)
                        break
                    except PublishError:
                        if time.monotonic() >= deadline:
                            raise
                        time.sleep(0.01)  # the old listener is still closing in libzmq's I/O thread
        except BaseException:
            fresh.close(linger=0)
            raise
        return fresh

    def close(self, linger: int) -> None:
        self._watch.stop()
        self.socket.close(linger=linger)


def as_bound(endpoint: str, bound: str) -> str:
    """``bound`` (libzmq's own account of the endpoint it bound), and ``endpoint`` as configured where its
    host is written otherwise there: ``*``, a name, an unbracketed IPv6 address."""
    return bound if tcp_host(bound) == tcp_host(endpoint) else f"{bound} ({endpoint} as configured)"


def _no_such_address(endpoint: str) -> str:
    """Why libzmq found no device for ``endpoint``'s host (ENODEV)."""
    host = tcp_host(endpoint) or endpoint
    if address_of(host) is not None:
        return f"no interface of this board has the address {host}"
    return f"{host} is not an interface of this board and resolves to no address of it now"


PRIVILEGED_PORT = "a port below 1024 needs privileges edged does not have: choose a port from 1024"


def every_address(host: str) -> bool:
    """Whether ``host`` is IPv6's unspecified address (``::``, written ``[::]``), which edged's servers bind
    for IPv4 too, as ZeroMQ's ``*`` is bound (`Listener`): what Linux does by default, and not only
    there (``bindv6only``, and asyncio's servers, which bind ``::`` for IPv6 alone)."""
    address = address_of(host)
    return address is not None and address.version == 6 and address.is_unspecified


def dual_stack(sock: socket.socket) -> None:
    """An IPv6 socket that IPv4 clients reach too (as ``::ffff:a.b.c.d``), set before it binds."""
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)


def listen_tcp(key: str, listen: str, host: str, port: int, what: str, privileged: str = PRIVILEGED_PORT) -> socket.socket:
    """A TCP socket bound and listening on ``host``:``port`` as edged's servers bind (address reuse,
    as asyncio and HTTPServer set it); else `BindError` naming ``key`` (``listen`` as written), that
    ``what`` cannot happen there, and what to do (``privileged``: for a port below 1024)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if every_address(host):
            dual_stack(sock)
        sock.bind((host, port))
        sock.listen()
    except OSError as e:
        sock.close()
        hint = {
            errno.EADDRINUSE: f"another program holds it, perhaps an edged still running: stop it or change {key}",
            errno.EADDRNOTAVAIL: f"no interface of this board has that address: change {key}",
            errno.EACCES: privileged,
        }.get(e.errno or 0, f"change {key}")
        raise BindError(f"{key} {listen}: {what}: {e.strerror or e} ({hint})", in_use=e.errno == errno.EADDRINUSE) from None
    return sock


def try_bind(endpoint: str, key: str, socket_type: int) -> Callable[[], None]:
    """Bind ``endpoint`` once as a `Listener` of ``socket_type`` would (``edged check``); returns what
    releases it. Raises `PublishError` naming ``key``.

    The release returns once the endpoint is free again: a closed socket lets go of its port later,
    in libzmq's I/O thread, so the listener has a context of its own, whose ``term`` waits for that.
    libzmq leaves an ipc:// socket file behind, which the release removes: one ``sudo edged check``
    left in the service's runtime directory is root's, and the service, which cannot connect to it
    to tell whether anyone listens there, would refuse to bind the path. So are the folders made for
    it: a runtime directory ``sudo edged check`` made is root's, where the service's user could make
    no socket until systemd gave it that user at the service's next start (a second check said so).
    One another user owns by the release, or that holds a file, is left (`MadeFolders`): systemd gave
    it to a service started meanwhile.
    """
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    listener = Listener(context, socket_type, lambda sock: None, key)
    path, made = ipc_path(endpoint), MadeFolders()

    def release() -> None:
        listener.close(linger=0)
        context.term()

    try:
        listener.bind(endpoint, made)
    except BaseException:
        release()
        made.remove()
        raise

    def release_bound() -> None:
        release()
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        made.remove()

    return release_bound
