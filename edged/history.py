"""``edged history``: what the journal says, by part id, camera, time and verdict.

It opens the journal read-only (SQLite's WAL mode lets it read while the daemon writes, and it
never writes or locks the daemon out), so it is safe beside a running edged, from another process.
"""

from __future__ import annotations

import contextlib
import csv
import json
import re
import sqlite3
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from edged.errors import JournalUnreadable, UsageError
from edged.journal import COLUMNS

_AGO = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
FIELDS = ("id", *COLUMNS)  # a row as `read` returns it


def parse_time(text: str, now_s: float | None = None) -> int:
    """``2h``, ``30m``, ``7d``, ``90s`` ago, or an ISO 8601 time (local time without a zone), as ns since the epoch."""
    ago = _AGO.match(text.strip())
    if ago:
        now = time.time() if now_s is None else now_s
        return _stored(int((now - float(ago.group(1)) * _UNIT_S[ago.group(2)]) * 1e9))
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
    return _stored(int(moment.timestamp() * 1e9))


def _stored(ns: int) -> int:
    """A time within what the journal stores (ns since 1970 in SQLite's 64-bit integer): before 1970
    finds the same entries as 1970, and a time past 2262 overflowed the query."""
    return min(max(ns, 0), 2**63 - 1)


@dataclass(frozen=True, slots=True)
class Query:
    """The filters; None passes everything. ``limit`` keeps the newest rows, returned oldest first."""

    part_id: str | None = None
    camera_id: str | None = None
    since_ns: int | None = None
    until_ns: int | None = None
    verdict: str | None = None
    kind: str = "verdict"
    limit: int = 100

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
        """The filters as a person gives them (times as `parse_time` reads them); raises UsageError."""
        if verdict not in (None, "ok", "ng", "uncertain"):
            raise UsageError(f"verdict {verdict!r}: ok, ng or uncertain")
        return cls(
            part_id=part_id,
            camera_id=camera_id,
            since_ns=parse_time(since) if since else None,
            until_ns=parse_time(until) if until else None,
            verdict=verdict,
            kind="detections" if detections else "verdict",
            limit=limit,
        )

    def sql(self) -> tuple[str, list[Any]]:
        where: list[str] = ["kind = ?"]
        params: list[Any] = [self.kind]
        for column, op, value in (
            ("part_id", "=", self.part_id),
            ("camera_id", "=", self.camera_id),
            ("wall_ns", ">=", self.since_ns),
            ("wall_ns", "<", self.until_ns),
            ("verdict", "=", self.verdict),
        ):
            if value is not None:
                where.append(f"{column} {op} ?")
                params.append(value)
        inner = f"SELECT {', '.join(FIELDS)} FROM entries WHERE {' AND '.join(where)} ORDER BY id DESC LIMIT ?"
        return f"SELECT * FROM ({inner}) ORDER BY id", [*params, self.limit]


def read(path: Path, query: Query) -> list[dict[str, Any]]:
    """The journal's rows that ``query`` selects, as dicts of `FIELDS`, oldest first."""
    if not path.is_file():
        raise JournalUnreadable(f"no journal at {path} (journal.path; it is written once a verdict is made)")
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
            sql, params = query.sql()
            return [dict(zip(FIELDS, row, strict=True)) for row in db.execute(sql, params)]
    except sqlite3.Error as e:
        raise JournalUnreadable(f"journal {path} cannot be read: {e}") from None


def _when(wall_ns: int) -> str:
    return datetime.fromtimestamp(wall_ns / 1e9, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _found(row: dict[str, Any]) -> str:
    """The reasons of an NG frame; without any, a classifier's best class (its message's ``top``),
    which an OK frame of a classifier would otherwise not show at all."""
    reasons = json.loads(row["reasons"]) if row["reasons"] else []
    if reasons:
        return ", ".join(
            f"{r.get('label')} {r.get('score', 0):.2f}" + (f" in {r['zone']}" if r.get("zone") else "") for r in reasons
        )
    top = json.loads(row["message"]).get("top") if row["message"] else None
    return f"{top[0].get('label')} {top[0].get('score', 0):.2f}" if top else ""


def records(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` for JSON: every column, the message parsed."""
    return [{**row, "message": json.loads(row["message"])} for row in rows]


def write(rows: Sequence[dict[str, Any]], fmt: str, out: TextIO) -> None:
    """``rows`` as a table for a person, JSON (one array, each message parsed) or CSV (every column)."""
    if fmt == "json":
        json.dump(records(rows), out, indent=1)
        out.write("\n")
    elif fmt == "csv":
        writer = csv.DictWriter(out, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    else:
        for row in rows:
            part = row["part_id"] or "-"
            out.write(
                f"{_when(row['wall_ns'])}  {row['camera_id']}  part {part}  frame {row['frame_id']}  "
                f"{row['verdict'] or '-'}  {_found(row)}  model {row['model_sha256'][:12]}"
                + (f"  evidence {row['evidence']}" if row["evidence"] else "")
                + "\n"
            )
        if not rows:
            out.write("no entries match\n")


def run_history(path: Path, query: Query, fmt: str) -> int:
    write(read(path, query), fmt, sys.stdout)
    return 0
