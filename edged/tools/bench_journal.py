"""``edged bench --journal``: what recording verdicts costs, under each durability.

The loop only hands a verdict to the journal's queue (``offer``), so its cost on the verdict's
latency is that call; the time to the disk (offer to commit) is what a power cut can lose and
what the MQTT forwarding waits for. Both are measured here, on the real writer and the real file
in ``folder``, verdicts offered at a camera's pace.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edged.identity import Identity
from edged.journal import Entry, JournalWriter
from edged.settings.journal import JournalConfig

Durability = Literal["normal", "full"]
_MESSAGE = json.dumps({"kind": "verdict", "reasons": [{"label": "crack", "score": 0.83}] * 2, "pad": "x" * 300}).encode()


class _Commits:
    """Set by the writer after each commit: when, and how many entries were recorded by then."""

    def __init__(self, writer: JournalWriter) -> None:
        self.writer = writer
        self.at: list[tuple[int, int]] = []

    def set(self) -> None:
        self.at.append((time.perf_counter_ns(), self.writer.recorded.get("bench", 0)))


def journal_latency(folder: Path, durability: Durability, entries: int, fps: float) -> dict[str, Any]:
    """Offer ``entries`` verdicts at ``fps`` and time each offer, and each from offer to commit."""
    path = folder / f"bench-{durability}.sqlite"
    writer = JournalWriter(JournalConfig(path=path, durability=durability), Identity.here(), previous=None)
    commits = _Commits(writer)
    writer.committed.add(commits)
    writer.start(records=True)
    offered: list[int] = []
    offer_ns: list[int] = []
    period_ns = int(1e9 / fps)
    next_ns = time.perf_counter_ns()
    for n in range(entries):
        next_ns += period_ns
        while time.perf_counter_ns() < next_ns:
            time.sleep(max(0.0, (next_ns - time.perf_counter_ns()) / 1e9))
        entry = Entry("verdict", "bench", n, n, f"P-{n}", "ng", "[]", time.time_ns(), n, "a" * 64, "c" * 64, _MESSAGE)
        t0 = time.perf_counter_ns()
        writer.offer(entry)
        offered.append(t0)
        offer_ns.append(time.perf_counter_ns() - t0)
    writer.stop(timeout_s=30)
    committed = np.empty(entries, dtype=np.int64)
    done = 0
    for at, count in commits.at:
        committed[done:count] = at
        done = max(done, count)
    to_disk_ms = (committed[:done] - np.array(offered[:done])) / 1e6
    return {
        "durability": durability,
        "entries": entries,
        "recorded": done,
        "fps": fps,
        "offer_us": {"p50": float(np.percentile(offer_ns, 50)) / 1e3, "p99": float(np.percentile(offer_ns, 99)) / 1e3},
        "to_disk_ms": {
            "p50": float(np.percentile(to_disk_ms, 50)),
            "p99": float(np.percentile(to_disk_ms, 99)),
            "max": float(to_disk_ms.max()),
        },
        "errors": writer.failures.count,
    }


def run_journal_bench(folder: Path | None, entries: int, fps: float) -> list[dict[str, Any]]:
    """Both durabilities, on a file in ``folder`` (default: a temporary folder, on the disk it is on)."""
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        return [journal_latency(Path(scratch), durability, entries, fps) for durability in ("normal", "full")]


def format_journal(rows: list[dict[str, Any]], folder: Path | None) -> str:
    where = folder or Path(tempfile.gettempdir())
    lines = [f"journal: verdicts offered at {rows[0]['fps']:g} fps, {rows[0]['entries']} each, file in {where}"]
    for r in rows:
        disk, offer = r["to_disk_ms"], r["offer_us"]
        lines.append(
            f"  {r['durability']:<6} offer (the loop's cost) p50 {offer['p50']:.1f} us p99 {offer['p99']:.1f} us; "
            f"offer to commit p50 {disk['p50']:.2f} ms p99 {disk['p99']:.2f} ms max {disk['max']:.2f} ms; "
            f"recorded {r['recorded']}, errors {r['errors']}"
        )
    return "\n".join(lines)
