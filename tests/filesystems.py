"""Filesystems that fail for real in tests: a small tmpfs that fills up, a read-only mount, a folder's mode."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


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
