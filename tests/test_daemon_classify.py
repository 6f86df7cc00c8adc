"""A classification model on the running daemon: its classes and verdicts over ZeroMQ, its evidence by class."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import onnx
import pytest
from daemon import RunningDaemon, free_port, images_config, refused_by_check_and_run, run_cli, write_config
from onnx import TensorProto, helper, numpy_helper

from edged.messages import DetectionsMessage, VerdictMessage

pytestmark = pytest.mark.integration

DATA = Path(__file__).parent / "data" / "tasks"
REFERENCE = json.loads((DATA / "cls.json").read_text())


def constant_classifier(path: Path, output: list[float], labels: list[str]) -> Path:
    """An ultralytics-style classifier whose output is ``output`` whatever the frame: the input is read,
    times zero, so the runtime cannot fold the model into a constant."""
    const = [np.zeros((), np.float32), np.array([output], np.float32)]
    nodes = [
        helper.make_node("ReduceMean", ["images"], ["mean"], keepdims=0),
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(const[0], "zero_v")),
        helper.make_node("Mul", ["mean", "zero"], ["nothing"]),
        helper.make_node("Constant", [], ["fixed"], value=numpy_helper.from_array(const[1], "fixed_v")),
        helper.make_node("Add", ["fixed", "nothing"], ["output0"]),
    ]
    graph = helper.make_graph(
        nodes,
        "constant_classifier",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, len(output)])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    helper.set_model_props(model, {"names": str(dict(enumerate(labels))), "task": "classify"})
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_a_classifier_publishes_its_top_classes_and_verdicts_and_files_its_evidence_by_class(tmp_path: Path) -> None:
    # wide.png: crack 0.80 (an NG class, above 0.5): ng; square.png: scratch 0.42, below min_confidence: uncertain.
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = images_config(
        tmp_path,
        DATA / "cls.onnx",
        [DATA / "square.png", DATA / "wide.png"],
        endpoint,
        source={"fps": 20},
        model={"top_k": 3},
        inspect={"ng_classes": ["crack"], "min_confidence": 0.5},
        evidence={"dir": "evidence", "save": "ng"},
    )
    d = RunningDaemon(config, endpoint)
    try:
        seen: dict[str, DetectionsMessage] = {}
        verdicts: dict[int, VerdictMessage] = {}
        for msg in d.messages(30):
            if isinstance(msg, DetectionsMessage) and msg.source_file:
                seen[msg.source_file] = msg
            elif isinstance(msg, VerdictMessage):
                verdicts[msg.frame_id] = msg
            if len(seen) == 2 and all(m.frame_id in verdicts for m in seen.values()):
                break
        assert set(seen) == {"square.png", "wide.png"}, d.log()
        # The verdict says what the part was taken for, as its detections message does.
        assert all(verdicts[m.frame_id].top == m.top for m in seen.values())
        assert {verdicts[m.frame_id].verdict for m in seen.values()} == {"ng", "uncertain"}
        for name, verdict in (("wide", "ng"), ("square", "uncertain")):
            msg = seen[f"{name}.png"]
            expected = REFERENCE["frames"][name]
            assert (msg.task, msg.detections, msg.verdict) == ("classify", [], verdict)
            assert msg.top is not None and [t.class_id for t in msg.top] == expected["top5"][:3]
            assert [t.score for t in msg.top] == pytest.approx(
                [expected["probs"][c] for c in expected["top5"][:3]], abs=2e-4
            )
            assert [r.label for r in msg.reasons] == [msg.top[0].label]
        d.wait_status(lambda s: s.evidence is not None and s.evidence.saved >= 2)
        filed = {p.parent.name for p in (tmp_path / "evidence").rglob("images/*/*.jpg")}
        assert filed == {"crack", "scratch"}
        assert not list((tmp_path / "evidence").rglob("labels/*.txt"))
    finally:
        d.stop()


def test_edged_history_says_what_an_ok_part_was_taken_for_from_the_verdicts_alone(tmp_path: Path) -> None:
    """A classifier's OK part has no reason: its class is in its verdict message, which the journal records
    (it records a detections message only with journal.detections)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    # square.png: scratch 0.42, not an NG class, above min_confidence: ok.
    inspect = {"ng_classes": ["crack"], "min_confidence": 0.3}
    config = images_config(tmp_path, DATA / "cls.onnx", [DATA / "square.png"], endpoint, inspect=inspect)
    d = RunningDaemon(config, endpoint)
    try:
        ok = d.collect("verdict", 2)
        assert all(isinstance(v, VerdictMessage) and v.verdict == "ok" and v.reasons == [] for v in ok), ok
    finally:
        assert d.stop() == 0, d.log()
    shown = run_cli("history", "--config", str(config))
    assert shown.returncode == 0, shown.stderr
    rows = shown.stdout.splitlines()
    assert rows and all("  ok  scratch 0.42  model " in row for row in rows), shown.stdout


def test_an_uncertain_part_is_ng_on_the_triggers_exit_code(tmp_path: Path) -> None:
    # square.png: scratch 0.42, below min_confidence 0.5: uncertain, which the reject line takes as NG (exit 3).
    (tmp_path / "frames").mkdir()
    shutil.copy(DATA / "square.png", tmp_path / "frames" / "square.png")
    shutil.copy(DATA / "cls.onnx", tmp_path / "cls.onnx")
    endpoint, trigger = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "images", "path": "frames", "fps": 4},
            "model": {"path": "cls.onnx"},
            "inspect": {"ng_classes": ["crack"], "min_confidence": 0.5},
            "publish": {"endpoints": [endpoint], "status_interval_s": 0.25},
            "thermal": {"enabled": False},
            "trigger": {"mode": "request", "endpoint": trigger, "timeout_s": 2.0},
        },
    )
    d = RunningDaemon(config, endpoint)
    try:
        d.wait_status(lambda s: s.capture is not None and s.capture.frames_captured >= 1, timeout=30)
        result = run_cli("trigger", trigger, "--part-id", "U-1", "--timeout", "10")
        assert result.returncode == 3, result.stderr
        assert "UNCERTAIN: scratch 0.42" in result.stdout
    finally:
        d.stop()


def test_a_classifier_with_a_roi_saves_the_region_it_classified_as_its_evidence(tmp_path: Path) -> None:
    # wide.png is 320x240; the region [40, 30, 220, 200] classifies as crack 0.83 (NG): a 180x170 image under crack/.
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = images_config(
        tmp_path,
        DATA / "cls.onnx",
        [DATA / "wide.png"],
        endpoint,
        inspect={"ng_classes": ["crack"], "roi": REFERENCE["roi"]},
        evidence={"dir": "evidence", "save": "ng"},
    )
    d = RunningDaemon(config, endpoint)
    try:
        d.wait_status(lambda s: s.evidence is not None and s.evidence.saved >= 1, timeout=30)
    finally:
        d.stop()
    images = list((tmp_path / "evidence").rglob("images/crack/*.jpg"))
    assert images, d.log()
    image = cv2.imread(str(images[0]))
    expected = cv2.imread(str(DATA / "wide.png"))[30:200, 40:220]
    assert image.shape == expected.shape == (170, 180, 3)
    assert np.abs(image.astype(np.int16) - expected).mean() < 4  # the region, through JPEG


def test_a_classifier_exported_without_its_softmax_is_never_ok_and_is_told_to_export_one(tmp_path: Path) -> None:
    # Logits [0.5, 3.0, -2.0]: 'crack' is the strongest, yet 'ok', alone in 0..1, was published as the
    # top class with the verdict OK, and `edged check` passed it.
    made = tmp_path / "made"
    made.mkdir()
    model = constant_classifier(made / "logits.onnx", [0.5, 3.0, -2.0], ["ok", "crack", "scratch"])
    cv2.imwrite(str(made / "part.png"), np.full((96, 128, 3), 90, np.uint8))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = images_config(tmp_path, model, [made / "part.png"], endpoint, inspect={"ng_classes": ["crack", "scratch"]})
    check = run_cli("check", "--no-bind", "--config", str(config))
    assert check.returncode == 78, check.stdout + check.stderr
    assert "class score(s) outside 0..1" in check.stderr and "export it with its softmax" in check.stderr
    d = RunningDaemon(config, endpoint)
    try:
        published = [m for m in d.collect("detections", 2) if isinstance(m, DetectionsMessage)]
        assert [(m.top, m.verdict) for m in published] == [([], "uncertain")] * 2, d.log()
        d.wait_status(lambda s: s.drops.get("score_above_one", 0) >= 2)
    finally:
        d.stop()
    assert d.log_path.read_text().count("export the classifier with its softmax (ultralytics' -cls exports include it)") == 1


def test_a_camera_the_region_does_not_fit_exits_78_as_check_does(tmp_path: Path) -> None:
    # Before: `edged check` exited 78, while `edged run` rejected every frame, counted, and never reported
    # ready, so systemd kept waiting on a daemon that could never serve.
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "synthetic", "width": 200, "height": 150, "fps": 10.0},
            "model": {"path": str(DATA / "cls.onnx")},
            "inspect": {"ng_classes": ["crack"], "roi": REFERENCE["roi"]},
            "publish": {"endpoints": [endpoint]},
            "thermal": {"enabled": False},
        },
    )
    for said in refused_by_check_and_run(config, endpoint, "--no-bind"):
        assert "inspect.roi [40, 30, 220, 200] does not fit in a 200x150 frame" in said and "Traceback" not in said
