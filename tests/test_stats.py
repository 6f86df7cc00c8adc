"""Run statistics: the verdicts counted since start and the latest few kept for the status page."""

from __future__ import annotations

from edged.messages import Reason
from edged.stats import VERDICTS_KEPT, RunStats, VerdictRecord


def test_verdicts_are_counted_and_only_the_latest_are_kept_newest_first() -> None:
    stats = RunStats()
    scratch = Reason(detection=1, class_id=0, label="scratch", score=0.8, zone=None)
    for frame_id in range(VERDICTS_KEPT + 5):
        ng = frame_id % 5 == 0
        stats.record_verdict(VerdictRecord(frame_id, frame_id, None, "ng" if ng else "ok", (scratch,) if ng else ()), 3.0)
    counts = stats.verdict_counts()
    assert counts.verdicts == {"ok": 20, "ng": 5, "uncertain": 0}
    assert counts.ng_reasons == {("scratch", ""): 5}  # no zones: the zone label is empty
    assert counts.latency.count == VERDICTS_KEPT + 5
    assert [r.frame_id for r in counts.latest] == list(range(VERDICTS_KEPT + 4, 4, -1))
    assert RunStats().verdict_counts().verdicts == {"ok": 0, "ng": 0, "uncertain": 0}
