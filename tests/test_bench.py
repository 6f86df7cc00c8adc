"""edged bench: the harness's behaviour and its cross-checks, not the speed of this machine."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import cv2
import numpy as np
import onnxruntime as ort
import pytest
from onnx_models import colour_probe

from edged.bench import add_arguments, run_bench
from edged.bench.cold import cold_start
from edged.bench.memory import NumpyAllocations, soak
from edged.bench.rows import STAGES, FullPath, NaivePath, candidates_above
from edged.bench.run import BenchResult, bench, bench_frame, load
from edged.bench.timing_model import build_yolov8n_like, graph_stats
from edged.errors import EXIT_CONFIG

SMALL = 128  # the timing model at 128x128: same layers, 1/25 of the work
SMALL_ANCHORS = sum((SMALL // s) ** 2 for s in (8, 16, 32))


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return colour_probe(tmp_path_factory.mktemp("probe") / "probe.onnx")


@pytest.fixture(scope="module")
def small_yolo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_yolov8n_like(tmp_path_factory.mktemp("yolo") / "y.onnx", size=SMALL, candidates=40)


@pytest.fixture(scope="module")
def result(probe: Path) -> BenchResult:
    return bench(probe, frames=4, warmup=2, cpu_frames=3, alloc_frames=3)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_result_has_every_row_with_latency_and_cpu(result: BenchResult) -> None:
    (run,) = result.runs
    assert set(run.rows) == {"floor", "full", "naive"}
    for row in run.rows.values():
        assert 0 < row.latency.median_ms <= row.latency.p99_ms
        assert row.cpu_ms_per_frame >= 0
    assert set(run.rows["full"].stages) == set(STAGES)
    assert run.rows["floor"].stages == {}
    assert run.spinning == "during-run"  # the config's default
    assert run.messages_received > 0


def test_ratios_and_overhead_come_from_the_medians(result: BenchResult) -> None:
    (run,) = result.runs
    floor, full, naive = (run.rows[k].latency.median_ms for k in ("floor", "full", "naive"))
    assert run.full_over_floor == pytest.approx(full / floor)
    assert run.naive_over_floor == pytest.approx(naive / floor)
    assert run.overhead_ms == pytest.approx(full - floor)


def test_result_reports_machine_model_stages_and_memory(result: BenchResult) -> None:
    assert result.machine["onnxruntime"] == ort.__version__
    assert result.machine["logical_cores"] >= 1
    assert result.machine["steal_cores"] >= 0 and result.machine["other_cores"] >= 0
    assert result.model["provider"] == "CPUExecutionProvider"
    assert result.model["input"] == [1, 3, 64, 64] and result.model["output"] == [1, 6, 8]
    assert result.model["params"] > 0
    assert result.alone.input_size == (64, 64) and result.alone.frame_size == (1280, 720)
    assert result.alone.candidates == 1 and result.alone.detections == 1
    counts = result.allocations.numpy_buffers
    assert counts is not None and set(counts) == {*STAGES, "total"}
    assert counts == {"preprocess": 0, "inference": 0, "decode": 0, "publish": 0, "total": 0}
    assert result.peak_rss_kb > 0


def test_naive_reference_agrees_with_edged_on_the_probe(result: BenchResult) -> None:
    assert result.naive_skipped is None
    assert result.detections_match is True


def test_json_output_is_one_object_with_the_table_figures(probe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_bench(
        _args("--model", str(probe), "--frames", "3", "--warmup", "1", "--cpu-frames", "2", "--alloc-frames", "2", "--json")
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    run = report["runs"][0]
    assert run["full_over_floor"] == pytest.approx(
        run["rows"]["full"]["latency"]["median_ms"] / run["rows"]["floor"]["latency"]["median_ms"]
    )
    assert report["alone"]["preprocess"]["median_ms"] > 0
    assert report["allocations"]["numpy_buffers"]["total"] == 0


def test_table_output_and_every_spinning_setting(probe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_bench(
        _args(
            "--model",
            str(probe),
            "--frames",
            "3",
            "--warmup",
            "1",
            "--cpu-frames",
            "2",
            "--alloc-frames",
            "2",
            "--spinning",
            "all",
        )
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "spinning off" in out and "spinning during-run" in out and "spinning always" in out
    assert "full/floor" in out and "2 edged full path" in out and "agree" in out


def test_a_missing_model_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(_args("--model", str(tmp_path / "none.onnx"))) == EXIT_CONFIG
    assert "does not exist" in capsys.readouterr().err


def test_yolov8n_builder_has_the_documented_shape_and_cost(small_yolo: Path) -> None:
    session = ort.InferenceSession(str(small_yolo), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == [1, 3, SMALL, SMALL]
    assert session.get_outputs()[0].shape == [1, 84, SMALL_ANCHORS]
    stats = graph_stats(small_yolo)
    assert stats.convs == 63  # YOLOv8n: 57 Conv blocks + 6 final head convs
    assert 3.0e6 < stats.params < 3.3e6
    assert stats.gflops == pytest.approx(8.74 * (SMALL / 640) ** 2, rel=0.02)


def test_yolov8n_builder_calibrates_the_candidates_edged_sees(small_yolo: Path) -> None:
    model = load(small_yolo, spinning="off")
    full = FullPath(model, bench_frame())
    try:
        detections, _ = full.pipeline.process(full.image)
        output = full.pipeline.outputs[0]
        assert candidates_above(model, output) == 40
        assert 0 < len(detections) <= 40
        assert np.isfinite(output).all()
    finally:
        full.close()


def test_naive_reference_finds_the_same_detections_as_edged(small_yolo: Path) -> None:
    model = load(small_yolo, spinning="off")
    full = FullPath(model, bench_frame())
    try:
        for index in range(3):
            image = np.ascontiguousarray(np.roll(bench_frame(), 97 * index, axis=1))
            mine, _ = full.pipeline.process(image)
            xyxy, scores, class_ids = NaivePath(model, image).detect(image)
            order, theirs = np.argsort(-mine.scores, kind="stable"), np.argsort(-scores, kind="stable")
            assert len(mine) == len(scores) > 0
            np.testing.assert_array_equal(mine.class_ids[order], class_ids[theirs])
            np.testing.assert_allclose(mine.xyxy[order], xyxy[theirs], atol=0.05)
            np.testing.assert_allclose(mine.scores[order], scores[theirs], atol=1e-4)
    finally:
        full.close()


def test_numpy_counter_counts_arrays_with_their_own_buffer() -> None:
    counter = NumpyAllocations.get()
    assert counter is not None
    base = np.arange(100.0)
    out = np.empty_like(base)
    with counter.counting():
        start = counter.buffers
        fresh = base * base
        view = base[10:20]
        np.multiply(base, base, out=out)
        counted = counter.buffers - start
    assert counted == 1
    assert fresh.sum() == out.sum() and view.base is base


def test_soak_returns_rss_and_traced_samples(probe: Path) -> None:
    model = load(probe, spinning="off")
    result = soak(model, 20, images=[bench_frame()], samples=4, warmup=2)
    assert [frame for frame, _, _ in result.samples] == [0, 5, 10, 15, 20]
    assert all(rss > 0 for _, rss, _ in result.samples)
    assert math.isfinite(result.rss_slope_kb_per_1000) and math.isfinite(result.traced_slope_kb_per_1000)
    assert result.median_ms > 0


def test_cold_start_times_the_real_daemon_with_and_without_its_cache(probe: Path) -> None:
    (result,) = cold_start(probe, trials=1, sources=("images",))
    assert result.source == "images"
    assert len(result.without_cache_s) == len(result.with_cache_s) == 1
    assert 0 < result.with_cache_median_s < 60 and 0 < result.without_cache_median_s < 60


def test_capture_load_times_both_rows_beside_a_real_capture_thread(
    probe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run_bench(
        _args(
            "--model", str(probe), "--capture-load", "--frames", "6", "--warmup", "1", "--cache-dir", str(tmp_path), "--json"
        )
    )
    assert code == 0
    rows = json.loads(capsys.readouterr().out)["capture_load"]
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


def test_decode_demand_reports_both_modes_for_each_consumer_rate(probe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # What on-demand decoding saves is asserted in test_capture; here, that the bench measures both.
    code = run_bench(_args("--model", str(probe), "--decode-demand", "--frames", "15", "--json"))
    assert code == 0
    rows = json.loads(capsys.readouterr().out)["decode_demand"]
    assert [(r["consumer_fps"], r["decode"]) for r in rows] == [
        (fps, mode) for fps in (5.0, 15.0, 30.0) for mode in ("every frame", "on demand")
    ]
    for r in rows:
        assert 0 < r["cores"] < 2 and 0 < r["taken_fps"] <= r["decoded_fps"] and r["age_ms"] > 0
        assert 0 <= r["newest"] <= 1
    # Decoding every frame keeps up with the 30 fps camera whatever the consumer takes.
    assert rows[0]["decoded_fps"] > 20 and rows[0]["taken_fps"] < 7


def test_paced_reports_each_spinning_setting(probe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_bench(
        _args("--model", str(probe), "--pace", "200", "--frames", "10", "--warmup", "1", "--spinning", "all", "--json")
    )
    assert code == 0
    runs = json.loads(capsys.readouterr().out)["paced"]
    assert [r["spinning"] for r in runs] == ["off", "during-run", "always"]
    for r in runs:
        assert r["fps"] == 200 and r["latency"]["median_ms"] > 0 and r["cpu_ms_per_frame"] > 0
        # Ten frames 5 ms apart take at least 45 ms, so the share is CPU over real elapsed time.
        assert 0 < r["core_share"] <= (os.cpu_count() or 1)


def test_pace_out_of_range_is_a_usage_error(probe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(_args("--model", str(probe), "--pace", "0")) == EXIT_CONFIG
    assert "--pace" in capsys.readouterr().err


def test_pace_capture_without_pace_is_a_usage_error(probe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(_args("--model", str(probe), "--pace-capture", "low")) == EXIT_CONFIG
    assert "--pace-capture only applies with --pace" in capsys.readouterr().err


def test_thread_count_out_of_range_is_a_usage_error(probe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(_args("--model", str(probe), "--threads", "-1")) == EXIT_CONFIG
    assert "--threads must be 0 (one per physical core) to 256, got -1" in capsys.readouterr().err


def test_paced_beside_a_capture_thread(probe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_bench(
        _args(
            "--model",
            str(probe),
            "--pace",
            "100",
            "--frames",
            "6",
            "--warmup",
            "1",
            "--pace-capture",
            "idle",
            "--cache-dir",
            str(tmp_path),
        )
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "capture thread (idle)" in out and "during-run" in out
    assert (tmp_path / "capture-1280x720-mjpg-30fps-v1.avi").is_file()
