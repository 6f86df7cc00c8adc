"""The experiments still measure what they say; run with ``pytest benchmarks`` (not part of the default suite)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import capture_load
import cv2
import decode_demand
import graph_cost
import numpy as np
import onnxruntime as ort
import paced
import pytest
import shadow_trial
import stages_alone
import yolov8n_like
import yolov8n_trained
from onnx_models import colour_probe

from edged.sources.scenes import SceneGenerator
from edged.tools.bench_rows import FullPath, bench_frame, load

pytestmark = pytest.mark.tools

SMALL = 128  # the timing model at 128x128: same layers, 1/25 of the work
SMALL_ANCHORS = sum((SMALL // s) ** 2 for s in (8, 16, 32))


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return colour_probe(tmp_path_factory.mktemp("probe") / "probe.onnx")


@pytest.fixture(scope="module")
def small_yolo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return yolov8n_like.build_yolov8n_like(tmp_path_factory.mktemp("yolo") / "y.onnx", size=SMALL, candidates=40)


def test_yolov8n_builder_has_the_documented_shape_and_cost(small_yolo: Path) -> None:
    session = ort.InferenceSession(str(small_yolo), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == [1, 3, SMALL, SMALL]
    assert session.get_outputs()[0].shape == [1, 84, SMALL_ANCHORS]
    gflops, params = graph_cost.graph_cost(small_yolo)
    assert yolov8n_like.conv_count(small_yolo) == 63  # YOLOv8n: 57 Conv blocks + 6 final head convs
    assert 3.0e6 < params < 3.3e6
    assert gflops == pytest.approx(8.74 * (SMALL / 640) ** 2, rel=0.02)


def test_yolov8n_builder_calibrates_the_candidates_edged_sees(small_yolo: Path) -> None:
    with FullPath(load(small_yolo, spinning="off"), bench_frame()) as full:
        detections = full.process().result
        output = full.plan.output
        assert int((output[0, 4:].max(axis=0) >= 0.25).sum()) == 40
        assert 0 < len(detections) <= 40
        assert np.isfinite(output).all()


def test_the_script_prints_the_cached_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert yolov8n_like.main(["--size", "64", "--candidates", "5", "--cache-dir", str(tmp_path)]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.parent == tmp_path and path.is_file()


def test_the_trained_yolov8ns_crops_label_each_defect_where_the_halved_scene_has_it() -> None:
    scene = SceneGenerator(1280, 720, seed=3).render(7)
    pairs = list(zip(scene.boxes.tolist(), scene.class_ids.tolist(), strict=True))
    crops = yolov8n_trained._crops(scene.image, pairs, np.random.default_rng(0))
    assert [image.shape for image, _ in crops] == [(320, 320, 3)] * 2
    half = cv2.resize(scene.image, None, fx=0.5, fy=0.5, interpolation=cv2.INTER_LINEAR)
    labelled = 0
    for (image, lines), x0 in zip(crops, (0, 640 - 320), strict=True):
        y0 = next(y for y in range(360 - 320 + 1) if np.array_equal(half[y : y + 320, x0 : x0 + 320], image))
        inside = [
            (c, (x1 / 2 - x0, y1 / 2 - y0, x2 / 2 - x0, y2 / 2 - y0))
            for (x1, y1, x2, y2), c in pairs
            if x1 / 2 - x0 >= 0 and y1 / 2 - y0 >= 0 and x2 / 2 - x0 <= 320 and y2 / 2 - y0 <= 320
        ]
        got = [(int(c), *(float(v) * 320 for v in rest)) for c, *rest in (line.split() for line in lines)]
        for c, (bx1, by1, bx2, by2) in inside:  # a defect wholly inside the crop keeps its class and box
            assert any(
                g[0] == c
                and abs(g[1] - (bx1 + bx2) / 2) < 0.01
                and abs(g[3] - (bx2 - bx1)) < 0.01
                and abs(g[2] - (by1 + by2) / 2) < 0.01
                and abs(g[4] - (by2 - by1)) < 0.01
                for g in got
            ), (c, got)
        assert all(0 <= v <= 320 for g in got for v in g[1:])
        labelled += len(inside)
    assert labelled > 0


def test_graph_cost_counts_the_demo_models_work(capsys: pytest.CaptureFixture[str]) -> None:
    assert graph_cost.main(["--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["gflops"] == pytest.approx(0.75, abs=0.01) and figures["params"] == 856290


def test_stages_alone_times_preprocess_and_decode_on_the_bench_frame(
    probe: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert stages_alone.main(["--model", str(probe), "--frames", "4", "--warmup", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["input_size"] == [64, 64] and r["frame_size"] == [1280, 720]
    assert r["candidates"] == 1 and r["detections"] == 1 and r["anchors"] == 8
    assert 0 < r["preprocess"]["median_ms"] <= r["preprocess"]["p99_ms"] and r["decode"]["median_ms"] > 0
    assert stages_alone.main(["--model", str(probe), "--frames", "4"]) == 0
    assert "stages alone on probe.onnx: preprocess 1280x720 -> 64x64" in capsys.readouterr().out


def test_capture_load_times_both_rows_beside_a_real_capture_thread(
    probe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(probe), "--frames", "6", "--warmup", "1", "--cache-dir", str(tmp_path), "--json"]
    assert capture_load.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["capture"] for r in rows] == ["none", "normal", "low", "idle", "clock-fed", "camera-fed"]
    assert all(r["floor"]["median_ms"] > 0 for r in rows[:-2]) and rows[-2]["floor"] is rows[-1]["floor"] is None
    assert all(r["full"]["median_ms"] > r["inference"]["median_ms"] > 0 for r in rows)
    assert rows[0]["decoded_fps"] == rows[-2]["decoded_fps"] == 0 and all(r["decoded_fps"] >= 0 for r in rows[1:])
    # Fed by the capture thread, the full path took frames at the clip's pace, so every one was decoded.
    assert rows[-1]["decoded_fps"] > 10
    video = cv2.VideoCapture(str(tmp_path / "capture-1280x720-mjpg-30fps-v1.avi"), cv2.CAP_FFMPEG)
    try:
        assert (video.get(cv2.CAP_PROP_FRAME_WIDTH), video.get(cv2.CAP_PROP_FRAME_HEIGHT)) == (1280, 720)
        assert video.get(cv2.CAP_PROP_FRAME_COUNT) == 60 and video.get(cv2.CAP_PROP_FPS) == 30
    finally:
        video.release()


def test_decode_demand_reports_both_modes_for_each_consumer_rate(capsys: pytest.CaptureFixture[str]) -> None:
    # What on-demand decoding saves is asserted in test_capture; here, that the script measures both.
    assert decode_demand.main(["--frames", "15", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["consumer_fps"], r["decode"]) for r in rows] == [
        (fps, mode) for fps in (5.0, 15.0, 30.0) for mode in ("every frame", "on demand")
    ]
    for r in rows:
        assert 0 < r["cores"] < 2 and 0 < r["taken_fps"] <= r["decoded_fps"] and r["age_ms"] > 0
        assert 0 <= r["newest"] <= 1
    # Decoding every frame keeps up with the 30 fps camera whatever the consumer takes.
    assert rows[0]["decoded_fps"] > 20 and rows[0]["taken_fps"] < 7


def test_paced_reports_each_spinning_setting(probe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert paced.main(["--model", str(probe), "--fps", "200", "--frames", "10", "--warmup", "1", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert [r["spinning"] for r in runs] == ["off", "during-run", "always"]
    for r in runs:
        assert r["fps"] == 200 and r["latency"]["median_ms"] > 0 and r["cpu_ms_per_frame"] > 0
        # Ten frames 5 ms apart take at least 45 ms, so the share is CPU over real elapsed time.
        assert 0 < r["core_share"] <= (os.cpu_count() or 1)


def test_pace_out_of_range_is_a_usage_error(probe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        paced.main(["--model", str(probe), "--fps", "0"])
    assert stopped.value.code == 2 and "--fps" in capsys.readouterr().err


def test_paced_beside_a_capture_thread(probe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(probe), "--fps", "100", "--frames", "6", "--warmup", "1", "--spinning", "during-run"]
    assert paced.main([*argv, "--capture", "idle", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "capture thread (idle)" in out and "during-run" in out
    assert (tmp_path / "capture-1280x720-mjpg-30fps-v1.avi").is_file()


def test_shadow_trial_compares_runs_and_prints_the_cost_the_trial_measures(capsys: pytest.CaptureFixture[str]) -> None:
    assert shadow_trial.main(["--rounds", "1", "--seconds", "3", "--warm-up", "1", "--case", "scene"]) == 0
    off, on, summary = capsys.readouterr().out.splitlines()
    assert "candidate off" in off and "added frame age" not in off
    assert "candidate on" in on and "live frames delayed" in on and "% of the frame age" in on
    assert "frame age p50" in summary and "attributed added frame age" in summary
