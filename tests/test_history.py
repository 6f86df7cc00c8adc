"""``edged history``: the journal's rows by part, camera, time and verdict, as a table, JSON or CSV."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from daemon import run_cli

from edged.errors import UsageError
from edged.history import Query, parse_time, read, write
from edged.identity import Identity
from edged.journal import Entry, JournalStore

IDENTITY = Identity("b0a4d1d000000000", "boot-1", "9.9.9")
T0 = 1_800_000_000 * 10**9


def _entry(n: int, camera: str, verdict: str, part: str | None) -> Entry:
    reasons = [{"detection": 0, "class_id": 1, "label": "crack", "score": 0.83, "zone": "left"}] if verdict == "ng" else []
    message = json.dumps({"kind": "verdict", "frame_id": n, "verdict": verdict}).encode()
    return Entry(
        "verdict", camera, n, n, part, verdict, json.dumps(reasons), T0 + n * 10**9, n, "ab" * 32, "cd" * 32, message
    )


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    entries = [_entry(n, "cam0" if n % 2 else "cam1", "ng" if n % 3 == 0 else "ok", f"P-{n}") for n in range(30)]
    store.append(entries, IDENTITY, True)
    store.close()
    return path


@pytest.mark.unit
def test_every_filter_narrows_and_the_limit_keeps_the_newest_oldest_first(journal: Path) -> None:
    def frames(**keys: object) -> list[int]:
        return [row["frame_id"] for row in read(journal, Query(**keys))]  # type: ignore[arg-type]

    assert frames() == list(range(30))
    assert frames(part_id="P-7") == [7]
    assert frames(camera_id="cam0", verdict="ng") == [3, 9, 15, 21, 27]
    assert frames(since_ns=T0 + 10 * 10**9, until_ns=T0 + 13 * 10**9) == [10, 11, 12]
    assert frames(limit=3) == [27, 28, 29]
    assert frames(kind="detections") == []
    assert frames(since_ns=parse_time("0001-01-01")) == list(range(30))
    assert frames(since_ns=parse_time("9999-12-31")) == []  # within SQLite's integers: no OverflowError


@pytest.mark.unit
def test_ages_and_iso_times_and_a_clear_refusal() -> None:
    assert parse_time("2h", now_s=10_000.0) == int((10_000 - 7200) * 1e9)
    assert parse_time("90s", now_s=100.0) == int(10 * 1e9)
    assert parse_time("2027-01-15T08:00:00+00:00") == T0
    assert parse_time("2027-01-15T09:00:00+01:00") == T0
    with pytest.raises(UsageError, match="not a time"):
        parse_time("yesterday")
    assert parse_time("0001-01-01") == parse_time("99999999d") == 0  # before 1970: all there is
    assert parse_time("9999-12-31T23:59") == 2**63 - 1  # past what SQLite's integers hold


@pytest.mark.unit
def test_a_table_for_a_person_json_and_csv_for_programs(journal: Path) -> None:
    rows = read(journal, Query(part_id="P-3"))
    table = io.StringIO()
    write(rows, "table", table)
    assert (
        table.getvalue() == "2027-01-15T08:00:03.000Z  cam0  part P-3  frame 3  ng  crack 0.83 in left  model abababababab\n"
    )
    as_json = io.StringIO()
    write(rows, "json", as_json)
    [got] = json.loads(as_json.getvalue())
    assert got["message"] == {"kind": "verdict", "frame_id": 3, "verdict": "ng"}
    assert (got["board_id"], got["boot_id"], got["clock_synced"], got["edged_version"]) == (
        "b0a4d1d000000000",
        "boot-1",
        1,
        "9.9.9",
    )
    as_csv = io.StringIO()
    write(read(journal, Query(verdict="ng")), "csv", as_csv)
    parsed = list(csv.DictReader(io.StringIO(as_csv.getvalue())))
    assert [r["part_id"] for r in parsed] == ["P-0", "P-3", "P-6", "P-9", "P-12", "P-15", "P-18", "P-21", "P-24", "P-27"]
    # A classifier's OK frame has no reason: its best class is said instead.
    top = {"kind": "detections", "top": [{"class_id": 0, "label": "good", "score": 0.91}]}
    classified = {**rows[0], "verdict": "ok", "reasons": "[]", "message": json.dumps(top).encode()}
    table = io.StringIO()
    write([classified], "table", table)
    assert "frame 3  ok  good 0.91  model" in table.getvalue()
    empty = io.StringIO()
    write([], "table", empty)
    assert empty.getvalue() == "no entries match\n"


@pytest.mark.integration
def test_the_command_reads_a_journal_and_says_when_there_is_none(journal: Path, tmp_path: Path) -> None:
    done = run_cli("history", "--journal", str(journal), "--camera", "cam1", "--verdict", "ng", "--json")
    assert done.returncode == 0, done.stderr
    assert [row["frame_id"] for row in json.loads(done.stdout)] == [0, 6, 12, 18, 24]
    missing = run_cli("history", "--journal", str(tmp_path / "none.sqlite"))
    assert missing.returncode == 1 and "no journal at" in missing.stderr
    bad = run_cli("history", "--journal", str(journal), "--since", "last tuesday")
    assert bad.returncode == 2 and "not a time" in bad.stderr
