"""Store and forward: the journal's verdicts, in order, to an output that promises delivery (MQTT).

The output's own thread asks for the verdicts after those it has handed out (`VerdictFeed.take`)
and says which ones the broker acknowledged (`acked`); its client sends again, on the next
connection, those handed out and not yet acknowledged. Everything up to the cursor has been
acknowledged, and the cursor is kept in the journal, so an outage of the broker or the network
resumes where it stopped, and a restart of edged where the acknowledgements stopped. The cursor is
written as the feed is made, so the verdicts of a run that never reached the broker go out after
the next start too. Delivery is at least once: a verdict sent and not acknowledged before edged
stopped goes again (a subscriber that must count each once keys on ``board_id``, ``run_id``,
``camera_id`` and ``seq``: ``seq`` starts again at each start of edged, ``run_id`` is new each
start). A verdict committed before the connection it goes out on carries ``replayed: true``; each
feed knows, for its own file, the row at which that connection came up. Memory stays flat
whatever the outage: rows are read a window at a time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sqlite3
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from edged.files import sqlite_uri
from edged.lograte import LogRate

log = logging.getLogger(__name__)
T = TypeVar("T")
FileId = tuple[int, int]  # a file's device and inode
LAST_ROW = 2**63 - 1  # SQLite's largest integer: no row id is above it
# The file the journal's writer has open, and the row up to which its rows were recorded before it
# wrote there (the journal found, the rows carried from a file journal.path no longer named).
Writes = tuple[FileId, int]

CURSORS = "CREATE TABLE IF NOT EXISTS cursors (name TEXT PRIMARY KEY, row_id INTEGER NOT NULL)"
SAVE_EVERY_S = 1.0  # the cursor is written at most this often (and at close)
BUSY_WAIT_S = 1.0  # how long a read waits for the journal's writer to finish a transaction


@dataclass(frozen=True, slots=True)
class Forward:
    """One verdict to send: its journal row, camera and payload (marked when replayed)."""

    row_id: int
    camera_id: str
    payload: bytes


def mark_replayed(message: str) -> bytes:
    """The verdict message as sent, with ``replayed`` set: it was recorded before this connection."""
    fields = json.loads(message)
    fields["replayed"] = True
    return json.dumps(fields, separators=(",", ":")).encode()


def _cursor_row(db: sqlite3.Connection, name: str, first_after: int) -> int:
    """``name``'s cursor in the journal ``db``, written at ``first_after`` where it has none yet."""
    db.execute(CURSORS)
    row = db.execute("SELECT row_id FROM cursors WHERE name = ?", (name,)).fetchone()
    if row is None:
        db.execute("INSERT INTO cursors (name, row_id) VALUES (?, ?)", (name, first_after))
        return first_after
    return int(row[0])


def acknowledged(db: sqlite3.Connection) -> int | None:
    """The row up to which every output delivering from journal ``db`` had its verdicts
    acknowledged (the least cursor); None where no output has a cursor there yet."""
    if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'cursors'").fetchone() is None:
        return None
    least = db.execute("SELECT min(row_id) FROM cursors").fetchone()[0]
    return None if least is None else int(least)


def file_id(path: Path) -> FileId | None:
    """``path``'s device and inode; None where it cannot be told (gone since it was opened)."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _last_row(db: sqlite3.Connection) -> int:
    return int(db.execute("SELECT coalesce(max(id), 0) FROM entries").fetchone()[0])


class VerdictFeed:
    """The journal's verdicts not yet acknowledged to one output (``name``): made on the loop's
    thread, then used by that output's thread only."""

    def __init__(
        self, path: Path, name: str, first_after: int | None, writes: Callable[[], Writes | None] = lambda: None
    ) -> None:
        """``first_after``: the row up to which the journal's verdicts were recorded before this
        output was given them; None: the newest row the file holds now, as read here (a journal
        whose writer has not opened its file, one that records nothing, knows no row of it). Where
        the journal has no cursor for ``name`` yet, it is written at that row now (those up to it
        stay unsent), not at the first read: only a connection makes one, and a run that never
        reached the broker would leave none, so the next start would skip its verdicts.
        ``writes``: the file the journal's writer has open now (`_follow`), and the rows it holds that
        were recorded before (`_recorded_before`)."""
        self.path = path
        self.name = name
        self._writes = writes
        self._file: FileId | None = None  # the file read, as opened
        self._made_after = first_after or 0
        self._first_after = first_after or 0  # a cursor missing at the first read starts here
        self._db: sqlite3.Connection | None = None
        self._cursor = 0  # every verdict up to this row is acknowledged
        self._sent = 0  # handed out up to this row
        self._in_flight: deque[int] = deque()  # rows handed out and not yet acknowledged, in order
        self._acked: set[int] = set()  # of those, acknowledged out of order
        self._stale: set[int] = set()  # rows of a file gone aside, handed out and not yet acknowledged (`_started_anew`)
        self._live_from: int | None = None  # rows above this were recorded while this connection was up; None: read it
        self._saved = 0  # the cursor as last written
        self._saved_at = -math.inf  # the first acknowledgement is written at once, on a board just up too
        self.errors = 0
        self._log = LogRate(60.0)
        self._anew_log = LogRate(60.0)  # a file removed again and again is said once a minute (`_started_anew`)
        try:
            db = self._open()
            if db is not None:
                with contextlib.closing(db):
                    if first_after is None:
                        self._made_after = _last_row(db)
                    _cursor_row(db, name, self._made_after)
        except sqlite3.Error as e:
            self._failed(e)  # written at the first read instead
        else:
            # A file found later without the cursor was started since (this one moved aside as
            # damaged, or none there yet): every verdict in it is this output's.
            self._first_after = 0

    def _open(self) -> sqlite3.Connection | None:
        """The journal's file; None while there is none (a journal that records nothing has none
        until its first entry): only its writer makes one, and locks it."""
        if not self.path.exists():
            return None
        return sqlite3.connect(
            sqlite_uri(self.path, "mode=rw"),
            uri=True,
            timeout=BUSY_WAIT_S,
            isolation_level=None,
            check_same_thread=False,
        )

    def _connection(self) -> sqlite3.Connection | None:
        if self._db is None:
            db = self._open()
            if db is None:
                return None
            try:
                file = file_id(self.path) or self._file
                if self._file is not None and file != self._file:
                    self._started_anew()
                cursor = _cursor_row(db, self.name, self._first_after)
            except BaseException:
                db.close()
                raise
            self._db, self._file = db, file
            self._cursor = self._sent = self._saved = cursor
        return self._db

    def _follow(self) -> None:
        """Let go of the file read where the writer writes another: a journal found damaged while edged
        ran goes aside and a new one starts at its path, and this feed read the old one on, so no
        verdict reached the broker again until edged restarted. The next read opens the new one."""
        writes = self._writes()
        if self._db is not None and writes is not None and writes[0] != self._file:
            self.close()

    def _recorded_before(self) -> int:
        """The row up to which the file read holds verdicts recorded before its writer wrote there: those
        carried to it from a file journal.path no longer named went out as if just made, and a
        subscriber could not tell them from live ones. Every row of a file the writer does not write (it
        has yet to look) is; none is known of where it writes none (a journal that records nothing)."""
        writes = self._writes()
        if writes is None:
            return 0
        return writes[1] if writes[0] == self._file else LAST_ROW

    def _started_anew(self) -> None:
        """The path names another file than the one read before: every verdict in it was recorded since
        (as they are, on this connection) and is this output's; what was handed out of the old one
        and not yet acknowledged (its client sends it again itself) no longer moves the cursor."""
        if self._anew_log.allows():
            log.warning("journal %s: the file read before is gone from there; %s sends the new one's", self.path, self.name)
        self._first_after, self._live_from = 0, 0
        self._stale = set(self._in_flight)
        self._in_flight.clear()
        self._acked.clear()

    @property
    def in_flight(self) -> int:
        """Verdicts handed out and not yet acknowledged."""
        return len(self._in_flight)

    def connected(self) -> None:
        """A connection came up: the verdicts the journal holds now and not yet handed out go out as
        replayed, those recorded from now on as they are. (What was handed out and not
        acknowledged, the client sends again itself.)"""
        self._live_from = self._attempt(_last_row, None)  # None where it cannot be read now: the next `take` reads it

    def connected_before(self) -> None:
        """The connection these verdicts go out on came up before this feed was made (a start whose
        connection beat the journal to the output, a reload that moved the journal): the verdicts
        recorded before the feed are replayed, those after it as they are."""
        self._live_from = self._made_after

    def take(self, limit: int) -> list[Forward]:
        """Up to ``limit`` verdicts after those handed out, oldest first."""
        if limit <= 0:
            return []
        self._follow()

        def read(db: sqlite3.Connection) -> tuple[int, list[tuple[int, str, str]]]:
            if self._live_from is None:
                self._live_from = _last_row(db)
            return self._live_from, db.execute(
                "SELECT id, camera_id, message FROM entries WHERE kind = 'verdict' AND id > ? ORDER BY id LIMIT ?",
                (self._sent, limit),
            ).fetchall()

        nothing: list[tuple[int, str, str]] = []
        live_from, rows = self._attempt(read, (0, nothing))
        live_from = max(live_from, self._recorded_before())  # after the read: the writer says so once they are in
        out = []
        for row_id, camera_id, message in rows:
            payload = mark_replayed(message) if row_id <= live_from else message.encode()
            out.append(Forward(row_id, camera_id, payload))
            self._in_flight.append(row_id)
            self._sent = row_id
        return out

    def give_back(self, row_id: int) -> None:
        """``row_id`` and the verdicts after it that were handed out were not sent after all: the
        next `take` hands them out again."""
        while self._in_flight and self._in_flight[-1] >= row_id:
            self._acked.discard(self._in_flight.pop())
        self._sent = self._in_flight[-1] if self._in_flight else self._cursor

    def acked(self, row_id: int) -> None:
        """The broker acknowledged ``row_id`` (or it needs no sending): the cursor moves over every
        verdict acknowledged without a gap."""
        if row_id in self._stale:  # the first acknowledgement of that row is the old file's: sent before
            self._stale.discard(row_id)
            return
        self._acked.add(row_id)
        while self._in_flight and self._in_flight[0] in self._acked:
            self._acked.discard(self._in_flight[0])
            self._cursor = self._in_flight.popleft()
        if self._cursor != self._saved and time.monotonic() - self._saved_at >= SAVE_EVERY_S:
            self._save()

    def _save(self) -> None:
        cursor = self._cursor
        self._attempt(lambda db: db.execute("UPDATE cursors SET row_id = ? WHERE name = ?", (cursor, self.name)), None)
        self._saved, self._saved_at = cursor, time.monotonic()

    def _attempt(self, action: Callable[[sqlite3.Connection], T], failed: T) -> T:
        """``action`` on the journal (``failed`` while it has no file); a failure (the journal being
        moved aside, a disk error) is counted, logged at most once a minute, and tried again at the
        next call."""
        try:
            db = self._connection()
            return failed if db is None else action(db)
        except sqlite3.Error as e:
            self._failed(e)
            self.close()
            return failed

    def _failed(self, e: sqlite3.Error) -> None:
        self.errors += 1
        if self._log.allows():
            log.error("journal %s: verdicts cannot be read for %s (%s); they wait in the journal", self.path, self.name, e)

    def close(self) -> None:
        """Write the cursor and let the file go."""
        if self._db is not None:
            if self._cursor != self._saved:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("UPDATE cursors SET row_id = ? WHERE name = ?", (self._cursor, self.name))
                    self._saved = self._cursor
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None
