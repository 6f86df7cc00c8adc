"""What a ZeroMQ endpoint setting (``publish.endpoints``, ``trigger.endpoint``) says about who can
reach it, where edged may make the folder of an ipc:// socket, and what may be at its path.

edged makes folders only under the service's own runtime directory: a missing folder anywhere
else is a mistyped path, and edged running as root would otherwise create it wherever it points.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import stat
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from edged.settings.service_dirs import service_dirs

RUNTIME_DIR = Path("/run/edged")  # the units' RuntimeDirectory=; edged's own outside systemd too
MAX_IPC_PATH_BYTES = 107  # a Unix socket's address (sun_path, 108 bytes) with libzmq's terminating NUL
NAME_WAIT_S = 5.0  # how long the configuration's check waits for the resolver on a host name (`same_place`)
SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's IPv4 address


def tcp_host(endpoint: str) -> str | None:
    """The host of a tcp:// endpoint as written (``*``, an address, ``[v6]``, a name); None for another transport."""
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint[len("tcp://") :].rpartition(":")[0]


def address_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address (``[v6]`` with or without its brackets); None for a name or ``*``."""
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None


def wants_ipv6(host: str) -> bool:
    """Whether a ZeroMQ socket needs ``ZMQ_IPV6`` for ``host``: an IPv6 address, and ``*`` (every
    address, IPv6 and IPv4 both). Names keep libzmq's IPv4 resolution, as ``localhost`` always had."""
    address = address_of(host)
    return host == "*" or (address is not None and address.version == 6)


def look_up(host: str, timeout_s: float | None) -> list[str] | str:
    """The addresses ``host`` resolves to, in the resolver's order; or why there are none: it resolves
    to none, or the resolver has not answered within ``timeout_s`` (None: as long as it takes).

    The lookup runs in a thread of its own, so that the wait ends with ``timeout_s``, or with a signal
    (Ctrl-C), even while the resolver waits on a DNS server that does not answer; a lookup left behind
    ends with the resolver's own timeout."""
    found: list[list[str] | str] = []
    done = threading.Event()

    def run() -> None:
        try:
            found.append(list(dict.fromkeys(str(info[4][0]) for info in socket.getaddrinfo(host, None))))
        except (OSError, UnicodeError) as e:
            found.append(f"{host} does not resolve now ({getattr(e, 'strerror', None) or e})")
        done.set()

    threading.Thread(target=run, name="edged-lookup", daemon=True).start()
    if not done.wait(timeout_s):
        return f"no answer from the resolver for {host} within {timeout_s:.3g} s"
    return found[0] or f"{host} resolves to no address"


def host_port(host: str, port: int) -> str:
    """``host``:``port`` as written in a URL: an IPv6 address in brackets (``[::1]:554``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def by_name(endpoint: str) -> str | None:
    """The host name of a tcp:// endpoint that names one (not an address, ``*`` or a source;host pair)."""
    host = tcp_host(endpoint)
    if host is None or host == "*" or ";" in host or address_of(host) is not None:
        return None
    return host


def with_address(endpoint: str, address: str) -> str:
    """``endpoint`` with its host replaced by ``address`` (in brackets when IPv6)."""
    port = endpoint.rpartition(":")[2]
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


def connect_ipv6(endpoint: str, addresses: Sequence[str] = ()) -> bool:
    """Whether a client socket needs ``ZMQ_IPV6`` to connect to ``endpoint``: an IPv6 address, or a name
    whose ``addresses`` are IPv6 alone (an IPv6-only network). Without it libzmq resolves names to
    IPv4 only, and never tries an IPv6 address: it waits in silence."""
    host = tcp_host(endpoint)
    if host is None:
        return False
    if (address := address_of(host)) is not None:
        return address.version == 6
    return bool(addresses) and all(":" in a for a in addresses)


def _interfaces() -> set[str]:
    try:
        return {name for _, name in socket.if_nameindex()}
    except OSError:
        return set()


def loopback_host(host: str) -> bool:
    """Whether only this machine can reach ``host``: a loopback address, or a name that resolves to loopback alone."""
    return _loopback(host) is True


def _loopback(host: str) -> bool | None:
    """`loopback_host`, and None for a name that resolves to nothing now (DNS may answer later)."""
    if host in ("localhost", ""):
        return True
    if (address := address_of(host)) is not None:
        return address.is_loopback
    if host == "*":
        return False
    if host in _interfaces():  # libzmq binds an interface's address
        return host == "lo"
    addresses = look_up(host, None)  # a host name: loopback only if it resolves there alone
    if isinstance(addresses, str):
        return None
    return all((a := address_of(x)) is not None and a.is_loopback for x in addresses)


def exposure(endpoint: str) -> bool | None:
    """Whether other machines can reach ``endpoint`` (tcp on ``*``, an address, a name; `loopback_host`):
    True or False, and None for a name that resolves to nothing now (DNS may answer later)."""
    host = tcp_host(endpoint)
    if host is None:
        return False
    loopback = _loopback(host)
    return None if loopback is None else not loopback


def on_the_network(endpoint: str) -> bool:
    """Whether ``endpoint`` is tcp on a host (``*``, an address, a name) other machines can reach. A
    name that resolves to nothing now is not: nothing can be bound there until it does, and the
    bind says so (`unresolved`), a network's outage rather than the configuration's fault."""
    return exposure(endpoint) is True


def unresolved(endpoint: str) -> str:
    """Why ``endpoint``, whose host is a name that resolves to nothing now (`exposure` None), cannot be bound."""
    return (
        f"{tcp_host(endpoint)} resolves to no address now (a name DNS or /etc/hosts does not know, or cannot "
        "tell yet): fix the name or the resolver, or bind an IP address"
    )


Place = tuple[str, str]  # where a socket listens: (host, port), or (`IPC`, its path)
IPC = "ipc://"


def _port(endpoint: str) -> str:
    return endpoint.rpartition(":")[2]


def bind_problem(endpoint: str) -> str | None:
    """Why a ZeroMQ endpoint (tcp:// or ipc://) cannot be bound as written: a tcp one without a port
    from 0 to 65535 or ``*`` (libzmq refuses one missing, and binds a larger number modulo 65536, a port
    no peer is told), an ipc one without a path or at ``*`` (a path libzmq makes up, nobody is told)."""
    if endpoint.startswith(IPC):
        return f"{endpoint!r} names no path: write ipc:///FOLDER/NAME.sock" if endpoint in (IPC, IPC + "*") else None
    port = _port(endpoint)
    if port == "*" or (port.isascii() and port.isdigit() and int(port) < 65536):
        return None
    return f"{endpoint!r} has no port from 0 to 65535 (or *, a port the kernel chooses): write tcp://HOST:PORT"


def zmq_place(endpoint: str) -> Place | None:
    """Where a ZeroMQ endpoint that `bind_problem` passes listens (`Place`); None for a port chosen as
    it binds: ``*``, and 0, which libzmq gives the kernel to choose as it does ``*``. An ipc path is
    the one the kernel binds: from the working folder where it is relative, its folder's links followed."""
    if endpoint.startswith("ipc://@"):
        return IPC, endpoint
    if endpoint.startswith(IPC):
        folder, name = os.path.split(os.path.abspath(endpoint[len(IPC) :]))
        try:
            return IPC, os.path.join(os.path.realpath(folder), name)
        except ValueError:  # a NUL, which `ipc_folder_problem` names
            return IPC, endpoint
    host, port = tcp_host(endpoint) or "", _port(endpoint)
    return (host, str(int(port))) if port.isdigit() and int(port) else None


def _interface_ipv4(name: str) -> str | None:
    """The IPv4 address of the interface ``name``; None where it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", os.fsencode(name)[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


def _name_bound(host: str) -> str | None:
    """The address libzmq binds for the name ``host``: an interface's IPv4 address; else the first IPv4
    address the name resolves to, or its first IPv6 one without one (`edged.listen.Listener`). None
    where there is none now, or the resolver has not answered within `NAME_WAIT_S`."""
    if host.lower() == "localhost":
        return "127.0.0.1"
    if host in _interfaces():
        return _interface_ipv4(host)
    found = look_up(host, NAME_WAIT_S)
    return None if isinstance(found, str) else next((a for a in found if ":" not in a), found[0])


def bound_host(host: str) -> str:
    """``host`` as the kernel binds it: an address in its one spelling, an IPv4-mapped one
    (``::ffff:a.b.c.d``) as its IPv4 address, ``::`` as ``*`` (every address of both families, as
    ZeroMQ and edged's servers bind it), a name as the address it binds (`_name_bound`)."""
    host = host.removeprefix("[").removesuffix("]")
    if host != "*" and address_of(host) is None:
        host = _name_bound(host) or host.lower()
    address = address_of(host)
    if isinstance(address, ipaddress.IPv6Address):
        if address.is_unspecified:
            return "*"
        address = address.ipv4_mapped or address
    return str(address) if address is not None else host


def same_place(a: Place, b: Place, bound: Callable[[str], str] = bound_host) -> bool:
    """Whether two sockets would listen at one place, so that the second cannot bind: one ipc path, or
    one port on hosts that overlap: the same address, ZeroMQ's ``*`` or ``::`` (every address, IPv6 and
    IPv4) beside any, ``0.0.0.0`` beside an IPv4 address. A name is the address it binds, where it has
    one now; else it matches only itself. ``bound``: `bound_host`, or a cache of it where one place is
    compared with several, so that a name is looked up once."""
    if a[1] != b[1] or (a[0] == IPC) != (b[0] == IPC):
        return False
    if a[0] == IPC:  # one path: no host to look up
        return True
    hosts = {bound(a[0]), bound(b[0])}
    if len(hosts) == 1 or "*" in hosts:
        return True
    return "0.0.0.0" in hosts and all((x := address_of(h)) is not None and x.version == 4 for h in hosts)


def runtime_dirs() -> tuple[Path, ...]:
    """The service's own runtime directories: systemd's ``$RUNTIME_DIRECTORY`` (several joined by
    ``:``) when it is set, else `RUNTIME_DIR`."""
    return service_dirs("runtime") or (RUNTIME_DIR,)


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ipc:// endpoint; None for another transport, and for an abstract name
    (``ipc://@name``), which has no file, folder or mode."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    return Path(endpoint[len("ipc://") :])


def ipc_path_problem(path: Path) -> str | None:
    """Why no socket can be bound at ``path``: it is too long for a socket's address, or something
    other than a socket is there. libzmq's bind deletes a file or a link to put its socket in its
    place (a mistyped path would cost that file), and fails on a folder as if the address were taken."""
    length = len(os.fsencode(path))
    if length > MAX_IPC_PATH_BYTES:
        return f"the path is {length} bytes and a socket's holds at most {MAX_IPC_PATH_BYTES}: choose a shorter one"
    try:
        mode = path.lstat().st_mode
    except (OSError, ValueError):  # nothing there, or nothing to be looked at here: the bind says why
        return None
    if stat.S_ISSOCK(mode):
        return None
    if stat.S_ISDIR(mode):
        return f"{path} is a folder, not a socket: choose another path"
    what = "a link" if stat.S_ISLNK(mode) else "a file"
    return f"{path} is {what}, not a socket, which edged would replace: remove it, or choose another path"


def ours_to_make(folder: Path) -> bool:
    """Whether edged may create ``folder``: it lies in one of `runtime_dirs` (or is one), ``..`` and
    links resolved; not one its links loop through (the bind then says so)."""
    try:
        resolved, runtime = folder.resolve(), [r.resolve() for r in runtime_dirs()]
    except (OSError, RuntimeError):  # RuntimeError: a loop, before Python 3.13
        return False
    return any(d == resolved or d in resolved.parents for d in runtime)


def ipc_folder_problem(endpoint: str) -> str | None:
    """Why an ipc:// endpoint's socket cannot be had: its folder is missing and not edged's to make,
    it is no folder, the path holds a NUL, or `ipc_path_problem`. None when it is there, will be
    made, or cannot be looked at here (the bind then says why)."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    if (problem := ipc_path_problem(path)) is not None:
        return f"{endpoint}: {problem}"
    folder = Path(os.path.abspath(path)).parent
    try:
        is_folder = stat.S_ISDIR(folder.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        if ours_to_make(folder):
            return None
        where = " or ".join(str(d) for d in runtime_dirs())
        return (
            f"{endpoint}: the folder {folder} does not exist, and edged makes folders only under its "
            f"runtime directory ({where}): create it, or put the socket there"
        )
    except ValueError:  # the only one os.stat raises: a NUL, which no path holds
        return f"{endpoint!r}: a path cannot hold a NUL character"
    except OSError:
        return None
    return None if is_folder else f"{endpoint}: {folder} is not a folder"
