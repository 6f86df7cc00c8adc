"""``[inspect]`` on the running daemon: thresholds and zones change exactly their detections, the verdict topic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from daemon import RunningDaemon, free_port, run_cli, write_config, write_video
from onnx_models import fixed_scene

from edged.messages import DetectionsMessage, VerdictMessage

pytestmark = pytest.mark.integration

# A scene the model finds in every frame; a 128x96 frame maps input x * 2, (y - 8) * 2.
SCENE = [
    (16.0, 20.0, 8.0, 8.0, 0, 0.9),  # scratch, centre at (0.25, 0.25) of the frame
    (48.0, 20.0, 8.0, 8.0, 1, 0.5),  # crack at (0.75, 0.25)
    (16.0, 44.0, 8.0, 8.0, 2, 0.3),  # dust at (0.25, 0.75)
    (48.0, 44.0, 8.0, 8.0, 0, 0.35),  # scratch at (0.75, 0.75)
]
LEFT = [[0, 0], [0.5, 0], [0.5, 1], [0, 1]]
BOTTOM_RIGHT = [[0.5, 0.5], [1, 0.5], [1, 1], [0.5, 1]]


def start(tmp_path: Path, inspect: dict[str, Any] | None, **sections: dict[str, Any]) -> RunningDaemon:
    fixed_scene(tmp_path / "scene.onnx", SCENE)
    write_video(tmp_path / "clip.avi", [(90, 90, 90)] * 10)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    doc: dict[str, dict[str, Any]] = {
        "source": {"type": "file", "path": "clip.avi", "loop": True, "realtime": True},
        "model": {"path": "scene.onnx"},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.5},
        "thermal": {"enabled": False},
    }
    if inspect is not None:
        doc["inspect"] = inspect
    doc.update(sections)
    return RunningDaemon(write_config(tmp_path / "edged.toml", doc), endpoint)


def first_pair(d: RunningDaemon) -> tuple[DetectionsMessage, VerdictMessage]:
    """A detections message and the verdict message of the same frame."""
    detections: dict[int, DetectionsMessage] = {}
    for msg in d.messages(30):
        if isinstance(msg, DetectionsMessage):
            detections[msg.frame_id] = msg
        elif isinstance(msg, VerdictMessage) and msg.frame_id in detections:
            return detections[msg.frame_id], msg
    raise AssertionError(f"no verdict after its detections in 30 s:\n{d.log()}")


def test_without_inspect_every_detection_comes_and_there_is_no_verdict(tmp_path: Path) -> None:
    d = start(tmp_path, None)
    try:
        msgs = d.collect("detections", 3)
        for msg in msgs:
            assert isinstance(msg, DetectionsMessage)
            assert [x.label for x in msg.detections] == ["scratch", "crack", "scratch", "dust"]
            assert msg.verdict is None and msg.reasons == [] and {x.zone for x in msg.detections} == {None}
        assert not any(m.kind == "verdict" for m in d.messages(1.0))
    finally:
        d.stop()


def test_thresholds_and_zones_change_exactly_their_detections_and_the_verdict_names_why(tmp_path: Path) -> None:
    d = start(
        tmp_path,
        {
            "class_conf": {"crack": 0.6, "dust": 0.2},
            "zones": {"left": LEFT, "corner": BOTTOM_RIGHT},
            "ng_classes": ["crack", "dust"],
        },
    )
    try:
        msg, verdict = first_pair(d)
        # The crack is under its 0.6; nothing is outside both zones.
        got = [(x.label, x.score, x.zone, x.threshold) for x in msg.detections]
        assert got == [("scratch", 0.9, "left", 0.25), ("scratch", 0.35, "corner", 0.25), ("dust", 0.3, "left", 0.2)]
        assert msg.detections[2].box == (24.0, 64.0, 40.0, 80.0)
        assert msg.verdict == "ng" and [(r.detection, r.label, r.zone) for r in msg.reasons] == [(2, "dust", "left")]
        assert msg.verdict_latency_ms is not None and 0 < msg.verdict_latency_ms <= msg.timings.age_ms + 1
        assert verdict.camera_id == "cam0" and verdict.part_id is None and verdict.verdict == "ng"
        assert verdict.reasons == msg.reasons and verdict.verdict_latency_ms == msg.verdict_latency_ms
        assert verdict.capture_time_ns == msg.capture_time_ns
    finally:
        d.stop()


def test_a_zone_that_drops_everything_ng_gives_ok_verdicts_on_the_verdict_topic(tmp_path: Path) -> None:
    d = start(tmp_path, {"zones": {"corner": BOTTOM_RIGHT}, "ng_classes": ["crack", "dust"]})
    try:
        msg, verdict = first_pair(d)
        assert [(x.label, x.zone) for x in msg.detections] == [("scratch", "corner")]
        assert msg.verdict == verdict.verdict == "ok" and verdict.reasons == []
        seqs = [m.seq for m in d.collect("verdict", 3)]
        assert seqs == sorted(seqs) and seqs[0] > verdict.seq
    finally:
        d.stop()


def test_a_class_the_model_does_not_have_exits_78_naming_it_and_the_models_labels(tmp_path: Path) -> None:
    fixed_scene(tmp_path / "scene.onnx", SCENE)
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "synthetic"},
            "model": {"path": "scene.onnx"},
            "publish": {"endpoints": [f"tcp://127.0.0.1:{free_port()}"]},
            "thermal": {"enabled": False},
            "inspect": {"class_conf": {"scracth": 0.5}},
        },
    )
    for command in ("run", "check"):
        result = run_cli(command, "--config", str(config))
        assert result.returncode == 78, result.stderr
        text = result.stderr + result.stdout
        assert "inspect.class_conf: 'scracth' is not a class of the model (its classes: scratch, crack, dust)" in text
        assert f"1 problem(s) in {config}:" in text, text  # named as the configuration's own problems are


def test_evidence_saves_the_frames_the_verdict_calls_ng_and_no_others(tmp_path: Path) -> None:
    # Every frame has detections; with the crack under its 0.6 only the dust can make a frame NG.
    for ng_classes in (["dust"], ["crack"]):
        folder = tmp_path / ng_classes[0]
        folder.mkdir()
        evidence = {"dir": "evidence", "save": "ng"}
        d = start(folder, {"class_conf": {"crack": 0.6}, "ng_classes": ng_classes}, evidence=evidence)
        try:
            status = d.wait_status(lambda s: s.frames_processed >= 10 and s.evidence is not None)
            assert status.evidence is not None
            if ng_classes == ["crack"]:  # every verdict ok: nothing is evidence, detections or not
                assert status.evidence.saved == 0 and not list((folder / "evidence").rglob("*.jpg"))
                continue
            d.wait_status(lambda s: s.evidence is not None and s.evidence.saved > 0)
            sidecar = next((folder / "evidence").rglob("messages/*.json"))
            msg = DetectionsMessage.model_validate_json(sidecar.read_text())
            assert msg.verdict == "ng" and [r.label for r in msg.reasons] == ["dust"]
        finally:
            d.stop()


def test_ng_near_saves_a_frame_whose_only_finding_is_a_near_miss_which_no_subscriber_sees(tmp_path: Path) -> None:
    # Only a crack makes a frame NG, and the crack (0.5) is under its 0.6: every verdict is ok.
    # Within near_margin 0.15 below its threshold the crack is a near miss: evidence under ng+near
    # (the frame as published, its labels the detections as predicted), nothing under ng.
    inspect = {"class_conf": {"crack": 0.6}, "ng_classes": ["crack"]}
    for save in ("ng", "ng+near"):
        folder = tmp_path / save
        folder.mkdir()
        evidence = {"dir": "evidence", "save": save, "near_margin": 0.15, "max_per_minute": 0}
        d = start(folder, inspect, evidence=evidence)
        try:
            if save == "ng":
                status = d.wait_status(lambda s: s.frames_processed >= 10 and s.evidence is not None)
                assert status.evidence is not None and status.evidence.saved == 0
            else:
                d.wait_status(lambda s: s.evidence is not None and s.evidence.saved >= 2)
            for msg in d.collect("detections", 5):
                assert isinstance(msg, DetectionsMessage) and msg.verdict == "ok"
                assert [x.label for x in msg.detections] == ["scratch", "scratch", "dust"]
        finally:
            assert d.stop() == 0
        saved = sorted((folder / "evidence").rglob("images/*.jpg"))
        if save == "ng":
            assert saved == []
            continue
        assert len(saved) >= 2
        day = saved[0].parent.parent
        label = (day / "labels" / f"{saved[0].stem}.txt").read_text()
        assert [line.split()[0] for line in label.splitlines()] == ["0", "0", "2"]  # no crack
        sidecar = DetectionsMessage.model_validate_json((day / "messages" / f"{saved[0].stem}.json").read_text())
        assert sidecar.verdict == "ok" and [x.label for x in sidecar.detections] == ["scratch", "scratch", "dust"]
