"""``edged history``: what the journal says, by part id, camera, time and verdict.

It reads the journal without ever writing to it or locking the daemon out, so it is safe beside a
running edged, from another process, and as a user who may only read the file (`_open`). Rows are
written out as they are read, a page at a time: a whole journal costs no more memory than a page,
and no read keeps the daemon's checkpoints waiting while a slow pipe takes the output.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import sqlite3
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from edged.errors import JournalUnreadable, UsageError
from edged.files import sqlite_uri
from edged.identity import CLOCK_EPOCH_NS, boot_id
from edged.journal import COLUMNS, timed
from edged.messages import for_terminal

_AGO = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
FIELDS = ("id", *COLUMNS)  # a row as the journal holds it
REAL = "real_wall_ns"  # what `entries` adds to each: when it was recorded, as far as is known (`real_wall_ns`)
SHOWN = (*FIELDS, REAL)  # a row as `entries` gives it
STEP_NS = 10**9  # a row of this boot whose two clocks differ from now's by more was stamped before a step
MAX_INTEGER = 2**63 - 1  # SQLite's largest integer: the latest time and the largest limit a query takes
PAGE_ROWS = 100  # rows read per statement: the most a command holds in memory at once
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # what a spreadsheet takes a CSV cell to begin a formula with
DETECTIONS_SHOWN = 5  # a detections row's detections named, best first, as `edged check` names a frame's; the rest counted
# What a row edged cannot have written (the file edited by hand) raises when it is shown.
_UNREADABLE = (ValueError, TypeError, AttributeError, IndexError, KeyError, OverflowError)


def _page(have: set[str]) -> str:
    """The rows chosen, by id, a page at a time (the newest `limit` of those the query selects), each
    column the table ``have`` lacks as NULL: an earlier edged's journal, copied off a board or not yet
    opened by this version (which adds them, `edged.journal.JournalStore.open`), has rows without them."""
    columns = ", ".join(f"e.{name}" if name in have else "NULL" for name in FIELDS)
    return f"SELECT {columns} FROM chosen AS c JOIN entries AS e ON e.id = c.id WHERE c.id > ? ORDER BY c.id LIMIT ?"


def parse_time(text: str, now_s: float | None = None) -> int:
    """``2h``, ``30m``, ``7d``, ``90s`` ago, or an ISO 8601 time (local time without a zone), as ns since the epoch."""
    ago = _AGO.match(text.strip())
    if ago:
        now = time.time() if now_s is None else now_s
        return _stored((now - float(ago.group(1)) * _UNIT_S[ago.group(2)]) * 1e9)
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(
            f"{text!r} is not a time: give an ISO 8601 time (2026-12-01T08:00) or an age (30m, 2h, 7d)"
        ) from None
    if moment.tzinfo is None:
        try:
            moment = moment.astimezone()  # the local zone, as a person on the line means it
        except (ValueError, OverflowError):  # year 1 or 9999, moved out of range by the zone
            moment = moment.replace(tzinfo=timezone.utc)
    return _stored(moment.timestamp() * 1e9)


def _stored(ns: float) -> int:
    """A time within what the journal stores (ns since 1970 in SQLite's 64-bit integer): before 1970,
    an age past what a float holds included, finds the same entries as 1970, and a time past 2262
    overflowed the query."""
    return int(min(max(ns, 0), MAX_INTEGER))


@dataclass(frozen=True, slots=True)
class Query:
    """The filters; None passes everything. ``limit`` keeps the newest rows, returned oldest first.

    With ``now`` (this boot's id, and the monotonic and wall clocks read together), the rows of this
    boot are held to ``since_ns`` and ``until_ns`` on the monotonic clock: a board without a
    real-time clock whose wall clock was set right during the boot (NTP, months after a build date)
    stamped its earlier rows with the wrong date, and `--since 2h` left out the last two hours."""

    part_id: str | None = None
    camera_id: str | None = None
    since_ns: int | None = None
    until_ns: int | None = None
    verdict: str | None = None
    kind: str = "verdict"
    limit: int = 100
    now: tuple[str, int, int] | None = None

    @classmethod
    def parse(
        cls,
        *,
        part_id: str | None = None,
        camera_id: str | None = None,
        since: str | None = None,
        until: str | None = None,
        verdict: str | None = None,
        detections: bool = False,
        limit: int = 100,
    ) -> Query:
        """The filters as a person gives them (times as `parse_time` reads them, ages from the same
        moment); raises UsageError for what no query can take, and for a range that holds nothing."""
        if verdict not in (None, "ok", "ng", "uncertain"):
            raise UsageError(f"verdict {verdict!r}: ok, ng or uncertain")
        if not 1 <= limit <= MAX_INTEGER:
            raise UsageError(f"--limit {limit}: from 1 to {MAX_INTEGER}")
        for option, text in (("--part-id", part_id), ("--camera", camera_id)):
            try:
                (text or "").encode()
            except UnicodeEncodeError:  # bytes of another encoding in argv, which the journal's text never equals
                raise UsageError(f"{option} is not valid UTF-8") from None
        now = (boot_id(), time.monotonic_ns(), time.time_ns())
        now_s = now[2] / 1e9
        since_ns = parse_time(since, now_s) if since else None
        until_ns = parse_time(until, now_s) if until else None
        if since_ns is not None and until_ns is not None and since_ns > until_ns:
            raise UsageError(f"--since {since} is later than --until {until}: no entry can be between them")
        return cls(
            part_id=part_id,
            camera_id=camera_id,
            since_ns=since_ns,
            until_ns=until_ns,
            verdict=verdict,
            kind="detections" if detections else "verdict",
            limit=limit,
            now=now,
        )

    def where(self) -> tuple[str, list[Any]]:
        """The WHERE clause of the filters, and its parameters."""
        where: list[str] = ["kind = ?"]
        params: list[Any] = [self.kind]
        for column, op, value in (
            ("part_id", "=", self.part_id),
            ("camera_id", "=", self.camera_id),
            ("verdict", "=", self.verdict),
        ):
            if value is not None:
                where.append(f"{column} {op} ?")
                params.append(value)
        for op, wall_ns in ((">=", self.since_ns), ("<", self.until_ns)):
            if wall_ns is None:
                continue
            if self.now is None:
                where.append(f"wall_ns {op} ?")
                params.append(wall_ns)
            else:
                clause, bound = timed(op, wall_ns, *self.now)
                where.append(clause)
                params += bound
        return " AND ".join(where), params


def _open(path: Path) -> sqlite3.Connection:
    """The journal, read-only. With a ``-wal`` beside it (edged has it open, or was killed), through
    SQLite's shared memory as any reader; without one (edged stopped, its last close folded the WAL
    into the file), as immutable, which creates no ``-wal`` or ``-shm``: a user who may only read
    the folder cannot create them (SQLITE_READONLY_DIRECTORY), and root's would be left there
    owned by root, so that edged, started next, could not write its journal. Should edged start
    during such a read, the read may miss what it writes, or fail; the journal is never touched.
    SQLite keeps the ``-wal`` beside the file a symbolic link at journal.path names (a journal on a
    larger disk), not beside the link: it is looked for there, or the rows in it went unseen."""
    if path.exists() and not path.is_file():
        raise JournalUnreadable(f"journal.path {path} is not a file")
    if not path.is_file():
        raise JournalUnreadable(f"no journal at {path} (journal.path; it is written once a verdict is made)")
    mode = "mode=ro" if Path(f"{path.resolve()}-wal").exists() else "immutable=1"
    try:
        db = sqlite3.connect(sqlite_uri(path, mode), uri=True, timeout=10, isolation_level=None)
    except sqlite3.Error as e:
        raise JournalUnreadable(f"journal {path} cannot be read: {e}") from None
    return db


def entries(path: Path, query: Query) -> Iterator[dict[str, Any]]:
    """The rows ``query`` selects, as dicts of `SHOWN` (the columns, and `real_wall_ns`), oldest
    first. The ids of the newest ``limit`` are chosen in one statement (those there then), into
    SQLite's temporary store, which spills to a file; their rows are read a page at a time, each
    page a read of its own (autocommit), so that a reader that stops holds no snapshot the daemon's
    checkpoints wait on."""
    where, params = query.where()
    with contextlib.closing(_open(path)) as db:
        try:
            have = {str(row[1]) for row in db.execute("PRAGMA table_info(entries)")}
            if not have:
                raise JournalUnreadable(f"journal {path} cannot be read: it has no entries (not a journal edged wrote)")
            page = _page(have)
            db.execute("CREATE TEMP TABLE chosen (id INTEGER PRIMARY KEY)")
            db.execute(
                f"INSERT INTO chosen SELECT id FROM entries WHERE {where} ORDER BY id DESC LIMIT ?", [*params, query.limit]
            )
            last = 0
            while rows := db.execute(page, (last, PAGE_ROWS)).fetchall():
                for row in rows:
                    item = dict(zip(FIELDS, row, strict=True))
                    item[REAL] = real_wall_ns(item, query.now)
                    yield item
                last = rows[-1][0]
        except sqlite3.Error as e:
            raise JournalUnreadable(f"journal {path} cannot be read: {e}") from None


def real_wall_ns(row: dict[str, Any], now: tuple[str, int, int] | None) -> int | None:
    """When ``row`` was recorded, as far as is known. A row of the running boot (``now``: its id, and
    its monotonic and wall clocks read together) whose wall clock has been stepped since it was
    stamped (NTP setting right a board without a real-time clock) was recorded when its monotonic
    stamp says; any other row when it is stamped. None where that is before `CLOCK_EPOCH_NS`: a
    clock not yet set, and not set since in the boot that stamped it."""
    wall, mono = row.get("wall_ns"), row.get("mono_ns")
    if not isinstance(wall, int):
        return None
    if now is not None and row.get("boot_id") == now[0] and isinstance(mono, int):
        real = now[2] - (now[1] - mono)
        wall = real if abs(real - wall) > STEP_NS else wall
    return wall if wall >= CLOCK_EPOCH_NS else None


def _when(wall_ns: int) -> str:
    return datetime.fromtimestamp(wall_ns / 1e9, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _recorded(row: dict[str, Any]) -> str:
    """A row's time for a person: when it was recorded (`real_wall_ns`), and the time it carries where
    that differs, so that it is found beside the messages sent with it."""
    stamped = row["wall_ns"]
    real = row[REAL] if REAL in row else real_wall_ns(row, None)
    if real is None:
        return f"{_when(stamped)} (clock not set)"
    return _when(stamped) if real == stamped else f"{_when(real)} (stamped {_when(stamped)} before the clock was set)"


def _parsed(row: dict[str, Any], column: str) -> Any:
    """``column``'s JSON, None for NULL; ValueError naming the column where it is not JSON. Python
    reads ``NaN`` and ``Infinity``, which edged never writes and JSON has not: written back by
    ``--json``, a row edited by hand to hold one made output no other JSON reader takes."""
    try:
        return None if row[column] is None else json.loads(row[column], parse_constant=_no_constant)
    except (ValueError, TypeError):
        raise ValueError(f"its {column} is not JSON") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _found(row: dict[str, Any], message: dict[str, Any] | None) -> str:
    """The reasons of an NG frame; without any, a classifier's best class (its ``message``'s ``top``),
    which an OK frame of a classifier would otherwise not show at all."""
    reasons = _parsed(row, "reasons")
    if reasons:
        return ", ".join(
            f"{r.get('label')} {r.get('score', 0):.2f}" + (f" in {r['zone']}" if r.get("zone") else "") for r in reasons
        )
    top = message.get("top") if message else None
    return f"{top[0].get('label')} {top[0].get('score', 0):.2f}" if top else ""


def _named(found: list[dict[str, Any]]) -> str:
    """Detections or classes, best first: the first `DETECTIONS_SHOWN` by label, score and zone, the rest counted."""
    best = sorted(found, key=lambda item: -float(item["score"]))
    named = ", ".join(
        f"{item['label']} {item['score']:.2f}" + (f" in {item['zone']}" if item.get("zone") else "")
        for item in best[:DETECTIONS_SHOWN]
    )
    return named + (f", and {len(best) - DETECTIONS_SHOWN} more" if len(best) > DETECTIONS_SHOWN else "")


def _detected(row: dict[str, Any], message: dict[str, Any]) -> tuple[str, str]:
    """A detections row's two middle columns. Such a row is no verdict, and a "-" there would say
    nothing, so the first says what the frame held in its model's terms, worded as `edged subscribe`
    words them (how many detections, a classifier's top classes, an anomaly model's score), after
    the frame's verdict where ``[inspect]`` gave one; the second names what was found, as a verdict
    row names its reasons."""
    if message.get("top") is not None:
        held, found = "top", _named(message["top"])
    elif message.get("anomaly_score") is not None:
        threshold = message.get("threshold")
        held = f"anomaly score {message['anomaly_score']:.2f}" + (
            f" (threshold {threshold:.2f})" if threshold is not None else ""
        )
        found = f"{len(message.get('regions') or [])} region(s)"
    else:
        held, found = f"{len(message['detections'])} detection(s)", _named(message["detections"])
    return (f"{row['verdict']}, {held}" if row["verdict"] else held), found


def _line(row: dict[str, Any]) -> str:
    """``row`` in the table, with the image a frame was read from; raises one of `_UNREADABLE` for a
    row edged cannot have written."""
    message = _parsed(row, "message")
    image = f" {message['source_file']}" if message and message.get("source_file") else ""
    if row["kind"] == "detections":
        said, found = _detected(row, message)
    else:
        said, found = row["verdict"] or "-", _found(row, message)
    return (
        f"{_recorded(row)}  {row['camera_id']}  part {row['part_id'] or '-'}  frame {row['frame_id']}{image}  "
        f"{said}  {found}  model {row['model_sha256'][:12]}" + (f"  evidence {row['evidence']}" if row["evidence"] else "")
    )


def record(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` for JSON: every column and `REAL`, the message parsed; a message that is not JSON
    (the file edited by hand) is null, and ``unreadable`` says so."""
    try:
        return {**row, "message": _parsed(row, "message")}
    except ValueError as e:
        return {**row, "message": None, "unreadable": str(e)}


def _cell(value: object) -> object:
    """A CSV cell: text a spreadsheet would run as a formula (a part id sent as ``=HYPERLINK(...)`` by
    whoever may send a request) starts with a quote, as OWASP advises for CSV opened in one."""
    return f"'{value}" if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value


def write(rows: Iterable[dict[str, Any]], fmt: str, out: TextIO) -> int:
    """``rows`` as a table for a person, JSON (one array, each message parsed) or CSV (every
    column, then `REAL`), each written as it comes; returns how many were shown as unreadable."""
    if fmt == "csv":
        writer = csv.writer(out)
        writer.writerow(SHOWN)
        writer.writerows([_cell(row.get(name)) for name in SHOWN] for row in rows)
        return 0
    shown = unreadable = 0
    for row in rows:
        if fmt == "json":
            item = record(row)
            bad = "unreadable" in item
            text = json.dumps(item, indent=1, default=str).replace("\n", "\n ")  # as one json.dump of the list
            out.write(("[\n " if shown == 0 else ",\n ") + text)
        else:
            try:
                text, bad = _line(row), False
            except _UNREADABLE as e:
                text, bad = f"entry {row['id']}  unreadable: {e}", True
            out.write(for_terminal(text) + "\n")  # a file name's line feed would forge a row
        shown += 1
        unreadable += bad
    if fmt == "json":
        out.write("\n]\n" if shown else "[]\n")
    elif not shown:
        out.write("no entries match\n")
    return unreadable


def run_history(path: Path, query: Query, fmt: str, *, journal_off: bool = False, records_nothing: bool = False) -> int:
    """Print what ``query`` selects; ``journal_off``: the configuration has ``[journal] enabled =
    false``, ``records_nothing``: it gives the journal nothing to record, each said rather than that
    the journal is yet to be written."""
    if journal_off and not path.is_file():
        raise JournalUnreadable(f"the journal is off in this configuration ([journal] enabled = false): none at {path}")
    if records_nothing and not path.is_file():
        raise JournalUnreadable(
            f"no journal at {path}: this configuration gives it nothing to record (verdicts come from a camera "
            "with [inspect] or in request mode; journal.detections = true records every detections message)"
        )
    if isinstance(sys.stdout, io.TextIOWrapper):  # a locale that is not UTF-8 (ASCII, Latin-1): escape what it lacks
        sys.stdout.reconfigure(errors="backslashreplace")
    unreadable = write(entries(path, query), fmt, sys.stdout)  # `edged history | head`: `edged.cli.main` ends it
    sys.stdout.flush()
    if unreadable:
        print(
            f"edged history: {unreadable} {'entry is' if unreadable == 1 else 'entries are'} not as edged writes "
            "them (the journal edited by hand?): shown as unreadable",
            file=sys.stderr,
        )
    return 0
