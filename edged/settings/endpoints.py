"""What a ZeroMQ endpoint setting (``publish.endpoints``, ``trigger.endpoint``) says about who can
reach it, where edged may make the folder of an ipc:// socket, and what may be at its path.

edged makes folders only under the service's own runtime directory: a missing folder anywhere
else is a mistyped path, and edged running as root would otherwise create it wherever it points.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from pathlib import Path

from edged.settings.service_dirs import service_dirs

RUNTIME_DIR = Path("/run/edged")  # the units' RuntimeDirectory=; edged's own outside systemd too
MAX_IPC_PATH_BYTES = 107  # a Unix socket's address (sun_path, 108 bytes) with libzmq's terminating NUL


def loopback_host(host: str) -> bool:
    """Whether only this machine can reach ``host``: a loopback address, or a name that resolves to loopback alone."""
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:  # an interface name or hostname: loopback only if it resolves there
            return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


def on_the_network(endpoint: str) -> bool:
    """Whether ``endpoint`` is tcp on a host (``*``, an address, a name) other machines can reach."""
    return endpoint.startswith("tcp://") and not loopback_host(endpoint[len("tcp://") :].rsplit(":", 1)[0])


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
