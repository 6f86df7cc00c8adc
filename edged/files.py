"""Reading a small file that anyone may have put in its place, and writing a command's output whole.

A file is read opened without waiting, so a pipe where the file was expected (a link to one) holds
nothing up; only when it is a regular file, so a device such as ``/dev/zero`` is not read without
end; and never more than the caller's bound, checked on the size before reading and on what was
read (a file may grow while it is read).

A command's output (a model, a report, a signature) is written beside its place and renamed into
it, so a full disk or a kill leaves the old file or none, never half of one; and never over one of
the command's own inputs. A file a later start trusts (a model cache's record) is also on the disk
before it is renamed into place (`write_durably`), so a power cut cannot leave it cut short. A
SQLite file opened by URI has its path quoted there (`sqlite_uri`). The folders a try makes (``edged
check``, a reload) are removed after it while they are still as it made them (`MadeFolders`).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import glob
import itertools
import os
import secrets
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

from edged.errors import ModelError, OutputFileError, UsageError, printable

MAX_LABELS_BYTES = 1 << 20  # a labels file: 1 MiB is some 50,000 class names


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


def labels_bytes(path: Path) -> bytes:
    """A labels file's bytes; `ModelError` for a file that is none (a pipe, a device, megabytes)."""
    try:
        return read_regular(path, MAX_LABELS_BYTES)
    except OSError as e:
        raise ModelError(f"cannot read labels file {path}: {e.strerror or e}") from None
    except ValueError as e:  # `read_regular`'s refusals name the file
        raise ModelError(f"cannot read the labels: {e}") from None


def sqlite_uri(path: Path, query: str) -> str:
    """A SQLite URI of ``path`` with ``query`` (``mode=rw``, ``immutable=1``): the path quoted, as a
    ``?`` or ``#`` in a folder's name would otherwise end it and open another file."""
    return f"file:{quote(str(path))}?{query}"


def write_whole(path: Path, data: bytes | str) -> None:
    """``data`` in the file at ``path``, whole or not at all: `OutputFileError` naming why not."""
    write_with(path, lambda tmp: tmp.write_bytes(data.encode() if isinstance(data, str) else data))


def write_with(path: Path, write: Callable[[Path], object]) -> None:
    """The file ``write`` makes at the path it is given, moved to ``path`` once whole (`write_whole`);
    never over a device or a pipe, which the move would replace."""
    if path.exists() and not path.is_file():
        raise OutputFileError(f"cannot write {path}: not a regular file")
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.part{path.suffix}")  # the suffix kept: onnx.save reads it
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError):
            raise OutputFileError(f"cannot write {path}: {e.strerror or e}") from None
        raise


def nearest_folder(path: Path) -> Path:
    """``path`` where it is a folder, else the nearest folder above it: where a folder still to be
    made would be made, and what decides whether it can be."""
    return next(at for at in (path, *path.parents) if at.is_dir())


def lock_holders(path: Path) -> list[int]:
    """The processes holding a lock on file ``path`` (``flock``, ``fcntl``), as the kernel lists them in
    /proc/locks; none where the file is not there or the list cannot be read."""
    try:
        found = os.stat(path)
        listed = Path("/proc/locks").read_text(encoding="ascii", errors="replace")
    except OSError:
        return []
    inode = f"{os.major(found.st_dev):02x}:{os.minor(found.st_dev):02x}:{found.st_ino}"
    holders = []
    for line in listed.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:2147258 0 EOF"; a process waiting for it has "->" after the number
        fields = line.split()
        if len(fields) >= 6 and fields[1] != "->" and fields[5] == inode and fields[4].isdigit():
            holders.append(int(fields[4]))
    return holders


def process_argv(pid: int) -> list[str] | None:
    """Process ``pid``'s arguments, as /proc has them; None where they cannot be read (gone, not ours to see)."""
    try:
        return [os.fsdecode(arg) for arg in Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")]
    except OSError:
        return None


def command_line(pid: int, limit: int = 200) -> str | None:
    """Process ``pid``'s command line as one line (its arguments joined by spaces, control characters
    escaped, cut at ``limit`` characters), to name it in a message; None where it cannot be read."""
    if (argv := process_argv(pid)) is None:
        return None
    line = printable(" ".join(argv))
    return line if len(line) <= limit else f"{line[: limit - 3]}..."


def fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable: a power cut after it would otherwise undo it."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def part_file(path: Path, mode: int = 0o666) -> tuple[int, Path]:
    """A new empty file beside ``path`` to write it in before it is renamed there: one of its own per
    writer (two processes writing one file at once leave one whole), made with ``mode`` (less the
    umask), ``path``'s suffix kept (a writer may pick the format by it). Its descriptor and path."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}-{secrets.token_hex(4)}.part{path.suffix}")
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode), tmp


def parts_of(path: Path) -> list[Path]:
    """The files `part_file` made for ``path`` that are still there: a kill or a power cut left them."""
    return sorted(path.parent.glob(f".{glob.escape(path.stem)}.*.part{glob.escape(path.suffix)}"))


def remove_parts(path: Path) -> None:
    """Remove the files `part_file` made for ``path`` and a kill or a power cut left behind."""
    for part in parts_of(path):
        with contextlib.suppress(OSError):
            part.unlink()


def write_durably(path: Path, data: bytes) -> None:
    """``data`` at ``path`` whole or not at all, on the disk before it is renamed there (then the
    rename too); OSError where it cannot be."""
    fd, tmp = part_file(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_folder(path.parent)


class MadeFolders:
    """The folders a try made (``edged check``, a reload until it takes over), to remove after it: each
    only while it is still the one made here, empty and owned as it was made. Another process may take
    one meanwhile: the service starting beside ``sudo edged check`` makes it its own (systemd gives it
    a runtime or state directory's user) or saves in it; removing it then broke that service."""

    def __init__(self, *, until_exit: bool = False) -> None:
        """``until_exit``: removed at the process's exit too, unless kept or removed before: a reload
        still loading when edged stops is never tried, and its folders are nobody's."""
        self._made: list[tuple[Path, tuple[int, int, int]]] = []
        if until_exit:
            atexit.register(self.remove)

    def __enter__(self) -> MadeFolders:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.remove()

    def mkdir(self, folder: Path, mode: int = 0o777) -> None:
        """Make ``folder`` (its parent must be there), raising as `os.mkdir` does."""
        os.mkdir(folder, mode)
        self._record(folder)

    def parents(self, folder: Path, mode: int = 0o777) -> None:
        """Make ``folder`` and the folders above it that are missing, as ``mkdir(parents=True)`` does (the
        others with the default mode): `FileExistsError` where ``folder`` is there already."""
        missing = list(itertools.takewhile(lambda at: not os.path.lexists(at), (folder, *folder.parents)))
        for at in reversed(missing):
            try:
                self.mkdir(at, mode if at == folder else 0o777)
            except FileExistsError:  # made meanwhile, by someone else
                if at == folder:
                    raise
        if not missing:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(folder))

    def _record(self, folder: Path) -> None:
        with contextlib.suppress(OSError):  # already gone: nothing to remove
            status = os.lstat(folder)
            self._made.append((folder, (status.st_dev, status.st_ino, status.st_uid)))

    def remove(self) -> None:
        """Remove the folders made, innermost first, leaving each that another process has since made its
        own (given to another user, or removed and made again) or written in; once."""
        for folder, made in reversed(self._made):
            with contextlib.suppress(OSError):  # gone, or holding what was put there since
                status = os.lstat(folder)
                if (status.st_dev, status.st_ino, status.st_uid) == made:
                    os.rmdir(folder)
        self.keep()  # nothing left of them to remove, at exit either

    def keep(self) -> None:
        """Leave the folders made as they are, at exit too: what made them (a reload) took over."""
        self._made.clear()
        atexit.unregister(self.remove)


def _identity(path: Path) -> tuple[int, int] | Path:
    """What makes two paths one file: its device and inode where it exists (a hard link is the same
    file), else the path with its links resolved."""
    try:
        status = path.stat()
    except OSError:
        return path.resolve()
    return status.st_dev, status.st_ino


def refuse_overwriting(outputs: Mapping[str, Path | None], inputs: Mapping[str, Path | None]) -> None:
    """`UsageError` for an output that is one of the command's ``inputs`` or another output: writing
    it would destroy what the command reads (a signing key, the model) or what it wrote first."""
    taken: dict[tuple[int, int] | Path, str] = {}
    for name, path in inputs.items():
        if path is not None and path.exists():
            taken.setdefault(_identity(path), name)
    for name, path in outputs.items():
        if path is None:
            continue
        key = _identity(path)
        if key in taken:
            raise UsageError(f"{name} {path} is the file of {taken[key]}: writing it would destroy it; name another file")
        taken[key] = name
