"""Reading a small file that anyone may have put in its place: an image in a folder, a dataset's record.

Opened without waiting, so a pipe where the file was expected (a link to one) holds nothing up;
read only when it is a regular file, so a device such as ``/dev/zero`` is not read without end;
and never more than the caller's bound, checked on the size before reading and on what was read
(a file may grow while it is read).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class NotRegularFile(ValueError):
    """A pipe, a device or a folder where a file was expected."""


class FileTooLarge(ValueError):
    """A file larger than its reader's bound; ``size`` is what it holds, at least."""

    def __init__(self, path: str | Path, size: int, limit: int) -> None:
        self.size = size
        super().__init__(f"{path} holds {size} bytes, more than {limit}")


def read_regular(path: str | Path, limit: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them; `NotRegularFile` or
    `FileTooLarge` where it is not one or holds more, OSError where it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        status = os.fstat(fd)  # before Python's own file object, which refuses a folder with its own error
        if not stat.S_ISREG(status.st_mode):
            raise NotRegularFile(f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    with open(fd, "rb") as file:
        data = file.read(limit + 1) if status.st_size <= limit else b""
    size = max(status.st_size, len(data))
    if size > limit:
        raise FileTooLarge(path, size, limit)
    return data
