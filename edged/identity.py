"""Who produced a result: the board, its boot, and whether its clock can be trusted.

A journal row or a message read weeks later, on another machine, must say which board and which
run of it made it. The board id is derived from ``/etc/machine-id`` (which systemd says must not
leave the machine as it is), the boot id is the kernel's, and ``clock_synced`` tells a Raspberry Pi
without a clock battery that has not yet reached NTP from one that has.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MACHINE_ID = Path("/etc/machine-id")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_TIME_ERROR = 5  # adjtimex(2): the clock is not synchronised
CLOCK_EVERY_S = 1.0  # the clock's state is read again after this long: it changes once, when NTP syncs
_TIMEX_BYTES = 512  # more than struct timex on every Linux ABI; all zero: modes = 0 reads only
# 2026-01-01 UTC: no edged ran before it, so a wall clock or a time stamped earlier is certainly wrong (a
# board whose clock is not yet set reads 1970, or the day its system was built). Fixed, never moved on
# with a release: a row or an image an older edged stamped on a right clock keeps its age.
CLOCK_EPOCH_NS = 1_767_225_600 * 10**9


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def board_id(machine_id: Path = MACHINE_ID) -> str:
    """16 hex digits naming this board, stable across boots; "unknown" without a machine id."""
    value = _read(machine_id)
    if value is None:
        return "unknown"
    return hashlib.sha256(b"edged board id\0" + value.encode()).hexdigest()[:16]


def boot_id(path: Path = BOOT_ID) -> str:
    """The kernel's id of this boot; "unknown" where it has none."""
    return _read(path) or "unknown"


@functools.cache
def _adjtimex() -> Callable[[ctypes.Array[ctypes.c_char]], int] | None:
    """The C library's adjtimex, from the symbols the process has loaded already (Python's own C
    library): finding the library by name runs ldconfig, a process and descriptors, which a daemon
    out of descriptors at its first status round did not have, and it stopped on the error."""
    try:
        call: Callable[[ctypes.Array[ctypes.c_char]], int] = ctypes.CDLL(None).adjtimex
    except (OSError, AttributeError):  # a C library without adjtimex
        return None
    return call


def _ask_kernel() -> bool | None:
    adjtimex = _adjtimex()
    if adjtimex is None:
        return None
    state = int(adjtimex(ctypes.create_string_buffer(_TIMEX_BYTES)))
    return None if state < 0 else state != _TIME_ERROR


class _Clock:
    """The kernel's answer and when it was given, kept as one tuple: the loop and the journal's thread both ask."""

    def __init__(self) -> None:
        self.asked: tuple[float, bool | None] = (-CLOCK_EVERY_S, None)

    def synced(self) -> bool | None:
        at, synced = self.asked
        now = time.monotonic()
        if now - at >= CLOCK_EVERY_S:
            synced = _ask_kernel()
            self.asked = (now, synced)
        return synced


_CLOCK = _Clock()


def clock_synced() -> bool | None:
    """Whether the kernel says NTP (or chrony, or systemd-timesyncd) has set the clock; None when it
    cannot say. Every verdict message carries it, so the kernel is asked at most once a `CLOCK_EVERY_S`."""
    return _CLOCK.synced()


@dataclass(frozen=True, slots=True)
class Identity:
    """What every journal row (and message) says of where it came from. ``run_id`` is this start of
    edged: ``seq`` starts again at 0 each start, so a verdict is told apart from one of an earlier
    start in the same boot (a restart, an upgrade) by it, not by ``boot_id``."""

    board_id: str
    boot_id: str
    version: str
    run_id: str = field(default_factory=lambda: secrets.token_hex(8))

    @classmethod
    @functools.cache
    def here(cls) -> Identity:
        """This board and boot, read once per process."""
        from edged import __version__

        return cls(board_id(), boot_id(), __version__)

    def fields(self) -> dict[str, object]:
        """The identity fields of a verdict or status message, the clock's state read now."""
        return {"board_id": self.board_id, "boot_id": self.boot_id, "run_id": self.run_id, "clock_synced": clock_synced()}
