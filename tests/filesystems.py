"""Filesystems that fail for real in tests: a small tmpfs that fills up, a read-only mount, a folder's mode,
a file whose opening stalls, a process with no descriptor left."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import resource
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def no_descriptor_left() -> Iterator[None]:
    """Meanwhile this process's descriptor limit at its lowest free descriptor: nothing more opens (EMFILE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)  # a new descriptor takes the lowest free number
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # no number at or above it
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.contextmanager
def tmpfs(folder: Path, options: str) -> Iterator[bool]:
    """A tmpfs mounted with ``options`` on ``folder`` while inside; False where this process may not mount."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)]).returncode:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


@contextlib.contextmanager
def read_only_folder(folder: Path) -> Iterator[int]:
    """``folder`` made unwritable, with the errno a write then meets: a read-only mount where this process
    may mount (EROFS), else its mode (EACCES; root ignores modes, so root without mounts cannot have it)."""
    with tmpfs(folder, "ro,size=64k") as mounted:
        if mounted:
            yield errno.EROFS
            return
    if os.geteuid() == 0:
        pytest.skip("root ignores file modes and may not mount here: no read-only folder to be had")
    folder.chmod(0o555)
    try:
        yield errno.EACCES
    finally:
        folder.chmod(0o755)


def fill(path: Path) -> None:
    """Write ``path`` until its filesystem has no room left."""
    with path.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


@contextlib.contextmanager
def opening_stalled(path: Path) -> Iterator[Callable[[], bool]]:
    """While inside, another process's ``open`` of ``path`` waits, as on a stalled disk: the kernel holds it
    until this write lease (``F_SETLEASE``) is given up on leaving, or ``/proc/sys/fs/lease-break-time``
    passes. Yields a check that an open is waiting (the lease's line in ``/proc/locks`` says BREAKING)."""
    told = signal.signal(signal.SIGIO, signal.SIG_IGN)  # the kernel tells the holder so, and SIGIO would end it
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as e:
            pytest.skip(f"this filesystem takes no file leases ({e.strerror}): no stalled open to be had")
        held = os.fstat(fd)
        lease = f"{os.major(held.st_dev):02x}:{os.minor(held.st_dev):02x}:{held.st_ino} "

        def waiting() -> bool:
            locks = Path("/proc/locks").read_text().splitlines()
            return any(" LEASE " in line and "BREAKING" in line and lease in line for line in locks)

        yield waiting
    finally:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        os.close(fd)
        signal.signal(signal.SIGIO, told)
