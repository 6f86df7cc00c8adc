"""Store and forward: the journal's verdicts, in order, to an output that promises delivery (MQTT).

The output's own thread asks for the verdicts after those it has handed out (`VerdictFeed.take`)
and says which ones the broker acknowledged (`acked`); its client sends again, on the next
connection, those handed out and not yet acknowledged. Everything up to the cursor has been
acknowledged, and the cursor is kept in the journal, so an outage of the broker or the network
resumes where it stopped, and a restart of edged where the acknowledgements stopped. Delivery is
at least once: a verdict sent and not acknowledged before edged stopped goes again (a subscriber
that must count each once keys on ``board_id``, ``boot_id``, ``camera_id`` and ``seq``). A verdict committed before the
connection it goes out on carries ``replayed: true``. Memory stays flat whatever the outage: rows
are read a window at a time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from edged.lograte import LogRate

log = logging.getLogger(__name__)
T = TypeVar("T")

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


class VerdictFeed:
    """The journal's verdicts not yet acknowledged to one output (``name``); used by that output's thread only."""

    def __init__(self, path: Path, name: str, first_after: int) -> None:
        """``first_after``: when the journal has no cursor for ``name`` yet, the verdicts after this
        row are the first this output sends (those recorded before it existed stay unsent)."""
        self.path = path
        self.name = name
        self._first_after = first_after
        self._db: sqlite3.Connection | None = None
        self._cursor = 0  # every verdict up to this row is acknowledged
        self._sent = 0  # handed out up to this row
        self._in_flight: deque[int] = deque()  # rows handed out and not yet acknowledged, in order
        self._acked: set[int] = set()  # of those, acknowledged out of order
        self._live_from = 0  # rows above this were recorded while this connection was up
        self._saved = 0  # the cursor as last written
        self._saved_at = 0.0
        self.errors = 0
        self._log = LogRate(60.0)

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            db = sqlite3.connect(self.path, timeout=BUSY_WAIT_S, isolation_level=None, check_same_thread=False)
            try:
                db.execute(CURSORS)
                row = db.execute("SELECT row_id FROM cursors WHERE name = ?", (self.name,)).fetchone()
                if row is None:
                    db.execute("INSERT INTO cursors (name, row_id) VALUES (?, ?)", (self.name, self._first_after))
                    row = (self._first_after,)
            except BaseException:
                db.close()
                raise
            self._db = db
            self._cursor = self._sent = self._saved = int(row[0])
        return self._db

    def connected(self, live_from: int) -> None:
        """A connection is up since the journal's row ``live_from``: what was recorded up to it and is
        not yet handed out goes out as replayed. (What was handed out and not acknowledged, the
        client sends again itself.)"""
        self._live_from = live_from

    def take(self, limit: int) -> list[Forward]:
        """Up to ``limit`` verdicts after those handed out, oldest first."""
        if limit <= 0:
            return []
        rows: list[tuple[int, str, str]] = self._attempt(
            lambda db: db.execute(
                "SELECT id, camera_id, message FROM entries WHERE kind = 'verdict' AND id > ? ORDER BY id LIMIT ?",
                (self._sent, limit),
            ).fetchall(),
            [],
        )
        out = []
        for row_id, camera_id, message in rows:
            payload = mark_replayed(message) if row_id <= self._live_from else message.encode()
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
        """``action`` on the journal; a failure (the journal being moved aside, a disk error) is
        counted, logged at most once a minute, and tried again at the next call."""
        try:
            return action(self._connection())
        except sqlite3.Error as e:
            self.errors += 1
            if self._log.allows():
                log.error(
                    "journal %s: verdicts cannot be read for %s (%s); they wait in the journal", self.path, self.name, e
                )
            self.close()
            return failed

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
