"""``edged history``: the journal's rows by part, camera, time and verdict, as a table, JSON or CSV."""

from __future__ import annotations

import codecs
import csv
import io
import json
import os
import pwd
import sqlite3
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from daemon import edged_command, run_cli, write_config
from onnx_models import colour_probe

from edged.errors import JournalUnreadable, UsageError
from edged.history import Query, entries, parse_time, run_history, write
from edged.identity import Identity
from edged.journal import Entry, JournalStore
from edged.messages import Detection, DetectionsMessage, ModelInfo, Timings, TopClass

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
        return [row["frame_id"] for row in entries(journal, Query(**keys))]  # type: ignore[arg-type]

    assert frames() == list(range(30))
    assert frames(part_id="P-7") == [7]
    assert frames(camera_id="cam0", verdict="ng") == [3, 9, 15, 21, 27]
    assert frames(since_ns=T0 + 10 * 10**9, until_ns=T0 + 13 * 10**9) == [10, 11, 12]
    assert frames(limit=3) == [27, 28, 29]
    assert frames(kind="detections") == []
    assert frames(since_ns=parse_time("0001-01-01")) == list(range(30))
    assert frames(since_ns=parse_time("9999-12-31")) == []  # within SQLite's integers: no OverflowError


@pytest.mark.unit
def test_this_boots_rows_are_timed_on_its_monotonic_clock_whatever_the_wall_clock_said(tmp_path: Path) -> None:
    """A board without a real-time clock ran 200 days behind until NTP set it: the rows it recorded
    ten minutes ago carry a date 200 days old, and `--since 2h` left them out. This boot's rows are
    held to the query on the monotonic clock; an earlier boot's, on the wall clock they have. This
    boot is taken as an hour older than the machine's (its monotonic clock read an hour on): a
    machine up less than ten minutes cannot have a row of ten minutes ago."""
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    behind_ns = time.time_ns() - 200 * 86_400 * 10**9
    older_ns = 3600 * 10**9
    now_mono = time.monotonic_ns() + older_ns

    def row(n: int, mono_ns: int) -> Entry:
        return replace(_entry(n, "cam0", "ok", f"P-{n}"), wall_ns=behind_ns + n * 10**9, mono_ns=mono_ns)

    store.append([row(0, 10**9), row(1, 2 * 10**9)], Identity("b0a4d1d000000000", "an-earlier-boot", "9.9.9"), True)
    store.append([row(2, now_mono - 600 * 10**9), row(3, now_mono - 300 * 10**9)], Identity.here(), True)
    store.close()

    def frames(**keys: str) -> list[int]:
        query = Query.parse(**keys)
        assert query.now is not None
        boot, mono, wall = query.now
        return [row["frame_id"] for row in entries(path, replace(query, now=(boot, mono + older_ns, wall)))]

    assert frames(since="2h") == [2, 3]
    assert frames(since="7m") == [3]
    assert frames(until="2h") == [0, 1]
    assert frames(since="300d", until="8m") == [0, 1, 2]
    assert frames(since="0001-01-01", until="9999-12-31") == [0, 1, 2, 3]  # ends of time: no overflow


@pytest.mark.unit
def test_this_boots_rows_stamped_before_a_step_show_when_they_were_recorded_and_a_clock_not_set_says_so(
    tmp_path: Path,
) -> None:
    """NTP set this boot's clock 200 days forward ten minutes ago: the rows recorded before carry a
    date 200 days old, and the table showed it (before: as if recorded in June). Each is shown when
    its monotonic stamp says it was recorded, the date it carries beside it (the messages sent with
    it carry that one); JSON and CSV give it as ``real_wall_ns``. An earlier boot's row stamped on a
    clock not yet set (1970) says so, its ``real_wall_ns`` null; other rows show the time they carry."""
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    now = (IDENTITY.boot_id, 10_000 * 10**9, T0 + 1000 * 10**9)  # this boot's id, its two clocks read together
    day_ns = 86_400 * 10**9

    def row(n: int, wall_ns: int, mono_ns: int) -> Entry:
        return replace(_entry(n, "cam0", "ok", f"P-{n}"), wall_ns=wall_ns, mono_ns=mono_ns)

    earlier = Identity(IDENTITY.board_id, "an-earlier-boot", IDENTITY.version)
    store.append([row(0, 3600 * 10**9 + 5 * 10**9, 5 * 10**9), row(1, T0 - 3 * day_ns, 9 * 10**9)], earlier, False)
    before_step = row(2, T0 + 400 * 10**9 - 200 * day_ns, 9_400 * 10**9)  # ten minutes ago, on the clock behind
    store.append([before_step, row(3, T0 + 700 * 10**9, 9_700 * 10**9)], IDENTITY, True)
    store.close()
    rows = list(entries(path, Query(now=now)))
    table = io.StringIO()
    write(rows, "table", table)
    assert [line.split("  cam0")[0] for line in table.getvalue().splitlines()] == [
        "1970-01-01T01:00:05.000Z (clock not set)",
        "2027-01-12T08:00:00.000Z",
        "2027-01-15T08:06:40.000Z (stamped 2026-06-29T08:06:40.000Z before the clock was set)",
        "2027-01-15T08:11:40.000Z",
    ]
    as_json = io.StringIO()
    write(rows, "json", as_json)
    got = [(r["wall_ns"], r["real_wall_ns"]) for r in json.loads(as_json.getvalue())]
    assert got == [
        (3605 * 10**9, None),
        (T0 - 3 * day_ns,) * 2,
        (before_step.wall_ns, T0 + 400 * 10**9),
        (T0 + 700 * 10**9,) * 2,
    ]
    as_csv = io.StringIO()
    write(rows, "csv", as_csv)
    in_csv = [r["real_wall_ns"] for r in csv.DictReader(io.StringIO(as_csv.getvalue()))]
    assert in_csv == ["" if real is None else str(real) for _, real in got]


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
    rows = list(entries(journal, Query(part_id="P-3")))
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
    write(entries(journal, Query(verdict="ng")), "csv", as_csv)
    parsed = list(csv.DictReader(io.StringIO(as_csv.getvalue())))
    assert [r["part_id"] for r in parsed] == ["P-0", "P-3", "P-6", "P-9", "P-12", "P-15", "P-18", "P-21", "P-24", "P-27"]
    # A part id a spreadsheet would run: whoever may send a request chooses it.
    formulas = ['=HYPERLINK("http://x","y")', "+1", "-1", "@SUM(A1)", "\tx"]
    as_csv = io.StringIO()
    write([{**rows[0], "part_id": part} for part in formulas], "csv", as_csv)
    parsed = list(csv.DictReader(io.StringIO(as_csv.getvalue())))
    assert [r["part_id"] for r in parsed] == [f"'{part}" for part in formulas]
    assert [r["frame_id"] for r in parsed] == ["3"] * len(formulas)
    # A classifier's OK frame has no reason: its best class is said instead.
    top = {"kind": "detections", "top": [{"class_id": 0, "label": "good", "score": 0.91}]}
    classified = {**rows[0], "verdict": "ok", "reasons": "[]", "message": json.dumps(top).encode()}
    table = io.StringIO()
    write([classified], "table", table)
    assert "frame 3  ok  good 0.91  model" in table.getvalue()
    # From an image folder: which image it was.
    from_file = {**rows[0], "message": json.dumps({"kind": "verdict", "source_file": "part 03.png"}).encode()}
    table = io.StringIO()
    write([from_file], "table", table)
    assert "  frame 3 part 03.png  ng  crack 0.83 in left  model" in table.getvalue()
    empty = io.StringIO()
    write([], "table", empty)
    assert empty.getvalue() == "no entries match\n"


CLASSES = ["scratch", "spot", "crack"]


def _detections(n: int, verdict: str | None = None, **found: Any) -> Entry:
    """The detections entry of frame ``n`` as the daemon journals it (``journal.detections = true``):
    its message a real detections message holding ``found`` (detections, top, anomaly fields)."""
    message = DetectionsMessage(
        camera_id="cam0",
        seq=n,
        frame_id=n,
        capture_time_ns=T0 + n * 10**9,
        frame_size=(1280, 720),
        input_size=(320, 320),
        model=ModelInfo(name="demo", sha256="ab" * 32, provider="CPUExecutionProvider"),
        timings=Timings(preprocess_ms=1.0, inference_ms=10.0, decode_ms=1.0, age_ms=15.0),
        thermal_state="ok",
        verdict=verdict,
        detections=found.pop("detections", []),
        **found,
    )
    return Entry(
        "detections",
        "cam0",
        n,
        n,
        None,
        verdict,
        None,
        T0 + n * 10**9,
        n,
        "ab" * 32,
        "cd" * 32,
        message.model_dump_json().encode(),
    )


def _detection(label: str, score: float, zone: str | None = None) -> Detection:
    return Detection(class_id=CLASSES.index(label), label=label, score=score, box=(10, 10, 50, 50), zone=zone)


@pytest.mark.integration
def test_a_detections_row_says_what_the_frame_held_where_a_verdict_row_has_its_verdict(tmp_path: Path) -> None:
    """`--detections` showed "-" where a verdict row has its verdict, and nothing after it: a row
    said neither how many detections its frame had nor which."""
    journal = tmp_path / "journal.sqlite"
    store = JournalStore(journal, "normal")
    many = [_detection(CLASSES[i % 3], 0.3 + i / 20) for i in range(7)]
    store.append(
        [
            _detections(1, detections=[_detection("spot", 0.54), _detection("crack", 0.79), _detection("scratch", 0.53)]),
            _detections(2, "ng", detections=[_detection("crack", 0.83, "left")]),
            _detections(3, detections=many),
            _detections(4, "ok", detections=[]),
            _detections(
                5, top=[TopClass(class_id=0, label="good", score=0.91), TopClass(class_id=1, label="bad", score=0.09)]
            ),
            _detections(6, anomaly_score=0.62, anomalous=True, threshold=0.5, regions=[]),
        ],
        IDENTITY,
        True,
    )
    store.close()
    table = run_cli("history", "--journal", str(journal), "--detections")
    assert table.returncode == 0, table.stderr
    found = [line.split("  ")[4:6] for line in table.stdout.splitlines()]
    assert found == [
        ["3 detection(s)", "crack 0.79, spot 0.54, scratch 0.53"],  # best first
        ["ng, 1 detection(s)", "crack 0.83 in left"],  # with [inspect], the frame's verdict first
        ["7 detection(s)", "scratch 0.60, crack 0.55, spot 0.50, scratch 0.45, crack 0.40, and 2 more"],
        ["ok, 0 detection(s)", ""],  # a requested frame with nothing on it
        ["top", "good 0.91, bad 0.09"],  # a classifier's, as `edged subscribe` words it
        ["anomaly score 0.62 (threshold 0.50)", "0 region(s)"],
    ], table.stdout
    assert table.stdout.splitlines()[0] == (
        "2027-01-15T08:00:01.000Z  cam0  part -  frame 1  3 detection(s)  crack 0.79, spot 0.54, scratch 0.53  "
        "model abababababab"
    )
    as_json = run_cli("history", "--journal", str(journal), "--detections", "--json")
    assert as_json.returncode == 0, as_json.stderr
    rows = json.loads(as_json.stdout)  # the journal's columns as they are: the message holds the detections
    assert [(row["kind"], row["verdict"], row["reasons"]) for row in rows[:2]] == [
        ("detections", None, None),
        ("detections", "ng", None),
    ]
    assert [d["label"] for d in rows[0]["message"]["detections"]] == ["spot", "crack", "scratch"]


@pytest.mark.integration
def test_the_command_reads_a_journal_and_says_when_there_is_none(journal: Path, tmp_path: Path) -> None:
    done = run_cli("history", "--journal", str(journal), "--camera", "cam1", "--verdict", "ng", "--json")
    assert done.returncode == 0, done.stderr
    assert [row["frame_id"] for row in json.loads(done.stdout)] == [0, 6, 12, 18, 24]
    missing = run_cli("history", "--journal", str(tmp_path / "none.sqlite"))
    assert missing.returncode == 1 and "no journal at" in missing.stderr
    bad = run_cli("history", "--journal", str(journal), "--since", "last tuesday")
    assert bad.returncode == 2 and "not a time" in bad.stderr


def _busy_journal(path: Path, rows: int) -> Path:
    """A journal of ``rows`` verdicts whose messages carry 3 KB of detections, as a busy line's do."""
    detections = [{"class_id": 1, "label": "crack", "score": 0.5, "box": [i, i, i + 10, i + 10]} for i in range(40)]
    message = json.dumps({"kind": "verdict", "detections": detections}).encode()
    store = JournalStore(path, "normal")
    for first in range(0, rows, 5000):
        batch = range(first, min(first + 5000, rows))
        store.append(
            [Entry("verdict", "cam0", n, n, f"P-{n}", "ng", "[]", T0 + n, n, "ab" * 32, "cd" * 32, message) for n in batch],
            IDENTITY,
            True,
        )
    store.close()
    return path


def _edit(journal: Path, sql: str) -> None:
    """The journal edited by hand, as with the sqlite3 shell."""
    with sqlite3.connect(journal) as db:
        db.execute(sql)
    db.close()


@pytest.mark.unit
def test_an_earlier_edgeds_journal_is_read_with_the_columns_added_since_empty(journal: Path) -> None:
    """A journal an earlier edged wrote, copied off its board or not yet opened by this version (which
    adds the columns added since): every row, those columns empty (before: "no such column:
    e.evidence", exit 1, for every query); a file without the table says it is no journal of edged's."""
    _edit(journal, "ALTER TABLE entries DROP COLUMN evidence")
    _edit(journal, "ALTER TABLE entries DROP COLUMN clock_synced")
    found = list(entries(journal, Query(limit=100)))
    assert [row["frame_id"] for row in found] == list(range(30))
    assert {(row["evidence"], row["clock_synced"]) for row in found} == {(None, None)}
    out = io.StringIO()
    assert write(found, "table", out) == 0 and "P-29" in out.getvalue()
    empty = journal.with_name("empty.sqlite")
    empty.touch()  # a file SQLite reads as an empty database
    with pytest.raises(JournalUnreadable, match="has no entries"):
        list(entries(empty, Query()))


@pytest.mark.unit
def test_a_journal_path_that_is_a_symbolic_link_is_read_with_its_write_ahead_log(tmp_path: Path) -> None:
    """journal.path a link to a journal on a larger disk: SQLite keeps the ``-wal`` beside the file the
    link names, and looked for beside the link it was never found while edged wrote, so the file was
    read without it (before: "no such table: entries", or the last minutes' rows missing). A FIFO or
    a folder there is said not to be a file (before: "no journal at")."""
    (tmp_path / "disk").mkdir()
    link = tmp_path / "journal.sqlite"
    link.symlink_to(tmp_path / "disk" / "journal.sqlite")
    store = JournalStore(link, "normal")  # edged writing: its rows in the -wal yet
    store.append([_entry(n, "cam0", "ok", f"P-{n}") for n in range(5)], IDENTITY, True)
    try:
        assert [row["frame_id"] for row in entries(link, Query())] == list(range(5))
    finally:
        store.close()
    fifo = tmp_path / "fifo.sqlite"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path / "disk"):
        with pytest.raises(JournalUnreadable, match="is not a file"):
            list(entries(path, Query()))


@pytest.mark.integration
def test_what_no_query_can_take_is_a_usage_error_and_an_endless_age_is_all_there_is(journal: Path) -> None:
    """Each exited 1 with a traceback (OverflowError, UnicodeEncodeError); a reversed range said "no entries match"."""
    cases = {
        ("--limit", str(2**63)): "--limit 9223372036854775808: from 1 to 9223372036854775807",
        ("--part-id", "\udcff"): "--part-id is not valid UTF-8",  # the byte 0xff in argv
        ("--camera", "a\udcedb"): "--camera is not valid UTF-8",
        ("--since", "5d", "--until", "10d"): "--since 5d is later than --until 10d",
    }
    for args, said in cases.items():
        done = run_cli("history", "--journal", str(journal), *args)
        assert (done.returncode, "Traceback" in done.stderr) == (2, False), done.stderr
        assert said in done.stderr
    endless = "9" * 400 + "d"  # past what a float holds: as 99999999d, before 1970, so every entry
    since = run_cli("history", "--journal", str(journal), "--since", endless, "--json")
    assert since.returncode == 0, since.stderr
    assert len(json.loads(since.stdout)) == 30
    until = run_cli("history", "--journal", str(journal), "--until", endless)
    assert (until.returncode, until.stdout) == (0, "no entries match\n"), until.stderr


@pytest.mark.integration
def test_a_row_edited_by_hand_is_shown_unreadable_and_counted_the_rest_as_ever(journal: Path) -> None:
    """A row whose reasons or message is not JSON, or a column of the wrong type, stopped the command with a traceback;
    one holding NaN was written back as NaN by --json, which no other JSON reader takes."""
    _edit(journal, """UPDATE entries SET reasons = '[{"label": "crack"' WHERE frame_id = 3""")
    _edit(journal, "UPDATE entries SET message = 'not json' WHERE frame_id = 4")
    _edit(journal, "UPDATE entries SET part_id = x'ff' WHERE frame_id = 5")  # a BLOB: JSON has no bytes
    _edit(journal, "UPDATE entries SET wall_ns = 'noon' WHERE frame_id = 7")
    _edit(journal, """UPDATE entries SET message = '{"kind": "verdict", "score": NaN}' WHERE frame_id = 9""")
    table = run_cli("history", "--journal", str(journal))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert len(lines) == 30
    assert lines[3] == "entry 4  unreadable: its reasons is not JSON"
    assert lines[4] == "entry 5  unreadable: its message is not JSON"
    assert lines[7].startswith("entry 8  unreadable: ")
    assert lines[6].startswith("2027-01-15T08:00:06.000Z  cam1  part P-6  frame 6  ng  crack 0.83 in left  model ")
    assert lines[9] == "entry 10  unreadable: its message is not JSON"  # NaN, which Python reads and JSON has not
    assert "4 entries are not as edged writes them" in table.stderr
    as_json = run_cli("history", "--journal", str(journal), "--json")
    assert as_json.returncode == 0, as_json.stderr
    rows = json.loads(as_json.stdout, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert [row["frame_id"] for row in rows] == list(range(30))
    assert (rows[4]["message"], rows[4]["unreadable"]) == (None, "its message is not JSON")
    assert (rows[9]["message"], rows[9]["unreadable"]) == (None, "its message is not JSON")
    assert rows[5]["part_id"] == "b'\\xff'" and rows[5]["message"]["frame_id"] == 5
    assert "edged history: 2 entries are not as edged writes them" in as_json.stderr
    as_csv = run_cli("history", "--journal", str(journal), "--csv")
    assert as_csv.returncode == 0, as_csv.stderr
    assert list(csv.DictReader(io.StringIO(as_csv.stdout)))[4]["message"] == "not json"  # as it is in the file


@pytest.mark.integration
def test_names_from_outside_print_one_line_each_escaped_in_any_locale(journal: Path) -> None:
    """An image's file name with a line feed printed a forged row, a class label's escape and
    right-to-left mark reached the terminal as they were, and a label outside ASCII stopped the command
    with a UnicodeEncodeError where the locale is not UTF-8."""
    forged = "b2\n2027-01-15T08:00:09.000Z  cam0  part P-9  frame 9  ok    model abababababab"
    label = "\u50b7\x1b[31mred\u202eabc"
    reasons = json.dumps([{"detection": 0, "class_id": 0, "label": label, "score": 0.83, "zone": None}])
    message = json.dumps({"kind": "verdict", "source_file": forged})
    _edit(journal, f"UPDATE entries SET reasons = '{reasons}', message = '{message}' WHERE frame_id = 3")
    table = run_cli("history", "--journal", str(journal), "--part-id", "P-3")
    assert table.returncode == 0, table.stderr
    assert table.stdout == (
        "2027-01-15T08:00:03.000Z  cam0  part P-3  frame 3 b2\\n2027-01-15T08:00:09.000Z  cam0  part P-9  frame 9  ok"
        "    model abababababab  ng  \u50b7\\x1b[31mred\\u202eabc 0.83  model abababababab\n"
    )
    ascii_locale = {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    for fmt in ([], ["--csv"], ["--json"]):  # the table, then CSV, then JSON
        done = run_cli("history", "--journal", str(journal), "--part-id", "P-3", *fmt, env=ascii_locale)
        assert done.returncode == 0 and not done.stderr, done.stderr
        assert "\\u50b7" in done.stdout


class _Discard(io.TextIOBase):
    def write(self, text: str) -> int:
        return len(text)


@pytest.mark.unit
def test_rows_are_written_as_they_are_read_in_every_format(tmp_path: Path) -> None:
    """All rows were read into a list (and for JSON parsed into another) before the first was written:
    `--limit 100000000` of a 128 MB journal took 745 MB."""
    journal = _busy_journal(tmp_path / "journal.sqlite", 1000)  # 3 MB of messages
    for fmt in ("json", "csv", "table"):
        tracemalloc.start()
        try:
            write(entries(journal, Query(limit=2**63 - 1)), fmt, _Discard())
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2_000_000, (fmt, peak)  # a page of rows, whatever the journal holds


# `edged ARGS`, then its address space's peak RSS on stderr ("VmHWM: N kB").
OWN_PEAK = """
import sys
from edged.cli import main
try:
    code = main(sys.argv[1:])
finally:
    print(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")), file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.integration
def test_the_command_takes_as_little_memory_for_a_large_journal_as_for_a_small_one(tmp_path: Path) -> None:
    def peak_rss_mb(journal: Path) -> float:
        """The command's peak RSS, its output thrown away: its own address space's high-water mark
        (VmHWM), which its exec started afresh. wait4's figure is at least this test's own RSS as it
        started the command (the kernel keeps the larger of the two across the exec), and this test
        holds the large journal's rows as it starts the command for it."""
        argv = ["history", "--journal", str(journal), "--limit", "100000000", "--json"]
        done = subprocess.run(
            [sys.executable, "-c", OWN_PEAK, *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return int(done.stderr.split()[-2]) / 1024

    small = peak_rss_mb(_busy_journal(tmp_path / "small.sqlite", 100))
    large = peak_rss_mb(_busy_journal(tmp_path / "large.sqlite", 10_000))  # 30 MB of messages: 180 MB more before
    assert large - small < 15, (small, large)


@pytest.mark.integration
def test_a_reader_that_stops_early_ends_it_quietly(tmp_path: Path) -> None:
    """`edged history | head`: a BrokenPipeError traceback, now that rows are written as they are read."""
    journal = _busy_journal(tmp_path / "journal.sqlite", 2000)  # 6 MB of JSON: far more than a pipe holds
    proc = subprocess.Popen(
        edged_command("history", "--journal", str(journal), "--limit", "5000", "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline() == "[\n"
    proc.stdout.close()
    err = proc.stderr.read()
    proc.stderr.close()
    assert (proc.wait(60), err) == (0, "")


@pytest.fixture
def readable_only() -> Iterator[Path]:
    """A folder as the .deb's UMask=0027 leaves /var/lib/edged to a member of the service's group
    (here nogroup, with nobody as the member): the group may read and enter it, not write to it."""
    folder = Path(tempfile.mkdtemp(prefix="edged-history-", dir="/tmp"))  # outside pytest's root-only folders
    try:
        yield folder
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=True)


def _history_as_nobody(*args: str) -> tuple[int, str, str]:
    """edged's CLI (`edged.cli.main`) in a forked child that gave up root for nobody:nogroup and no
    other group: its exit status, stdout and stderr. What the command imports is imported first: the
    interpreter's library may lie where nobody cannot read (under /root), so the child imports nothing."""
    import edged.history  # noqa: F401  # and with it sqlite3
    from edged.cli import main

    codecs.lookup("ascii")  # the board identity's files are read as ASCII

    nobody = pwd.getpwnam("nobody")
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: it never returns into pytest
        code = 70
        try:
            os.close(out_r)
            os.close(err_r)
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            sys.stdout, sys.stderr = open(out_w, "w"), open(err_w, "w")
            code = main(["history", *args])
            sys.stdout.flush()
        except BaseException as e:
            sys.stderr.write(f"{type(e).__name__}: {e}\n")
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(out_w)
    os.close(err_w)
    with open(out_r) as out, open(err_r) as err:
        stdout, stderr = out.read(), err.read()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), stdout, stderr


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0, reason="running as another user needs root")
def test_a_member_of_the_group_reads_the_journal_while_edged_runs_and_while_it_is_stopped(readable_only: Path) -> None:
    """Stopped, edged leaves no -shm, which a reader that may not write the folder cannot create:
    "attempt to write a readonly database", exit 1."""
    group = pwd.getpwnam("nobody").pw_gid
    journal = readable_only / "journal.sqlite"
    daemon = JournalStore(journal, "normal")
    daemon.open()
    os.chown(journal, 0, group)
    journal.chmod(0o640)  # SQLite gives its -wal and -shm the file's owner and mode
    daemon.close()
    os.chown(readable_only, 0, group)
    readable_only.chmod(0o750)
    daemon.append([_entry(n, "cam0", "ok", f"P-{n}") for n in range(3)], IDENTITY, True)  # edged runs: rows in its WAL
    beside = {"journal.sqlite", "journal.sqlite.lock"}  # the file and edged's lock on it
    assert {p.name for p in readable_only.iterdir()} == {*beside, "journal.sqlite-wal", "journal.sqlite-shm"}
    code, out, err = _history_as_nobody("--journal", str(journal), "--json")
    assert code == 0, err
    assert [row["part_id"] for row in json.loads(out)] == ["P-0", "P-1", "P-2"]
    daemon.append([_entry(3, "cam0", "ng", "P-3")], IDENTITY, True)
    daemon.close()  # edged stops: the WAL is folded into the file, -wal and -shm are gone
    assert {p.name for p in readable_only.iterdir()} == beside
    code, out, err = _history_as_nobody("--journal", str(journal), "--json")
    assert code == 0, err
    assert [row["part_id"] for row in json.loads(out)] == ["P-0", "P-1", "P-2", "P-3"]
    code, out, err = _history_as_nobody("--journal", str(journal), "--part-id", "P-3")
    assert (code, out.count("\n")) == (0, 1), err


@pytest.mark.integration
def test_reading_a_stopped_daemons_journal_leaves_nothing_beside_it(journal: Path) -> None:
    """A read-only open created -wal and -shm and left them, owned by the reader: root's kept edged,
    started next as its own user, from writing its journal ("attempt to write a readonly database")."""
    done = run_cli("history", "--journal", str(journal), "--part-id", "P-7")
    assert done.returncode == 0, done.stderr
    assert "frame 7" in done.stdout
    assert {p.name for p in journal.parent.iterdir()} == {"journal.sqlite", "journal.sqlite.lock"}  # and edged's lock


@pytest.mark.integration
def test_a_journal_path_with_uri_characters_is_read_where_it_is(journal: Path, tmp_path: Path) -> None:
    """The path went into an SQLite URI as it was: ``?`` and ``#`` cut it short and an empty database was created there."""
    odd = tmp_path / "line?1#a%20"
    odd.mkdir()
    journal = journal.rename(odd / "journal.sqlite")
    done = run_cli("history", "--journal", str(journal), "--json")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)) == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal.sqlite.lock", "line?1#a%20"]  # edged's lock stays


@pytest.mark.integration
def test_a_configuration_that_records_nothing_says_so(tmp_path: Path) -> None:
    """The demo's configuration (no [inspect]): "no journal at ...; it is written once a verdict is
    made", which it never would be."""
    config = write_config(tmp_path / "edged.toml", {"model": {"path": str(colour_probe(tmp_path / "m.onnx"))}})
    done = run_cli("history", "--config", str(config))
    assert done.returncode == 1 and "this configuration gives it nothing to record" in done.stderr, done.stderr
    config.write_text(config.read_text() + "\n[journal]\ndetections = true\n")
    done = run_cli("history", "--config", str(config))
    assert done.returncode == 1 and "it is written once a verdict is made" in done.stderr, done.stderr


@pytest.mark.unit
def test_a_configuration_with_the_journal_off_says_so(
    journal: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "no journal at ...; it is written once a verdict is made", which it never would be."""
    with pytest.raises(JournalUnreadable, match=r"the journal is off in this configuration \(\[journal\] enabled = false\)"):
        run_history(tmp_path / "none.sqlite", Query(), "table", journal_off=True)
    assert run_history(journal, Query(part_id="P-7"), "table", journal_off=True) == 0  # one kept from before: shown
    assert "frame 7" in capsys.readouterr().out
