"""Reading the board's files off the daemon's loop, so that a sensor that hangs holds nothing up.

A thermal zone's temperature is read through its driver, and a sensor on a stuck I2C bus blocks
that read in the kernel for seconds or for good: nothing can interrupt it. So each poll's reading
runs on a thread of its own (`Background`), which the poll waits for briefly, going on with the
readings it has otherwise. A file whose read has not returned after `SLOW_READ_S` is left to the
thread blocked on it, and from then on it is read on a thread of its own (`SlowFiles`): the
readings take the newest value it gave until the read after it has hung for `HUNG_AFTER_S`, and
without one the file reads as missing (its zone offline), said once until it answers again. At most
`MAX_BLOCKED_READS` reads are left blocked at once; past that the next read waits for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

log = logging.getLogger(__name__)

SLOW_READ_S = 1.0
HUNG_AFTER_S = 15.0
MAX_BLOCKED_READS = 8

T = TypeVar("T")


class Abandoned(Exception):
    """A read returned to a reading that was given up on: it ends there, its file handed on."""


@dataclass(eq=False)
class _Run:
    """One reading on its thread: the file it is reading now, and since when."""

    done: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)
    took_s: float = 0.0
    path: Path | None = None
    since: float = 0.0
    abandoned: bool = False
    result: object = None


@dataclass(eq=False)
class _Slow:
    """A file read on its own: its newest contents, when they were read, and the read in flight."""

    path: Path
    reading_since: float | None
    text: str | None = None
    read_at: float | None = None
    said: bool = False


class SlowFiles:
    """The files of one tree that were too slow to read in line, shared by every reader of that tree."""

    _trees: ClassVar[dict[Path, SlowFiles]] = {}
    _trees_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._files: dict[Path, _Slow] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    @classmethod
    def of(cls, root: Path) -> SlowFiles:
        """The one for ``root``: a reload's new watch knows which files hang and blocks on none of them again."""
        with cls._trees_lock:
            return cls._trees.setdefault(root, cls())

    def bind(self, run: _Run) -> None:
        """This thread's reads are ``run``'s, which `give_up` may hand on."""
        self._local.run = run

    def text(self, path: Path, read: Callable[[Path], str | None]) -> str | None:
        """``read(path)``, or for a slow file its newest value (`SlowFiles`); raises `Abandoned` to a
        reading given up on while it was blocked here."""
        slow = self._files.get(path)
        if slow is not None:
            return self._value(slow, read)
        run: _Run | None = getattr(self._local, "run", None)
        if run is None:
            return read(path)
        run.path, run.since = path, time.monotonic()
        try:
            text = read(path)
        finally:
            with self._lock:
                run.path = None
        if path in self._files:
            self._delivered(path, text)
        if run.abandoned:
            raise Abandoned
        return text

    def give_up(self, run: _Run) -> bool:
        """Hand the file ``run`` has been blocked on for `SLOW_READ_S` to a thread of its own."""
        now = time.monotonic()
        with self._lock:
            path = run.path
            blocked = sum(s.reading_since is not None for s in self._files.values())
            if path is None or run.abandoned or now - run.since < SLOW_READ_S or blocked >= MAX_BLOCKED_READS:
                return False
            self._files[path] = _Slow(path, reading_since=run.since, said=True)
            run.abandoned = True
        log.warning(
            "reading %s has not returned after %.1f s: it is read on its own from now on, its newest value "
            "taken while recent, and the other thermal readings go on without waiting for it",
            path,
            now - run.since,
        )
        return True

    def _value(self, slow: _Slow, read: Callable[[Path], str | None]) -> str | None:
        now = time.monotonic()
        with self._lock:
            if slow.reading_since is None:
                blocked = sum(s.reading_since is not None for s in self._files.values())
                if blocked < MAX_BLOCKED_READS:
                    slow.reading_since = now
                    try:
                        threading.Thread(
                            target=self._refresh, args=(slow, read), name="edged-thermal-read", daemon=True
                        ).start()
                    except RuntimeError:  # no thread to be had now: its value ages, the next poll tries again
                        slow.reading_since = None
            # How long the value has waited for the read after it: since that read began, or, with none
            # (too many reads blocked to start one), since the value was read.
            waited_from = slow.reading_since if slow.reading_since is not None else slow.read_at
            hung_s = now - waited_from if waited_from is not None else 0.0
            fresh = slow.read_at is not None and hung_s <= HUNG_AFTER_S
            say = not fresh and not slow.said
            slow.said = slow.said or say
        if say:
            log.warning("%s has not answered for %.0f s: left out of the thermal readings until it does", slow.path, hung_s)
        return slow.text if fresh else None

    def _refresh(self, slow: _Slow, read: Callable[[Path], str | None]) -> None:
        text = None
        try:
            text = read(slow.path)
        finally:  # whatever happened, the next poll may try again
            self._delivered(slow.path, text)

    def _delivered(self, path: Path, text: str | None) -> None:
        with self._lock:
            slow = self._files.get(path)
            if slow is None:
                return
            slow.text, slow.read_at, slow.reading_since = text, time.monotonic(), None
            said, slow.said = slow.said, False
        if said:
            log.warning("%s answers again", path)


class Background(Generic[T]):
    """Runs ``work`` (a reading through ``files``) on a thread of its own, one at a time."""

    def __init__(self, files: SlowFiles, work: Callable[[], T]) -> None:
        self._files = files
        self._work = work
        self._run: _Run | None = None
        self._quick = True
        self._failing = False
        self._no_thread = False  # the last reading could not start a thread

    def take(self, wait_s: float) -> T | None:
        """The result of a reading: one in flight if it has finished, else one started now, waited for up
        to ``wait_s``; None while none has finished. Readings that take longer are not waited for: each
        taken starts the next, for the next call."""
        deadline = time.monotonic() + (wait_s if self._quick else 0.0)
        while True:
            run = self._run
            if run is not None and run.done.is_set():
                self._quick = run.took_s <= wait_s
                self._run = None if self._quick else self._start()  # too slow to wait for: the next is read meanwhile
                return run.result  # type: ignore[return-value]
            if run is None or self._files.give_up(run):
                run = self._run = self._start()
                if run is None:
                    return None
            left = deadline - time.monotonic()
            if left <= 0:
                self._quick = False
                return None
            run.done.wait(min(left, SLOW_READ_S))

    def _start(self) -> _Run | None:
        """A reading started on a thread of its own; None where no thread can be had (``TasksMax=``
        reached), said once until one can: the state then holds, and goes unknown as readings stop."""
        run = _Run()
        try:
            threading.Thread(target=self._reading, args=(run,), name="edged-thermal", daemon=True).start()
        except RuntimeError as e:
            if not self._no_thread:
                log.warning("no thread to read the board's thermal files on (%s): trying again at each poll", e)
            self._no_thread = True
            return None
        self._no_thread = False
        return run

    def _reading(self, run: _Run) -> None:
        self._files.bind(run)
        try:
            run.result = self._work()
            self._failing = False
        except Abandoned:
            pass
        except Exception:  # a reading never stops the daemon: it is logged (once in a row), and the next one tried
            if not self._failing:
                log.exception("thermal reading failed")
            self._failing = True
        finally:
            run.took_s = time.monotonic() - run.started
            run.done.set()
