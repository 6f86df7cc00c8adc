"""The verdict journal: every verdict (and with ``detections = true`` every detections message sent)
in one local SQLite file, so that "what did the camera say about part A-1017, with which model?"
has an answer weeks later, across crashes, power cuts and outages.

SQLite's WAL mode lets a reader (``edged history``, another process) read while edged writes, and a
crash of edged never loses a committed row; ``durability = "full"`` adds an fsync per batch, so a
power cut loses nothing committed either. Rows are written on the journal's own thread, a batch
per transaction; the loop only appends to a queue bounded in bytes and never waits on the disk. A
disk that is full or read-only is counted and retried, never a reason to stop inspecting; a file
that is not a journal (truncated, replaced, damaged) is moved aside and a new one started. A file
removed or replaced while edged writes it is noticed within a second, busy or idle, and
journal.path opened anew, with what the old file held that no path showed or the broker had not had
(`JournalStore.follow`), those verdicts sent as replayed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import sqlite3
import stat
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from edged.files import command_line, lock_holders
from edged.identity import CLOCK_EPOCH_NS, Identity, clock_synced
from edged.lograte import Failures, LogRate
from edged.messages import JournalReport
from edged.output import NO_REPORT, Delivery, FrameReport, Output, OutputReport, Services
from edged.replay import CURSORS, LAST_ROW, FileId, VerdictFeed, Writes, acknowledged, file_id
from edged.settings.journal import JournalConfig
from edged.wake import Wake, Waker

if TYPE_CHECKING:
    from edged.config import Settings

log = logging.getLogger(__name__)

QUEUE_BYTES = 16 * 1024 * 1024  # rows waiting for the disk, at most: beyond, new rows are dropped and counted
BATCH_ROWS = 500  # rows per transaction, at most
RETRY_S = (1.0, 30.0)  # after a failed write, the first wait and the longest (doubling between)
PRUNE_EVERY_S = 60.0  # retention pass period
STOP_WAIT_S = 2.0  # at stop, time left to write what is queued
LOG_EVERY_S = 60.0
BUSY_WAIT_S = 5.0  # how long a write waits for another connection's (a feed writing its cursor)
LOOK_EVERY_S = 1.0  # how often a write looks whether journal.path still names the file written
IDLE_LOOK_S = 1.0  # how often the writer looks all the same while no entry comes (a line stopped)
GONE, REPLACED = "moved away or removed", "replaced"  # what became of a file journal.path no longer names

# The entries table: its columns after ``id``, in the order rows are written and read. A column added
# in a later version may be NULL: the table of an earlier edged's journal gains it as it opens
# (`JournalStore.open`), its rows, with the verdicts an output has not yet had, kept.
TABLE = (
    ("kind", "TEXT NOT NULL"),
    ("camera_id", "TEXT NOT NULL"),
    ("frame_id", "INTEGER NOT NULL"),
    ("seq", "INTEGER NOT NULL"),
    ("part_id", "TEXT"),
    ("verdict", "TEXT"),
    ("reasons", "TEXT"),
    ("wall_ns", "INTEGER NOT NULL"),
    ("mono_ns", "INTEGER NOT NULL"),
    ("clock_synced", "INTEGER"),
    ("model_sha256", "TEXT NOT NULL"),
    ("config_sha256", "TEXT NOT NULL"),
    ("edged_version", "TEXT NOT NULL"),
    ("board_id", "TEXT NOT NULL"),
    ("boot_id", "TEXT NOT NULL"),
    ("evidence", "TEXT"),
    ("message", "TEXT NOT NULL"),
)
COLUMNS = tuple(name for name, _ in TABLE)
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS entries (id INTEGER PRIMARY KEY AUTOINCREMENT, "
    + ", ".join(f"{name} {kind}" for name, kind in TABLE)
    + ");\n"
    "CREATE INDEX IF NOT EXISTS entries_part ON entries (part_id);\n"
    "CREATE INDEX IF NOT EXISTS entries_camera_time ON entries (camera_id, wall_ns);\n"
)
_INSERT = f"INSERT INTO entries ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
Row = tuple[object, ...]  # an entries row's `COLUMNS`, as written


@dataclass(frozen=True, slots=True)
class Entry:
    """One row as the loop hands it over: the message sent, and what its columns are read from."""

    kind: Literal["verdict", "detections", "promotion", "rollback"]
    camera_id: str  # empty for a board's entry (a promotion or rollback)
    frame_id: int
    seq: int
    part_id: str | None
    verdict: str | None
    reasons: str | None  # JSON, as in the message
    wall_ns: int
    mono_ns: int
    model_sha256: str
    config_sha256: str
    message: bytes
    evidence: str | None = None  # the evidence image saved of the frame, if any


@dataclass(frozen=True, slots=True)
class Reopened:
    """journal.path opened anew after it stopped naming the file written (`JournalStore.follow`)."""

    was: str  # what became of the file written: `GONE` or `REPLACED`
    now: str  # what journal.path holds now, as opened (`JournalStore.open`)
    carried: int  # the old file's rows written first to the new one
    lost: int  # verdicts not yet acknowledged left in the old file: more than memory holds (`QUEUE_BYTES`)


def lock_file(path: Path) -> Path:
    """Journal ``path``'s lock file: ``.lock`` beside the file a link at ``path`` names (`lock`)."""
    return Path(f"{os.path.realpath(path)}.lock")


def lock(path: Path, *, create: bool = True) -> int:
    """A file descriptor holding journal ``path``'s lock (``flock`` on ``.lock`` beside the file a link
    at ``path`` names, let go when it closes or edged ends, however it ends); an OSError when another
    process holds it. Two edged writing one journal would each replay the other's verdicts to its
    broker, under the same seq: two configurations whose links name one file took a lock each, beside
    their links. Without ``create``, a lock file not there is FileNotFoundError: nobody holds it."""
    held = lock_file(path)
    fd = os.open(held, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(errno.EWOULDBLOCK, f"in use by another edged (its lock {held} is held)") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def timed(op: str, wall_ns: int, boot_id: str | None, mono_now_ns: int, wall_now_ns: int) -> tuple[str, list[object]]:
    """A row's time ``op`` ``wall_ns`` as SQL, with its parameters: the rows of boot ``boot_id`` (the
    running one, whose monotonic and wall clocks read ``mono_now_ns`` and ``wall_now_ns`` together) on
    the monotonic clock, which no step of the wall clock moves, an earlier boot's on the wall time
    they carry. A board without a real-time clock whose clock NTP sets right by months stamped this
    boot's earlier rows with a date as wrong (retention, `edged history --since`)."""
    mono_ns = min(max(mono_now_ns - (wall_now_ns - wall_ns), 0), LAST_ROW)  # within SQLite's integers
    return f"CASE WHEN boot_id = ? THEN mono_ns {op} ? ELSE wall_ns {op} ? END", [boot_id, mono_ns, wall_ns]


def sure(boot_id: str | None, unsynced_after: int) -> tuple[str, list[object]]:
    """Which rows carry a time their age can be counted from, as SQL with its parameters: those of
    the running boot ``boot_id``, on the monotonic clock; an earlier boot's stamped on or after
    `CLOCK_EPOCH_NS` by a clock the kernel called synchronised (or could not tell of), and those
    after row ``unsynced_after`` stamped by one it called not: no clock was set right after them (a
    line without NTP), so their stamps and the clock now lag alike, and the age they give is never
    too long. Any other row's clock may have lagged by months: it is only known to be older than
    the sure rows recorded after it."""
    sql = "(boot_id = ? OR (wall_ns >= ? AND (clock_synced IS NOT 0 OR id > ?)))"
    return sql, [boot_id, CLOCK_EPOCH_NS, unsynced_after]


def _one(db: sqlite3.Connection, query: str, *params: object) -> int | None:
    """The row id ``query`` selects, None where it selects none."""
    row = db.execute(query, params).fetchone()
    return None if row is None else int(row[0])


def records(settings: Settings) -> bool:
    """Whether ``settings``' journal has anything to record: verdicts (a camera inspected) or detections."""
    return settings.journal.detections or bool(settings.inspected())


def config_sha256(settings: Settings) -> str:
    """SHA-256 of the settings in effect (the file and any ``EDGED_*`` variables), as JSON."""
    return hashlib.sha256(settings.model_dump_json().encode()).hexdigest()


class JournalStore:
    """The SQLite file; used by one thread at a time."""

    def __init__(self, path: Path, durability: Literal["normal", "full"]) -> None:
        self.path = path
        self._durability = durability
        self._db: sqlite3.Connection | None = None
        self._lock: int | None = None  # `lock`'s descriptor while the journal is open
        self.last_id = 0  # the newest row's id, as of the last open or append (read from other threads)
        self.unsent_deleted = 0  # verdicts deleted for room before an output had them acknowledged (`prune`)
        self.folded = True  # the last `prune` emptied the write-ahead log into the file (`_fold`)
        self._file: FileId | None = None  # the open file's device and inode (`replaced`)
        self._writes: Writes | None = None  # the open file, and the row after which its rows are this store's own
        self._real = ""  # where journal.path led as the file opened (a link's target): its -wal and -shm are beside it
        self._beside: dict[str, FileId] = {}  # the files SQLite keeps beside it, by suffix, as it opened
        self._seen = 0  # the newest row as of the last look that found journal.path naming the file (`follow`)
        self._next_look = 0.0
        self._gone: str | None = None  # how journal.path stopped naming the file let go, until it opens anew
        self._lost = 0  # verdicts not yet acknowledged the file let go held beyond `carried` (`Reopened.lost`)
        self._apart: str | None = None  # how the file at journal.path is left without its -wal or -shm (`follow`)
        # Rows of a file journal.path no longer names, to be written first to the next one opened (`follow`)
        self.carried: list[Row] = []
        self._cursors: list[str] = []  # the outputs with a cursor in that file: given one before `carried` (`_insert`)

    @property
    def opened(self) -> bool:
        return self._db is not None

    @property
    def apart(self) -> str | None:
        """How the file written, still at journal.path, is left without its -wal or -shm, as last looked at
        (`follow`); None while it is not."""
        return self._apart

    @property
    def writes(self) -> Writes | None:
        """The open file, and the row up to which its rows were there before this store wrote to it (the
        journal found) or carried from a file journal.path no longer named: recorded before, to go out
        as replayed (read from other threads: `edged.replay.VerdictFeed`). Until the carried rows are
        written, every row is: none of this store's own goes in before them (`_connection`)."""
        return self._writes

    @property
    def next_look(self) -> float:
        """When journal.path is next looked at (`follow`), on the monotonic clock."""
        return self._next_look

    def open(self) -> str:
        """Open the journal, creating it; a file that is not a sound journal (damaged, or another
        version's table, which every write would fail on) is moved aside first, kept whole; an
        earlier edged's table gains the columns added since; an OSError while another edged holds
        it (`lock`). Returns what journal.path held, for `follow` to say."""
        if self._lock is None:
            self._lock = lock(self.path)
        try:
            found: int | None = os.stat(self.path).st_mode
        except FileNotFoundError:
            found = None
        if found is not None and not stat.S_ISREG(found):  # put there since edged started, which refuses it
            why = f"journal.path {self.path} is no longer a regular file (a folder, a FIFO, a device): edged writes it again"
            raise OSError(errno.EINVAL, f"{why} once it is removed or a journal")
        try:
            self._db = self._connect()
            held = f"the journal found there (its newest entry {self.last_id})" if found is not None else "a new journal"
        except sqlite3.OperationalError:
            raise  # unreadable folder, read-only, locked: not the file's fault
        except sqlite3.DatabaseError as e:  # not a database, truncated, damaged
            aside = self._move_aside(e)
            self._db = self._connect()
            held = f"a new journal (the file found there was not one: moved aside to {aside})"
        self._file = file_id(self.path)
        self._real = os.path.realpath(self.path)  # none beside where the filesystem takes no WAL (SQLite's own journal)
        self._beside = {
            suffix: beside for suffix in ("-wal", "-shm") if (beside := file_id(Path(f"{self._real}{suffix}"))) is not None
        }
        self._seen, self._apart = self.last_id, None
        self._writes = None if self._file is None else (self._file, LAST_ROW if self.carried else self.last_id)
        return held

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=BUSY_WAIT_S, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA auto_vacuum = INCREMENTAL")  # takes effect on a new file: retention gives space back
            db.execute("PRAGMA journal_mode = WAL")
            db.execute(f"PRAGMA synchronous = {'FULL' if self._durability == 'full' else 'NORMAL'}")
            verdict = db.execute("PRAGMA quick_check").fetchone()[0]
            if verdict != "ok":
                raise sqlite3.DatabaseError(f"integrity check: {verdict}")
            have = {str(row[1]) for row in db.execute("PRAGMA table_info(entries)")}  # none: a new file
            missing = [(name, kind) for name, kind in TABLE if have and name not in have]
            if any("NOT NULL" in kind for _, kind in missing):  # another version's table: no row could have them
                raise sqlite3.DatabaseError(f"its entries table has no {', '.join(name for name, _ in missing)}")
            for name, kind in missing:  # an earlier edged's table: its rows have none of what was added since
                db.execute(f"ALTER TABLE entries ADD COLUMN {name} {kind}")
                log.info("journal %s: added the column %s, which the rows recorded before leave empty", self.path, name)
            db.executescript(SCHEMA)
            self.last_id = int(db.execute("SELECT coalesce(max(id), 0) FROM entries").fetchone()[0])
        except BaseException:
            db.close()
            raise
        return db

    def _move_aside(self, why: sqlite3.DatabaseError) -> Path:
        """The damaged file (with its WAL and shared memory) goes aside, said once; the next open starts anew."""
        aside = self._aside_name()
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                Path(f"{self.path}{suffix}").replace(f"{aside}{suffix}")
        log.warning("journal %s is damaged (%s): moved aside to %s; a new journal starts", self.path, why, aside)
        return aside

    def _aside_name(self) -> Path:
        """``journal.sqlite.damaged-TIME``, numbered where a journal moved aside before has the name: a
        board without a real-time clock boots to the same time again, and would replace that one."""
        name = f"{self.path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
        aside, n = self.path.with_name(name), 1
        while any(Path(f"{aside}{suffix}").exists() for suffix in ("", "-wal", "-shm")):
            n += 1
            aside = self.path.with_name(f"{name}-{n}")
        return aside

    def _connection(self) -> sqlite3.Connection:
        """The file, opened where it is not; the rows `carried` from one journal.path no longer names
        written to it first."""
        if self._db is None:
            self.open()
        assert self._db is not None
        if self.carried:
            self._insert(self.carried, self._cursors)
            self.carried, self._cursors = [], []
            self._writes = None if self._file is None else (self._file, self.last_id)
        return self._db

    def write_carried(self) -> bool:
        """Write the rows `carried` now, where no batch follows to write them first (a stop, an idle
        line); True when there were some."""
        if not self.carried:
            return False
        self._connection()
        return True

    def append(self, entries: Sequence[Entry], identity: Identity, synced: bool | None) -> None:
        """Write ``entries`` in one transaction: all of them or none."""
        self._connection()
        rows: list[Row] = [
            (
                e.kind,
                e.camera_id,
                e.frame_id,
                e.seq,
                e.part_id,
                e.verdict,
                e.reasons,
                e.wall_ns,
                e.mono_ns,
                synced,
                e.model_sha256,
                e.config_sha256,
                identity.version,
                identity.board_id,
                identity.boot_id,
                e.evidence,
                e.message.decode(),
            )
            for e in entries
        ]
        self._insert(rows)

    def _insert(self, rows: Sequence[Row], cursors: Sequence[str] = ()) -> None:
        """Write ``rows`` in one transaction (all of them or none); while the file's -wal is gone (`follow`),
        folded into the file at once, where `edged history` reads it and a kill of edged cannot take it.
        Outputs named in ``cursors`` that have none in the file get one before the rows: an output's feed
        that has not read this file yet (edged stopped or killed first) would start at its end, the
        verdicts carried to it skipped for good."""
        db = self._db
        assert db is not None
        try:
            with db:  # BEGIN ... COMMIT, or ROLLBACK on an error
                db.execute("BEGIN")
                if cursors:
                    db.execute(CURSORS)
                    start = "INSERT OR IGNORE INTO cursors (name, row_id) SELECT ?, coalesce(max(id), 0) FROM entries"
                    db.executemany(start, [(name,) for name in cursors])
                db.executemany(_INSERT, rows)
                last = int(db.execute("SELECT last_insert_rowid()").fetchone()[0])
            self.last_id = last
            if self._apart:
                self.folded = self._fold(db)
        except sqlite3.DatabaseError as e:
            self._after_error(e)
            raise

    def _after_error(self, error: sqlite3.DatabaseError) -> None:
        """A damaged file is moved aside now, so that the retry starts a new one."""
        if isinstance(error, sqlite3.OperationalError):
            return
        self.close()
        self._move_aside(error)

    def size(self) -> int:
        """Bytes the journal's pages take (free pages not counted)."""
        db = self._connection()
        pages = db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
        return int(pages * db.execute("PRAGMA page_size").fetchone()[0])

    def wal_bytes(self) -> int:
        """Bytes the write-ahead log (``journal.sqlite-wal``) takes beside the file (a link's, beside what it names)."""
        try:
            return os.stat(f"{os.path.realpath(self.path)}-wal").st_size
        except OSError:
            return 0

    def replaced(self) -> str | None:
        """How journal.path no longer names the files open, None while it does: rows written to a file
        no path names (or to a ``-wal`` none does) are unseen by `edged history` and go when edged
        stops (or dies); a ``-shm`` made anew by a reader shows it a state edged no longer updates."""
        if self._db is None:
            return None
        if self._file is None:  # removed as it opened, before its id was read
            return GONE
        real = os.path.realpath(self.path)  # SQLite's -wal and -shm are beside the file a link names
        try:
            found = os.stat(real)
        except FileNotFoundError:
            return GONE
        except OSError:
            return None  # a folder edged cannot look into now: counted where a write fails
        if (found.st_dev, found.st_ino) != self._file:
            return REPLACED
        gone = [suffix for suffix, beside in self._beside.items() if file_id(Path(f"{real}{suffix}")) != beside]
        return f"left without its {' and '.join(gone)}" if gone else None  # a -wal a reader made since is not its

    def follow(self, keep_unsent: bool, *, at_once: bool = False) -> Reopened | None:
        """Open journal.path anew where it no longer names the file written (`replaced`: `GONE` or
        `REPLACED`), looked at once per `LOOK_EVERY_S`; what a file no path names holds is unseen by
        `edged history` and gone when edged stops. Its rows recorded since the last look found it at
        journal.path and, with ``keep_unsent``, the verdicts an output delivering from the journal
        (MQTT) has not had acknowledged are `carried`: written first to the file opened there (as at
        start: a new journal, the journal found, or a file that is not one moved aside). Raises where
        journal.path cannot be opened now (its folder gone): the next call tries again, the rows kept
        meanwhile. A file left without its -wal or -shm alone is still at journal.path; it is not
        opened anew, as this process's other connection (MQTT's `edged.replay.VerdictFeed`) shares its
        wal-index and would pair it with two logs, but each batch is folded into it (`_insert`).
        ``at_once``: look now, whenever the last look was (a stop: no later write would)."""
        if self._gone is None:
            if self._db is None or (time.monotonic() < self._next_look and not at_once):
                return None
            self._next_look = time.monotonic() + LOOK_EVERY_S
            gone = self.replaced()
            self._apart = None if gone in (None, GONE, REPLACED) else gone
            if gone is None or self._apart:
                self._seen = self.last_id
                if self._apart:
                    self.folded = self._fold(self._db)  # what the -wal no path names held
                self._relock()
                return None
            self._let_go(gone, keep_unsent)
        assert self._gone is not None
        reopened = Reopened(self._gone, self.open(), len(self.carried), self._lost)
        self._gone, self._lost = None, 0
        return reopened

    def _let_go(self, gone: str, keep_unsent: bool) -> None:
        """Keep the rows to carry (`follow`) and close the file journal.path no longer names. Its -wal
        and -shm go from beside its name where they are still the ones it opened (another's, put there
        with it, stay): SQLite would read them as the next file's (that -wal's pages over its own) and
        share that -shm with the feed still reading the old file, whose map it cuts short on opening."""
        db, real = self._db, self._real
        assert db is not None
        kept = self._file is not None and file_id(Path(real)) == self._file  # a link names another file: this one is whole
        with contextlib.suppress(sqlite3.Error):  # a file moved away holds every row, as far as a reader lets it
            self._fold(db)
        carried, lost = self._leftover(db, keep_unsent, QUEUE_BYTES - sum(len(str(row[-1])) for row in self.carried))
        self.carried, self._lost = [*self.carried, *carried], self._lost + lost  # those not yet written come first
        self._cursors = sorted({*self._cursors, *(self._outputs(db) if keep_unsent and carried else [])})
        self.close()  # SQLite neither folds nor removes anything by name on closing a file moved or removed
        self._gone = gone
        if kept:
            return
        for suffix, beside in self._beside.items():
            if file_id(Path(f"{real}{suffix}")) == beside:
                with contextlib.suppress(OSError):
                    os.unlink(f"{real}{suffix}")

    def _relock(self) -> None:
        """Take the lock anew where its file was removed under edged (a cleanup of the folder): the
        next edged to start would find none held and write this journal too. Where another took it
        meanwhile, the file is let go (raised): this edged writes again once that one has let go."""
        assert self._lock is not None
        held = lock_file(self.path)
        taken = os.fstat(self._lock)
        if file_id(held) == (taken.st_dev, taken.st_ino):
            return
        try:
            again = lock(self.path)
        except OSError as e:
            if e.errno != errno.EWOULDBLOCK:  # none can be made there now (read-only, a folder): nor by another edged
                return
            self.close()
            taken_by = f"its lock {held} was removed while edged wrote it, and another edged took it"
            raise OSError(e.errno, f"{taken_by}: give each edged a journal.path of its own") from e
        os.close(self._lock)
        self._lock = again
        log.warning("journal %s: its lock %s was removed while edged wrote it; taken again", self.path, held)

    @staticmethod
    def _outputs(db: sqlite3.Connection) -> list[str]:
        """The outputs with a cursor in journal ``db`` (`edged.replay`); none where it cannot be read."""
        with contextlib.suppress(sqlite3.Error):
            if acknowledged(db) is not None:
                return [str(row[0]) for row in db.execute("SELECT name FROM cursors")]
        return []

    def _leftover(self, db: sqlite3.Connection, keep_unsent: bool, room: int) -> tuple[list[Row], int]:
        """The rows of file ``db`` to carry, oldest first, up to ``room`` characters of messages (the
        newest kept), and how many verdicts not yet acknowledged did not fit."""
        try:
            sent = acknowledged(db) if keep_unsent else None
            wanted = "(id > ? OR (kind = 'verdict' AND id > ?))"  # unseen, or not yet acknowledged
            params = (self._seen, LAST_ROW if sent is None else sent)
            kept: list[Row] = []
            size = lost = 0
            query = f"SELECT id, {', '.join(COLUMNS)} FROM entries WHERE {wanted} ORDER BY id DESC"
            for row_id, *row in db.execute(query, params):
                size += len(row[-1])  # the message
                if size > room:  # the older ones counted, not read: a week's backlog would hold the writer up
                    older = f"SELECT count(*) FROM entries WHERE {wanted} AND id <= ?"
                    lost = int(db.execute(older, (*params, row_id)).fetchone()[0])
                    break
                kept.append(tuple(row))
        except sqlite3.Error as e:  # the old file damaged: what it holds stays in it
            log.error("journal %s: the file no path names now cannot be read (%s); its rows are not carried", self.path, e)
            return [], 0
        kept.reverse()
        return kept, lost

    def prune(
        self,
        now_ns: int,
        max_age_days: float,
        max_bytes: int,
        *,
        boot: tuple[str, int] | None = None,
        keep_unsent: bool = False,
        synced: bool | None = None,
    ) -> int:
        """Delete rows older than ``max_age_days`` (0: none), then the oldest tenth until under
        ``max_bytes``; give the space back to the file system. Returns the rows deleted.

        A row is past the age limit once it, or a row recorded after it, is past it on a time that
        is `sure`: the rows of ``boot`` (this boot's id, and its monotonic clock now) on the
        monotonic clock, which no step of the wall clock moves; an earlier boot's on the wall time
        they carry where the clock was set. A board without a real-time clock that recorded before
        NTP set its clock (1970, or months behind), in this boot or an earlier one, deletes none of
        those rows early: they go with the first sure row after them. ``synced``: whether the clock
        is synchronised now (`edged.identity.clock_synced`). With ``keep_unsent``, age never deletes a
        verdict an output delivering from the journal (MQTT) has not had acknowledged: a backlog is
        bounded by ``max_bytes`` alone, whatever the clock says of its age."""
        db = self._connection()
        deleted = 0
        try:
            with db:
                db.execute("BEGIN")
                if max_age_days > 0:
                    deleted += self._age_out(db, now_ns - int(max_age_days * 86_400e9), now_ns, boot, keep_unsent, synced)
            while self.size() > max_bytes:
                with db:
                    db.execute("BEGIN")
                    rows = db.execute("SELECT count(*) FROM entries").fetchone()[0]
                    if rows == 0:
                        break
                    cut = db.execute(
                        "SELECT id FROM entries ORDER BY id LIMIT 1 OFFSET ?", (max(rows // 10, 1) - 1,)
                    ).fetchone()[0]
                    sent = acknowledged(db) if keep_unsent else None
                    if sent is not None:
                        unsent = "SELECT count(*) FROM entries WHERE kind = 'verdict' AND id > ? AND id <= ?"
                        self.unsent_deleted += int(db.execute(unsent, (sent, cut)).fetchone()[0])
                    deleted += db.execute("DELETE FROM entries WHERE id <= ?", (cut,)).rowcount
            if deleted:
                db.executescript("PRAGMA incremental_vacuum;")  # a page per step: executescript steps them all
            self.folded = self._fold(db)
        except sqlite3.DatabaseError as e:
            self._after_error(e)
            raise
        return deleted

    @staticmethod
    def _fold(db: sqlite3.Connection) -> bool:
        """Fold the write-ahead log into the file and empty it, without waiting; True when done. A
        reader on an old snapshot (``sqlite3`` left open, a pager on its output, a backup) makes a
        TRUNCATE checkpoint wait for it, for the whole busy timeout, on the journal's thread, and
        every verdict sent only once recorded waited as long; it folds what it can instead."""
        db.execute("PRAGMA busy_timeout = 0")
        try:
            return int(db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]) == 0
        finally:
            db.execute(f"PRAGMA busy_timeout = {int(BUSY_WAIT_S * 1000)}")

    @staticmethod
    def _age_out(
        db: sqlite3.Connection,
        cutoff_ns: int,
        now_ns: int,
        boot: tuple[str, int] | None,
        keep_unsent: bool,
        synced: bool | None,
    ) -> int:
        """Delete the rows up to the last `sure` row before the first sure row recorded after
        ``cutoff_ns``. Rows were recorded in the order of their ids, so a sure row past the cutoff
        shows that every row before it is; both rows are found by a walk from one end of the table
        that stops at them (not a scan of the whole journal), and what goes is a range of ids."""
        boot_id, mono_ns = boot if boot is not None else (None, 0)  # NULL: no row is this boot's
        synced_row = None if synced else _one(db, "SELECT id FROM entries WHERE clock_synced = 1 ORDER BY id DESC LIMIT 1")
        known, params = sure(boot_id, LAST_ROW if synced else synced_row or 0)
        newer, bound = timed(">=", cutoff_ns, boot_id, mono_ns, now_ns)
        first = _one(db, f"SELECT id FROM entries WHERE {known} AND {newer} ORDER BY id LIMIT 1", *params, *bound)
        past = _one(
            db, f"SELECT id FROM entries WHERE id < ? AND {known} ORDER BY id DESC LIMIT 1", first or LAST_ROW, *params
        )
        if past is None:
            return 0
        sent = acknowledged(db) if keep_unsent else None
        delete = "DELETE FROM entries WHERE id <= ? AND (kind != 'verdict' OR id <= ?)"
        return int(db.execute(delete, (past, LAST_ROW if sent is None else sent)).rowcount)

    def close(self) -> None:
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None
        self._file = self._writes = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


class JournalWriter:
    """Takes entries from the loop (`offer`, never blocking) and writes them on its own thread."""

    def __init__(
        self,
        cfg: JournalConfig,
        identity: Identity,
        previous: JournalWriter | None,
        carried: Sequence[Entry] = (),
        *,
        keep_unsent: bool = False,
    ) -> None:
        """``previous``: the writer this one replaces, whose counters it goes on with; ``carried``:
        the entries it could not write, which this one writes first; ``keep_unsent``: an output
        delivers from the journal, whose verdicts not yet acknowledged age never deletes
        (`JournalStore.prune`)."""
        self.cfg = cfg
        self.keep_unsent = keep_unsent
        self.store = JournalStore(cfg.file, cfg.durability)
        self._identity = identity
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[Entry] = deque(carried)
        self._queued_bytes = sum(len(entry.message) for entry in carried)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="journal", daemon=True)
        if previous is not None and not previous._thread.is_alive():  # rows it kept from a file no path named
            self.store.carried = previous.store.carried
        self.recorded: dict[str, int] = previous.recorded if previous else {}
        self.dropped: dict[str, int] = previous.dropped if previous else {}
        self.failures: Failures = Failures(previous.failures if previous else None)
        # Verdicts deleted for room before an output had them acknowledged, since start: lost to the broker
        self.unsent_deleted: int = previous.unsent_deleted if previous else 0
        self.bytes = 0
        self.opened_id = 0  # the newest row's id when `start` opened the journal
        self.accepted = len(carried)  # entries queued so far, in order (the loop's count)
        self.written = 0  # of those, the ones committed (the journal thread's count)
        self._drop_log = LogRate(LOG_EVERY_S)
        self._reopen_log = LogRate(LOG_EVERY_S)
        self._reopens = 0  # journal.path opened anew since the last line that said so
        self._said: set[str] = set()  # the conditions of the file a retention pass has said and not yet seen end
        # Set after each batch is committed, and when a write fails: the threads that wait on the journal
        # (the outputs that deliver from it, the loop's sends held until it records, `JournalOutput.after_recorded`).
        self.committed: weakref.WeakSet[Waker] = weakref.WeakSet()

    def start(self, records: bool) -> None:
        """Open the journal now when it ``records`` verdicts or detections, so that a feed made next
        finds it, then write on a thread of its own. One that records neither opens (and locks,
        `lock`) its file only for a first entry, a promotion's: two edged without [inspect] beside
        one configuration folder share its default journal path, and neither holds it."""
        if records:
            self._attempt(self.store.open)
        self.opened_id = self.store.last_id
        self._thread.start()

    def offer(self, entry: Entry) -> None:
        """Queue ``entry`` for the disk; when the disk is so far behind that the queue is full, it is
        dropped and counted."""
        size = len(entry.message)
        with self._lock:
            if self._queued_bytes + size > QUEUE_BYTES:
                self.dropped[entry.camera_id] = self.dropped.get(entry.camera_id, 0) + 1
                if self._drop_log.allows():
                    log.error(
                        "journal %s: %d bytes wait for the disk; new entries are dropped and counted",
                        self.store.path,
                        self._queued_bytes,
                    )
                return
            self._queue.append(entry)
            self._queued_bytes += size
            self.accepted += 1
            self._wake.notify()

    def report(self, camera_id: str) -> JournalReport:
        return JournalReport(
            path=str(self.store.path),
            recorded=self.recorded.get(camera_id, 0),
            dropped=self.dropped.get(camera_id, 0),
            errors=self.failures.count,
            bytes=self.bytes,
            last_error=self.failures.last,
            unsent_deleted=self.unsent_deleted,
        )

    @property
    def writing(self) -> bool:
        """Its thread runs and its last write succeeded: what is queued will be on disk soon."""
        return self._thread.is_alive() and not self.failures.failing

    def stop(self, timeout_s: float) -> list[Entry]:
        """Write what is queued, within ``timeout_s``, and close the file; returns the entries a
        failing disk kept it from writing, for the writer that replaces it (`JournalOutput.reload`)
        or to be given up (`give_up`); none while a write is still under way: they are its."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        with self._lock:
            if self._thread.is_alive():
                log.warning(
                    "journal %s: stopping with %d entries not yet written (the disk is too slow)",
                    self.store.path,
                    len(self._queue),
                )
                return []
            left = list(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
        return left

    def give_up(self, entries: Sequence[Entry]) -> None:
        """``entries`` will never be written (edged stops while the disk fails), nor the rows the store
        carries from a file journal.path no longer named (`JournalStore.follow`): said, and counted as dropped."""
        carried = [] if self._thread.is_alive() else self.store.carried
        if not entries and not carried:
            return
        for camera_id in [entry.camera_id for entry in entries] + [str(row[1]) for row in carried]:
            self.dropped[camera_id] = self.dropped.get(camera_id, 0) + 1
        log.warning(
            "journal %s: stopping with %d entries not written (%s); they are lost",
            self.store.path,
            len(entries) + len(carried),
            self.failures.last or "the disk failed",
        )

    # ---- the journal's thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._write()
        except Exception as e:  # a fault of edged's own: said and shown, never a thread gone without a word
            log.exception("journal %s: its writer stopped", self.store.path)
            self.failures.failed(f"the journal's writer stopped: {type(e).__name__}: {e}")
            self._tell()
        self.store.close()

    def _write(self) -> None:
        """Write batches as they come, prune now and then, until a stop."""
        retry_s = RETRY_S[0]
        next_prune, looked = 0.0, time.monotonic()  # just opened: looked at
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    wake_at = min(next_prune, self._idle_look(looked))
                    if time.monotonic() >= wake_at:
                        break
                    self._wake.wait(wake_at - time.monotonic())
                batch = [self._queue[i] for i in range(min(len(self._queue), BATCH_ROWS))]
                stopping = self._stopping
            if batch:
                if self._attempt(partial(self._append, batch)):
                    self._written(batch)
                    retry_s = RETRY_S[0]
                elif self._pause(retry_s):
                    break
                else:
                    retry_s = min(retry_s * 2, RETRY_S[1])
                continue
            if stopping:
                self._attempt(partial(self._look, at_once=True))
                break
            if time.monotonic() < next_prune:  # idle: journal.path looked at, as a batch would
                looked = time.monotonic()
                if not self._attempt(self._look):  # not opened anew (its folder gone): retried as a failed pass is
                    next_prune = min(next_prune, time.monotonic() + retry_s)
                continue
            if self._attempt(self._prune):
                next_prune = time.monotonic() + PRUNE_EVERY_S
            else:
                next_prune = time.monotonic() + retry_s

    def _idle_look(self, looked: float) -> float:
        """When a writer with no entry to write next looks at journal.path (`_look`), its last such look at
        ``looked``: a line stopped saw the file removed only at the next retention pass, a minute on, and
        meanwhile `edged history` found none, and a kill lost what only the removed file held. A busy one
        has looked as it wrote (`LOOK_EVERY_S`) and is not woken for it; no file open, none to look at."""
        if not self.store.opened:
            return float("inf")
        return max(self.store.next_look, looked + IDLE_LOOK_S)

    def _append(self, batch: list[Entry]) -> None:
        self._follow()
        self.store.append(batch, self._identity, clock_synced())

    def _look(self, *, at_once: bool = False) -> None:
        """Where no batch follows (an idle line; ``at_once``, a stop), journal.path looked at, and what a file
        no path names held written to the one there now, the feeds told: at a stop, the rows since the last
        look (a second's, sent already) went with the file at exit (``rm journal.sqlite; systemctl restart
        edged``), its -wal and -shm left beside journal.path."""
        self._follow(at_once=at_once)
        if self.store.write_carried():
            self._tell()

    def _follow(self, *, at_once: bool = False) -> None:
        """Open journal.path anew where it no longer names the file written (`JournalStore.follow`):
        counted as a journal error and said, with what the path holds now, at most once a minute."""
        reopened = self.store.follow(self.keep_unsent, at_once=at_once)
        if reopened is None:
            return
        self.unsent_deleted += reopened.lost
        self.failures.noted(f"journal.path was {reopened.was} while edged wrote it: opened anew")
        self._reopens += 1
        if not self._reopen_log.allows():
            return
        unsent = " or the broker had not acknowledged" if self.keep_unsent else ""
        carried = f"; {reopened.carried} entries the old file held that journal.path did not show{unsent} go to it first"
        lost = f"; {reopened.lost} verdicts the broker had not acknowledged did not fit in memory and are lost"
        again = f" ({self._reopens} times since the last such line)" if self._reopens > 1 else ""
        log.log(
            logging.ERROR if reopened.lost else logging.WARNING,
            "journal %s was %s while edged wrote it: journal.path is opened anew, %s%s%s%s",
            self.store.path,
            reopened.was,
            reopened.now,
            carried if reopened.carried else "",
            lost if reopened.lost else "",
            again,
        )
        self._reopens = 0

    def _written(self, batch: list[Entry]) -> None:
        with self._lock:
            for entry in batch:
                self._queue.popleft()
                self._queued_bytes -= len(entry.message)
                self.recorded[entry.camera_id] = self.recorded.get(entry.camera_id, 0) + 1
            self.written += len(batch)
        self._tell()
        if self.failures.succeeded():
            log.info("journal %s written again after %d error(s)", self.store.path, self.failures.count)

    def _tell(self) -> None:
        for wake in list(self.committed):
            wake.set()

    def _pause(self, seconds: float) -> bool:
        """Wait ``seconds`` before a retry; True when a stop asks to give up instead."""
        with self._lock:
            if not self._stopping:
                self._wake.wait_for(lambda: self._stopping, seconds)
            return self._stopping

    def _prune(self) -> None:
        self._follow()
        store = self.store
        if not store.opened:  # nothing written yet, or the file went aside: the next write opens it
            return
        boot = (self._identity.boot_id, time.monotonic_ns())
        cfg, synced, keep, unsent = self.cfg, clock_synced(), self.keep_unsent, store.unsent_deleted
        store.prune(time.time_ns(), cfg.max_age_days, cfg.max_bytes, boot=boot, keep_unsent=keep, synced=synced)
        self.bytes = store.size() + store.wal_bytes()
        if store.unsent_deleted > unsent:
            self.unsent_deleted += store.unsent_deleted - unsent
            log.warning(
                "journal %s: %d verdicts the broker has not acknowledged were deleted to keep the journal under "
                "journal.max_bytes (%d); they will never be sent (a larger max_bytes holds a longer outage)",
                store.path,
                store.unsent_deleted - unsent,
                cfg.max_bytes,
            )
        self._say(
            "wal",
            not store.folded and self.bytes > cfg.max_bytes,
            f"journal {store.path} takes {self.bytes} bytes, over journal.max_bytes ({cfg.max_bytes}): its "
            f"write-ahead log ({store.path}-wal) cannot be folded into it while another process holds a read of "
            "an old snapshot open (sqlite3 left open, a pager on its output, a backup), and grows until it ends",
            f"journal {store.path}: its write-ahead log is folded into it again",
            logging.WARNING,
        )
        self._say(
            "file",
            store.apart is not None,
            f"journal {store.path} was {store.apart} while edged writes it: until edged restarts, each batch is folded into "
            "the file at once, where edged history reads it and a kill of edged cannot take it",
            f"journal {store.path}: the file written is whole at journal.path again",
            logging.WARNING,
        )

    def _say(self, what: str, now: bool, starts: str, ends: str, level: int) -> None:
        """Log ``starts`` (at ``level``) when condition ``what`` of the file begins, ``ends`` when it is over."""
        if now and what not in self._said:
            self._said.add(what)
            log.log(level, starts)
        elif not now and what in self._said:
            self._said.discard(what)
            log.info(ends)

    def _attempt(self, action: Callable[[], object]) -> bool:
        """Run ``action``; an error is counted, and logged when a burst of them starts."""
        try:
            action()
        except Exception as e:  # the disk's (sqlite3.Error, OSError), or a fault of edged's own: retried as one
            if not isinstance(e, (sqlite3.Error, OSError)):
                log.exception("journal %s: unexpected error", self.store.path)
            if self.failures.failed(f"{type(e).__name__}: {e}"):
                log.error(
                    "journal %s not written: %s; inspection goes on, entries wait in memory (up to %d MB) and "
                    "further failures are counted as journal errors until a write succeeds",
                    self.store.path,
                    self.failures.last,
                    QUEUE_BYTES // 1_000_000,
                )
                self._tell()  # what waits for the journal goes on without it (`JournalOutput.deliver_recorded`)
            return False
        return True


class JournalOutput(Output):
    """The journal as an output (`edged.output`): it asks for the messages as sent, and records each
    verdict (and detections message, when configured) of every camera in one file.

    A verdict leaves through ZeroMQ or as a request's reply only once it is recorded
    (`after_recorded`): after a crash, every verdict anybody received is in the journal. It comes
    before those outputs in `edged.outputs.OUTPUTS`, so a frame's entries are queued when they hold its sends.
    """

    def __init__(
        self, settings: Settings, wake: Waker, previous: JournalWriter | None = None, carried: Sequence[Entry] = ()
    ) -> None:
        self._adopt(settings)
        self._loop_wake = wake
        self._held: deque[tuple[int, Callable[[], object]]] = deque()  # (entries accepted before it, the send)
        self.writer = JournalWriter(self._cfg, Identity.here(), previous, carried, keep_unsent=self._delivers)
        self._carried = bool(carried)
        self.writer.committed.add(wake)
        self.writer.start(records=records(settings))

    def _adopt(self, settings: Settings) -> None:
        self._cfg = settings.journal
        self._delivers = settings.mqtt is not None  # MQTT sends the verdicts from the journal (`edged.replay`)
        self._config_sha256 = config_sha256(settings)
        self._inspected = set(settings.inspected())

    @staticmethod
    def in_use(settings: Settings, *, create: bool = True) -> str | None:
        """Why ``settings``' journal cannot be this edged's (another edged writes it), for a start or a
        reload that moves the journal, and for ``edged check`` (without ``create``: a check run as root
        must leave no lock file the service's user cannot open); None when it can, when it is off, or
        when it records nothing (`JournalWriter.start`). A folder that takes no file is not said here:
        the writer counts and retries that as it would any full disk."""
        cfg = settings.journal
        if not cfg.enabled or not records(settings):
            return None
        try:
            os.close(lock(cfg.file, create=create))
        except OSError as e:
            if e.errno != errno.EWOULDBLOCK:
                return None
            holders = lock_holders(lock_file(cfg.file))
            by = f" by process {pid} ({command_line(pid) or 'gone since'})" if (pid := next(iter(holders), None)) else ""
            return f"journal.path {cfg.file} is {e.strerror}{by}: give each edged a journal.path of its own"
        return None

    @classmethod
    def from_settings(cls, settings: Settings, services: Services) -> JournalOutput | None:
        return cls(settings, services.wake) if settings.journal.enabled else None

    def wants(self, camera_id: str, found: bool) -> Delivery:
        return Delivery.SENT if camera_id in self._inspected or (found and self._cfg.detections) else Delivery.NONE

    def frame(self, report: FrameReport) -> None:
        message = report.message
        if message is None:
            return
        mono_ns = report.outcome.frame.t_capture_ns
        if report.verdict is not None and report.verdict_payload is not None:
            verdict = report.verdict
            self.writer.offer(
                Entry(
                    "verdict",
                    report.camera_id,
                    verdict.frame_id,
                    verdict.seq,
                    verdict.part_id,
                    verdict.verdict,
                    json.dumps([reason.model_dump() for reason in verdict.reasons]),
                    verdict.capture_time_ns,
                    mono_ns,
                    message.model.sha256,
                    self._config_sha256,
                    report.verdict_payload,
                    report.saved.get("evidence"),
                )
            )
        if self._cfg.detections and report.found and report.payload is not None:
            self.writer.offer(
                Entry(
                    "detections",
                    report.camera_id,
                    message.frame_id,
                    message.seq,
                    message.part_id,
                    message.verdict,
                    None,
                    message.capture_time_ns,
                    mono_ns,
                    message.model.sha256,
                    self._config_sha256,
                    report.payload,
                    report.saved.get("evidence"),
                )
            )

    def model_change(self, kind: Literal["promotion", "rollback"], live_sha256: str, record: dict[str, object]) -> None:
        """A promotion or rollback (`edged.control`): the board's entry (no camera, no frame), its
        message the JSON ``record`` naming both models' sha256, who and why."""
        message = json.dumps({"kind": kind, **record}).encode()
        entry = Entry(
            kind, "", 0, 0, None, None, None, time.time_ns(), time.monotonic_ns(), live_sha256, self._config_sha256, message
        )
        self.writer.offer(entry)

    def report(self, camera_id: str) -> OutputReport:
        if camera_id not in self._inspected and not self._cfg.detections:
            return NO_REPORT
        report = self.writer.report(camera_id)
        return OutputReport(drops={"journal": report.dropped}, fields={"journal": report})

    def reload(self, settings: Settings, services: Services) -> JournalOutput | None:
        """The same file and durability keep the writer; anything else starts a new one, counters carried."""
        cfg = settings.journal
        if not cfg.enabled:
            self.close()
            return None
        if cfg.path == self._cfg.path and cfg.durability == self._cfg.durability:
            self._adopt(settings)
            self.writer.cfg, self.writer.keep_unsent = cfg, self._delivers
            return self
        left = self.writer.stop(STOP_WAIT_S)  # what a failing disk kept: written to the new journal first
        self.deliver_recorded()
        return JournalOutput(settings, self._loop_wake, self.writer, left)

    @property
    def path(self) -> Path:
        return self.writer.store.path

    @property
    def last_id(self) -> int:
        """The newest entry's id, as of the last write (read from other threads)."""
        return self.writer.store.last_id

    def feed(self, name: str, wake: Wake) -> VerdictFeed:
        """The verdicts for output ``name`` to deliver from the journal; ``wake`` is set when new ones
        are recorded. Where the file has no cursor for ``name``, those recorded before the output was
        there stay unsent, but not the entries carried over from the journal this one replaced:
        they were made while it was. A journal that records nothing has not opened its file, so the
        feed reads where it ends (an earlier configuration's verdicts: before the output too)."""
        self.writer.committed.add(wake)
        store = self.writer.store
        first_after = self.writer.opened_id if self._carried else self.last_id if store.opened else None
        return VerdictFeed(self.path, name, first_after, writes=lambda: store.writes)

    def after_recorded(self, send: Callable[[], object]) -> None:
        """Call ``send`` (on the loop's thread) once every entry queued so far is on disk, in the order
        held; at once while the journal cannot write, so that a broken disk never holds up answers
        (those verdicts wait in its queue, counted as journal errors until written)."""
        self._held.append((self.writer.accepted, send))
        if not self.writer.writing:
            self.deliver_recorded()

    def deliver_recorded(self) -> None:
        """On the loop's thread, every turn: the held sends whose entries are recorded; all of them
        while the journal cannot write."""
        held, writer = self._held, self.writer
        while held and (held[0][0] <= writer.written or not writer.writing):
            held.popleft()[1]()

    def drain(self) -> None:
        """Write what is queued, within `STOP_WAIT_S`; then whatever was held goes out, recorded or not."""
        self.writer.give_up(self.writer.stop(STOP_WAIT_S))
        self.deliver_recorded()

    def close(self) -> None:
        self.drain()
