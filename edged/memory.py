"""edged's memory against its cgroup's limit: a warning before the kernel's OOM killer, not after.

Under systemd (``MemoryMax=`` in the unit) or in a container, the kernel ends a process of a cgroup
that reaches its memory limit (or whose slice or container does), and systemd restarts edged; nothing
said so beforehand. Each status round reads the tightest limit and the use under it
(`MemoryWatch.read`): use crossing `WARN_AT` of the limit is one warning that says what to do, use
back under `CLEAR_AT` one line more. The cgroups' files are found once (`locate`); without a limit,
a cgroup or a file that answers, a round costs a small read a cgroup (its limit's) or nothing, and
says nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from edged.messages import MemoryReadings

log = logging.getLogger(__name__)

PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_MOUNT = Path("/sys/fs/cgroup")
WARN_AT = 0.90  # of the limit: one warning
CLEAR_AT = 0.80  # of the limit: back under it, one line more; between the two, nothing
UNLIMITED_V1 = 2**62  # cgroup v1 says "no limit" with the largest page count it has, in bytes (2**63 less a page)
MIB = 2**20


@dataclass(frozen=True, slots=True)
class CgroupFiles:
    """Where one cgroup's memory figures are read: cgroup v2's files, or v1's memory controller's."""

    limit: Path  # memory.max ("max": none) or memory.limit_in_bytes (`UNLIMITED_V1` and above: none)
    usage: Path  # memory.current or memory.usage_in_bytes: page cache included
    stat: Path | None  # memory.stat, where the inactive page cache is read
    inactive_key: str  # its line for the inactive page cache: v1's counts the cgroups below too
    events: Path | None  # memory.events or memory.oom_control, where the kernel counts its OOM kills


def locate(proc_cgroup: Path = PROC_SELF_CGROUP, mount: Path = CGROUP_MOUNT) -> tuple[CgroupFiles, ...]:
    """The memory files of this process's cgroup and of each above it (a slice, a container's root),
    innermost first, as ``proc_cgroup`` names the cgroup and under ``mount``; none where there are
    none to read. The kernel ends a process where any of them reaches its limit.

    cgroup v2 first (the ``0::/path`` line, its files at ``mount/path``), then v1's memory controller
    (``N:memory:/path``, at ``mount/memory/path``): a hybrid host lists both, and only v1 holds the
    memory files there. A path that is not there, as in a container that sees its own cgroup at the
    mount's root, is looked for at that root.
    """
    try:
        lines = proc_cgroup.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return ()
    v2 = v1 = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    if v2 is not None:
        found = tuple(
            CgroupFiles(
                folder / "memory.max",
                folder / "memory.current",
                _present(folder / "memory.stat"),
                "inactive_file",
                _present(folder / "memory.events"),
            )
            for folder in _folders(mount, v2)
            if (folder / "memory.max").is_file() and (folder / "memory.current").is_file()
        )
        if found:
            return found
    if v1 is not None:
        return tuple(
            CgroupFiles(
                folder / "memory.limit_in_bytes",
                folder / "memory.usage_in_bytes",
                _present(folder / "memory.stat"),
                "total_inactive_file",
                _present(folder / "memory.oom_control"),
            )
            for folder in _folders(mount / "memory", v1)
            if (folder / "memory.limit_in_bytes").is_file() and (folder / "memory.usage_in_bytes").is_file()
        )
    return ()


def _folders(root: Path, path: str) -> list[Path]:
    """The cgroup's folder under ``root`` and each above it, ``root`` last; a path outside this
    namespace's root (``/..``, which a cgroup namespace shows) only ``root``."""
    parts = PurePosixPath(path).parts[1:]
    if ".." in parts:
        return [root]
    return [root.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def _present(path: Path) -> Path | None:
    return path if path.is_file() else None


def _bytes(path: Path) -> int | None:
    """A file holding a byte count, or "max" (none); ValueError for anything else."""
    text = path.read_text(encoding="ascii").strip()
    return None if text == "max" else _count_of(text)


def _count_of(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"a count below zero: {text}")
    return value


def _count(path: Path | None, key: str) -> int | None:
    """``key``'s value in a file of ``key value`` lines (memory.stat, memory.events); None without the
    file, the line or a number on it."""
    if path is None:
        return None
    try:
        lines = path.read_text(encoding="ascii").splitlines()
        return next(_count_of(value) for name, _, value in (line.partition(" ") for line in lines) if name == key)
    except (OSError, ValueError, StopIteration):
        return None


def near_limit(used: int, limit: int) -> bool:
    """Whether use ``used`` is near ``limit``: what edged warns of (`MemoryWatch`) and STATUS= says."""
    return used >= WARN_AT * limit


class MemoryWatch:
    """The memory limit and use of edged's cgroup, or of the one above it whose limit is the tightest (a
    slice, a container), read once a status round, and what nearing the limit calls for said once a
    crossing. One owner thread (the loop's)."""

    def __init__(self, files: Sequence[CgroupFiles]) -> None:
        self._files = list(files)  # innermost first (`locate`)
        self._high = False  # the last warning went out and use has not been back under `CLEAR_AT` since
        self._oom_kills: dict[Path, int] = {}  # the kernel's count of OOM kills in each cgroup when last read

    @classmethod
    @functools.cache
    def own(cls) -> MemoryWatch:
        """This process's cgroup's, found once per process."""
        return cls(locate())

    def read(self) -> MemoryReadings | None:
        """The tightest limit and the use under it now, having said what a crossing calls for; None
        without a limit.

        Use is judged as the cgroup's use less its inactive page cache (``inactive_file``), not as
        ``memory.current``, which counts the page cache too: the evidence images and journal pages
        edged writes and the model file it read stay cached and count there, but the kernel drops
        them before it ends a process at the limit, so a daemon that writes evidence would read as
        near its limit while in no danger. What is left is what the kernel would reclaim last (the
        working set, as the kubelet judges a container by).

        The limits are read again each round, so that one set on a running edged (``systemctl
        set-property edged MemoryMax=2G``) counts from the next. A file that fails to read is never
        read again, and nothing is said of it: one that stops answering would otherwise cost a failed
        open and a log line every round for good.
        """
        limits = []
        for files in list(self._files):
            try:
                limit = _bytes(files.limit)
            except (OSError, ValueError):
                self._files.remove(files)
                continue
            if limit is not None and 0 < limit < UNLIMITED_V1:
                limits.append((limit, files))
        if not limits:
            return None
        limit, files = min(limits, key=lambda found: found[0])  # the innermost of the tightest
        try:
            usage = _count_of(files.usage.read_text(encoding="ascii").strip())
        except (OSError, ValueError):
            self._files.remove(files)
            return None
        inactive, kills = _count(files.stat, files.inactive_key), _count(files.events, "oom_kill")
        if (files.stat and inactive is None) or (files.events and kills is None):
            kept = dataclasses.replace(
                files, stat=files.stat if inactive is not None else None, events=files.events if kills is not None else None
            )
            self._files[self._files.index(files)] = kept
        used = max(0, usage - (inactive or 0))
        self._judge(files, used, limit)
        if kills is not None:
            self._killed(files, kills)
        return MemoryReadings(limit_bytes=limit, used_bytes=used, cgroup_bytes=usage, oom_kills=kills)

    def _killed(self, files: CgroupFiles, kills: int) -> None:
        """A rise in the kernel's count of OOM kills in the cgroup is said: a reject line's process, say,
        that the kernel ended while edged went on, or edged itself where the cgroup outlived it."""
        before = self._oom_kills.get(files.limit, 0)
        if kills > before:
            log.warning(
                "the kernel's OOM killer ended %d process(es) of edged's cgroup (%d since the cgroup was made): "
                "it reached its memory limit (%s)",
                kills - before,
                kills,
                files.limit,
            )
        self._oom_kills[files.limit] = kills

    def _judge(self, files: CgroupFiles, used: int, limit: int) -> None:
        if not self._high and near_limit(used, limit):
            self._high = True
            log.warning(
                "memory use %d MiB is %.0f %% of the %d MiB limit %s sets (MemoryMax= of edged's systemd unit "
                "or of a slice above it, or the container's limit), page cache not counted; at the limit the kernel's "
                "OOM killer ends edged. Use a smaller model, fewer cameras or less evidence ([evidence] save, "
                "max_per_minute), or raise MemoryMax= (systemctl edit edged)",
                used // MIB,
                100 * used / limit,
                limit // MIB,
                files.limit,
            )
        elif self._high and used < CLEAR_AT * limit:
            self._high = False
            log.info("memory use back to %d MiB, %.0f %% of the %d MiB limit", used // MIB, 100 * used / limit, limit // MIB)
