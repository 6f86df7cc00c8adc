"""The Prometheus exposition: names, labels and values from a status message and the stage histograms."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from edged import __version__
from edged.messages import (
    CandidateReport,
    CaptureReport,
    ClassAgreement,
    EvidenceReport,
    JournalReport,
    MemoryReadings,
    ModelInfo,
    OpcuaReport,
    Reason,
    RejectReport,
    StageLatency,
    StatusMessage,
    ThermalReadings,
    ThermalState,
)
from edged.prometheus import Metrics
from edged.stats import RunStats, VerdictRecord

CAM0 = (("camera", "cam0"),)
MODEL = ModelInfo(name="probe", sha256="ab" * 32, provider="CPUExecutionProvider")


EVIDENCE = EvidenceReport(saved=7, dropped=2, errors=1, rate_limited=3, bytes=123456, last_error="disk full")
JOURNAL = JournalReport(path="/j.sqlite", recorded=40, dropped=1, errors=2, bytes=65536, last_error=None, unsent_deleted=7)
REJECT = RejectReport(
    pulses=9,
    late=3,
    late_fired=2,
    late_verdicts=1,
    merged=4,
    alarm=False,
    lateness_p50_ms=0.1,
    lateness_p99_ms=0.8,
    lateness_max_ms=1.5,
    margin_p1_ms=12.0,
    margin_p50_ms=80.0,
    last_error=None,
)


TRIAL = CandidateReport(
    state="on_trial",
    model=ModelInfo(name="next", sha256="cd" * 32, provider="CPUExecutionProvider"),
    frames=20,
    skipped_busy=3,
    failed_frames=1,
    agreement=0.9,
    verdicts={"ok/ok": 18, "ok/ng": 2},
    classes={"crack": ClassAgreement(matched=5, live_only=1, candidate_only=2)},
    score_shift=-0.05,
    latency=StageLatency(p50_ms=4.0, p99_ms=8.0),
    disagreements_saved=2,
    gate="the models agree on 90.0% of the frames, below the gate's 98.0%",
    live_frames=100,
    live_delayed=4,
    live_delay_ms=0.2,
    live_delay=StageLatency(p50_ms=4.0, p99_ms=6.0),
)

MEMORY = MemoryReadings(limit_bytes=2**30, used_bytes=900 * 2**20, cgroup_bytes=1000 * 2**20, oom_kills=1)
OPCUA = OpcuaReport(
    listen="opc.tcp://127.0.0.1:4840",
    serving=True,
    clients=3,
    accept_failed=4,
    requests=12,
    refused=2,
    updates=40,
    update_ms=StageLatency(p50_ms=1.5, p99_ms=4.0),
)


def _status(
    thermal: ThermalReadings | None = None,
    rate_cap: float | None = 2.5,
    evidence: EvidenceReport | None = None,
    journal: JournalReport | None = None,
    reject: RejectReport | None = None,
    candidate: CandidateReport | None = None,
) -> StatusMessage:
    return StatusMessage(
        camera_id="cam0",
        seq=3,
        time_ns=0,
        uptime_s=10.0,
        fps=4.0,
        frames_processed=42,
        source_state="lost",
        drops={"stale_slow": 5, "bad_frame_size": 2},
        latency={"inference": StageLatency(p50_ms=1.0, p99_ms=2.0)},
        rate_cap_fps=rate_cap,
        thermal=thermal,
        model=MODEL,
        capture=CaptureReport(frames_captured=50, frames_decoded=47, reconnects=1, size_changes=0, last_error="gone"),
        evidence=evidence,
        journal=journal,
        reject=reject,
        candidate=candidate,
    )


def _inspected_stats() -> RunStats:
    """Three frames inspected: OK, NG (a scratch in "left" and a dent in "right"), NG (a scratch in "left")."""
    stats = RunStats()
    stats.record(1.0, 10.0, 0.5, 20.0)

    def reason(label: str, zone: str) -> Reason:
        return Reason(detection=0, class_id=0, label=label, score=0.9, zone=zone)

    stats.record_verdict(VerdictRecord(0, 1, None, "ok", ()), 12.0)
    stats.record_verdict(VerdictRecord(0, 2, None, "ng", (reason("scratch", "left"), reason("dent", "right"))), 15.0)
    stats.record_verdict(VerdictRecord(0, 3, "part-9", "ng", (reason("scratch", "left"),)), 700.0)
    return stats


def _thermal(state: ThermalState, zones: dict[str, float], flags: list[str]) -> ThermalReadings:
    return ThermalReadings(
        state=state,
        board="raspberry-pi",
        model=None,
        zones=zones,
        hottest_c=max(zones.values()),
        freq_cap_ratio=None,
        freq_cur_ratio=None,
        throttled_flags=flags,
        hardware_throttling=bool(flags),
        rate_factor=1.0,
        thresholds={"warm": 70.0, "throttled": 80.0, "critical": 85.0},
        power_mode=None,
    )


def _samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.exposition().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_nothing_is_exposed_before_the_first_status() -> None:
    assert Metrics().exposition() == b""


def test_counters_gauges_and_info_come_from_the_status() -> None:
    metrics = Metrics()
    metrics.update([(_status(), RunStats().histograms(), None)])
    got = _samples(metrics)
    assert got[("edged_frames_total", CAM0)] == 42
    assert got[("edged_frames_dropped_total", (("camera", "cam0"), ("reason", "stale_slow")))] == 5
    assert got[("edged_frames_dropped_total", (("camera", "cam0"), ("reason", "bad_frame_size")))] == 2
    assert got[("edged_frames_captured_total", CAM0)] == 50
    assert got[("edged_source_reconnects_total", CAM0)] == 1
    assert got[("edged_source_up", CAM0)] == 0  # lost
    assert got[("edged_rate_cap_fps", CAM0)] == 2.5
    labels = (
        ("model", "probe"),
        ("model_sha256", "ab" * 32),
        ("provider", "CPUExecutionProvider"),
        ("version", __version__),
    )
    assert got[("edged_build_info", labels)] == 1
    assert not any(name.endswith("_created") for name, _ in got)
    metrics.update([(_status(rate_cap=None), RunStats().histograms(), None)])
    assert _samples(metrics)[("edged_rate_cap_fps", CAM0)] == 0  # uncapped


def test_stage_histograms_are_cumulative_in_seconds() -> None:
    stats = RunStats()
    for ms in (0.3, 0.7, 3.0, 40.0, 9000.0):
        stats.record(ms, ms * 2, ms / 2, ms * 10)
    metrics = Metrics()
    metrics.update([(_status(), stats.histograms(), None)])
    got = _samples(metrics)

    def bucket(name: str, le: str, stage: str | None = None) -> float:
        labels = (("camera", "cam0"), ("le", le)) + ((("stage", stage),) if stage else ())
        return got[(name + "_bucket", tuple(sorted(labels)))]

    name = "edged_stage_duration_seconds"
    assert bucket(name, "0.0005", "preprocess") == 1  # 0.3 ms
    assert bucket(name, "0.001", "preprocess") == 2
    assert bucket(name, "0.005", "preprocess") == 3
    assert bucket(name, "0.05", "preprocess") == 4
    assert bucket(name, "5.0", "preprocess") == 4  # 9 s lies beyond the last bound
    assert bucket(name, "+Inf", "preprocess") == 5
    assert got[(name + "_count", (*CAM0, ("stage", "preprocess")))] == 5
    assert abs(got[(name + "_sum", (*CAM0, ("stage", "decode")))] - (0.3 + 0.7 + 3 + 40 + 9000) / 2 / 1000) < 1e-9
    assert bucket("edged_frame_age_seconds", "0.005") == 1  # 3 ms
    assert ("edged_stage_duration_seconds_count", (*CAM0, ("stage", "age"))) not in got  # age is its own family


def test_thermal_zones_flags_and_state() -> None:
    thermal = _thermal("warm", {"cpu-thermal": 71.5}, ["soft_temp_limit", "throttled_occurred"])
    metrics = Metrics()
    metrics.update([(_status(thermal), RunStats().histograms(), None)])
    got = _samples(metrics)
    assert got[("edged_soc_temperature_celsius", (("zone", "cpu-thermal"),))] == 71.5
    assert got[("edged_throttled", (("flag", "soft_temp_limit"),))] == 1
    assert got[("edged_throttled", (("flag", "throttled_occurred"),))] == 1
    assert got[("edged_throttled", (("flag", "under_voltage"),))] == 0
    assert got[("edged_thermal_state", (("state", "warm"),))] == 1
    assert got[("edged_thermal_state", (("state", "ok"),))] == 0
    metrics.update([(_status(None), RunStats().histograms(), None)])
    assert not any(name.startswith(("edged_soc", "edged_throttled")) for name, _ in _samples(metrics))


def test_the_cgroup_s_memory_limit_use_and_oom_kills_come_from_the_status() -> None:
    metrics = Metrics()
    metrics.update([(_status().model_copy(update={"memory": MEMORY}), RunStats().histograms(), None)])
    got = _samples(metrics)
    assert got[("edged_memory_limit_bytes", ())] == 2**30
    assert got[("edged_memory_used_bytes", ())] == 900 * 2**20
    assert got[("edged_memory_cgroup_bytes", ())] == 1000 * 2**20
    assert got[("edged_memory_oom_kills_total", ())] == 1
    metrics.update([(_status(), RunStats().histograms(), None)])
    assert not any(name.startswith("edged_memory") for name, _ in _samples(metrics))  # no limit: no series


def test_verdicts_ng_reasons_and_their_latency_come_with_inspection() -> None:
    stats = _inspected_stats()
    metrics = Metrics()
    metrics.update([(_status(), stats.histograms(), stats.verdict_counts())])
    got = _samples(metrics)
    assert got[("edged_verdicts_total", (*CAM0, ("verdict", "ok")))] == 1
    assert got[("edged_verdicts_total", (*CAM0, ("verdict", "ng")))] == 2
    assert got[("edged_ng_reasons_total", (*CAM0, ("class", "scratch"), ("zone", "left")))] == 2
    assert got[("edged_ng_reasons_total", (*CAM0, ("class", "dent"), ("zone", "right")))] == 1
    assert got[("edged_verdict_latency_seconds_bucket", (*CAM0, ("le", "0.02")))] == 2  # 12 and 15 ms
    assert got[("edged_verdict_latency_seconds_bucket", (*CAM0, ("le", "+Inf")))] == 3
    assert abs(got[("edged_verdict_latency_seconds_sum", CAM0)] - 0.727) < 1e-9
    metrics.update([(_status(), stats.histograms(), None)])
    assert not any(name.startswith(("edged_verdict", "edged_ng")) for name, _ in _samples(metrics))  # no [inspect]


def test_evidence_counters_come_from_the_status() -> None:
    metrics = Metrics()
    metrics.update([(_status(evidence=EVIDENCE), RunStats().histograms(), None)])
    got = _samples(metrics)
    assert got[("edged_evidence_saved_total", CAM0)] == 7
    assert got[("edged_evidence_dropped_total", CAM0)] == 2
    assert got[("edged_evidence_errors_total", CAM0)] == 1
    assert got[("edged_evidence_rate_limited_total", CAM0)] == 3
    assert got[("edged_evidence_bytes", CAM0)] == 123456
    metrics.update([(_status(), RunStats().histograms(), None)])
    assert not any(name.startswith("edged_evidence") for name, _ in _samples(metrics))  # no [evidence]


def test_journal_counters_come_from_the_status() -> None:
    metrics = Metrics()
    metrics.update([(_status(journal=JOURNAL), RunStats().histograms(), None)])
    got = _samples(metrics)
    assert got[("edged_journal_recorded_total", CAM0)] == 40
    assert got[("edged_journal_dropped_total", CAM0)] == 1
    assert got[("edged_journal_errors_total", ())] == 2
    assert got[("edged_journal_bytes", ())] == 65536
    assert got[("edged_journal_unsent_deleted_total", ())] == 7
    metrics.update([(_status(), RunStats().histograms(), None)])
    assert not any(name.startswith("edged_journal") for name, _ in _samples(metrics))


def test_reject_line_counters_lateness_and_margin_come_from_the_status() -> None:
    metrics = Metrics()
    metrics.update([(_status(reject=REJECT), RunStats().histograms(), None)])
    got = _samples(metrics)
    assert got[("edged_reject_pulses_total", CAM0)] == 9
    assert got[("edged_reject_late_fired_total", CAM0)] == 2
    assert got[("edged_reject_merged_total", CAM0)] == 4
    assert got[("edged_reject_lateness_seconds", (*CAM0, ("stat", "p99")))] == 0.0008
    assert got[("edged_reject_margin_seconds", (*CAM0, ("stat", "p1")))] == 0.012
    assert got[("edged_reject_alarm", CAM0)] == 0
    metrics.update([(_status(), RunStats().histograms(), None)])
    assert not any(name.startswith("edged_reject") for name, _ in _samples(metrics))


def test_opcua_clients_and_counters_come_from_the_status() -> None:
    metrics = Metrics()
    server = OPCUA
    metrics.update([(_status().model_copy(update={"opcua": server}), RunStats().histograms(), None)])
    got = _samples(metrics)
    assert got[("edged_opcua_serving", ())] == 1
    assert got[("edged_opcua_clients", ())] == 3
    assert got[("edged_opcua_accept_failed_total", ())] == 4
    assert got[("edged_opcua_requests_total", ())] == 12
    assert got[("edged_opcua_updates_total", ())] == 40
    assert got[("edged_opcua_refused_total", ())] == 2
    assert got[("edged_opcua_update_seconds", (("stat", "p99"),))] == 0.004
    metrics.update([(_status(), RunStats().histograms(), None)])
    assert not any(name.startswith("edged_opcua") for name, _ in _samples(metrics))  # no [opcua]


def test_the_registry_is_edged_own() -> None:
    from prometheus_client import REGISTRY

    metrics = Metrics()
    metrics.update([(_status(), RunStats().histograms(), None)])
    assert b"python_gc" not in metrics.exposition() and b"process_" not in metrics.exposition()
    assert metrics.registry is not REGISTRY


def test_promtool_accepts_the_exposition() -> None:
    # Every section on: the OPC UA and candidate latencies were labelled quantile, which promtool refuses on a gauge.
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian's prometheus) is needed: scripts/setup test installs it"
    stats = _inspected_stats()
    metrics = Metrics()
    metrics.update(
        [
            (
                _status(
                    _thermal("ok", {"soc": 50.0}, []), evidence=EVIDENCE, journal=JOURNAL, reject=REJECT, candidate=TRIAL
                ).model_copy(update={"opcua": OPCUA, "memory": MEMORY}),
                stats.histograms(),
                stats.verdict_counts(),
            )
        ]
    )
    check = subprocess.run([promtool, "check", "metrics"], input=metrics.exposition(), capture_output=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_grafana_dashboard_asks_only_for_metrics_edged_exposes() -> None:
    dashboard = json.loads((Path(__file__).resolve().parents[1] / "packaging" / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    asked = {name for expr in exprs for name in re.findall(r"\b(edged_[a-z_]+)\b", expr)}
    stats = _inspected_stats()
    metrics = Metrics()
    metrics.update(
        [(_status(_thermal("ok", {"soc": 50.0}, []), evidence=EVIDENCE), stats.histograms(), stats.verdict_counts())]
    )
    exposed = {name for name, _ in _samples(metrics)}
    assert asked and asked <= exposed, asked - exposed
    assert {"edged_frames_total", "edged_stage_duration_seconds_bucket", "edged_soc_temperature_celsius"} <= asked
    assert {
        "edged_verdicts_total",
        "edged_ng_reasons_total",
        "edged_verdict_latency_seconds_bucket",
        "edged_evidence_saved_total",
        "edged_evidence_dropped_total",
        "edged_evidence_errors_total",
        "edged_evidence_rate_limited_total",
        "edged_evidence_bytes",
    } <= asked


def test_the_grafana_dashboard_picks_cameras_and_never_sums_them_together() -> None:
    dashboard = json.loads((Path(__file__).resolve().parents[1] / "packaging" / "grafana-dashboard.json").read_text())
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert re.fullmatch(
        r'label_values\(edged_[a-z_]+\{instance=~"\$instance"\}, camera\)', variables["camera"]["definition"]
    )
    assert variables["camera"]["multi"] and variables["camera"]["includeAll"]
    stats = _inspected_stats()
    metrics = Metrics()
    metrics.update([(_status(evidence=EVIDENCE), stats.histograms(), stats.verdict_counts())])
    per_camera = {name for name, labels in _samples(metrics) if "camera" in dict(labels)}
    checked = 0
    for target in (target for panel in dashboard["panels"] for target in panel["targets"]):
        expr = target["expr"]
        asked = set(re.findall(r"\b(edged_[a-z_]+)\b", expr)) & per_camera
        if not asked:
            continue
        selectors = [s for name in asked for s in re.findall(rf"\b{name}\{{([^}}]*)\}}", expr)]
        assert selectors and all('camera=~"$camera"' in s for s in selectors), expr
        assert all("camera" in group.split(", ") for group in re.findall(r"\bby \(([^)]*)\)", expr)), expr
        assert "{{camera}}" in target["legendFormat"], target
        checked += 1
    assert checked >= 15


def test_each_camera_has_its_own_series_and_the_board_says_its_thermal_state_once() -> None:
    side = _status(_thermal("warm", {"soc": 72.0}, [])).model_copy(update={"camera_id": "side", "frames_processed": 7})
    metrics = Metrics()
    metrics.update(
        [
            (_status(_thermal("warm", {"soc": 72.0}, [])), RunStats().histograms(), None),
            (side, RunStats().histograms(), None),
        ]
    )
    got = _samples(metrics)
    assert got[("edged_frames_total", CAM0)] == 42 and got[("edged_frames_total", (("camera", "side"),))] == 7
    assert got[("edged_soc_temperature_celsius", (("zone", "soc"),))] == 72.0  # no camera label, one series
    metrics.update([(side, RunStats().histograms(), None)])  # cam0 removed by a reload: its series go
    assert ("edged_frames_total", CAM0) not in _samples(metrics)


def test_the_shadow_trial_comes_from_the_status() -> None:
    trial = TRIAL
    metrics = Metrics()
    metrics.update([(_status(candidate=trial), {}, None)])
    got = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for sample in family.samples
    }
    assert got[("edged_candidate_frames_total", ())] == 20
    assert got[("edged_candidate_skipped_busy_total", ())] == 3
    assert got[("edged_candidate_gate_passed", ())] == 0
    assert got[("edged_candidate_agreement", ())] == 0.9
    assert got[("edged_candidate_verdicts_total", (("candidate", "ng"), ("live", "ok")))] == 2
    assert got[("edged_candidate_boxes_total", (("class", "crack"), ("outcome", "live_only")))] == 1
    assert got[("edged_candidate_latency_seconds", (("stat", "p99"),))] == 0.008
    assert got[("edged_candidate_live_frames_total", ())] == 100
    assert got[("edged_candidate_live_delayed_total", ())] == 4
    assert got[("edged_candidate_live_delay_mean_seconds", ())] == 0.0002
    assert got[("edged_candidate_live_delay_seconds", (("stat", "p99"),))] == 0.006
    assert ("edged_candidate_info", (("model", "next"), ("model_sha256", "cd" * 32), ("state", "on_trial"))) in got
