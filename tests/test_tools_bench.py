"""edged bench: the harness's behaviour and its cross-checks, not the speed of this machine."""

from __future__ import annotations

import io
import itertools
import json
import logging
import math
import os
import signal
import subprocess
from collections import Counter
from collections.abc import Callable
from contextlib import redirect_stdout, suppress
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import zmq
from allocations import NumpyAllocations
from daemon import edged_command
from onnx_models import colour_probe
from waiting import wait_for

from edged.cli import main
from edged.config import load_config
from edged.errors import EXIT_CONFIG, EXIT_USAGE
from edged.messages import DetectionsMessage
from edged.tools.bench import cold_start, engine_variants, soak
from edged.tools.bench_cameras import camera_ids, format_rows, source_table
from edged.tools.bench_config import write_config
from edged.tools.bench_rows import MASKS, STAGES, FullPath, Row, TimedFrame, bench_frame, interleave, load, naive_detect

pytestmark = pytest.mark.tools

DEMO_MODEL = Path(__file__).parent.parent / "models" / "demo.onnx"
QUICK = ["--frames", "4", "--warmup", "2", "--cpu-frames", "3", "--alloc-frames", "3"]


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return colour_probe(tmp_path_factory.mktemp("probe") / "probe.onnx")


@pytest.fixture(scope="module")
def report(probe: Path) -> dict[str, Any]:
    """What `edged bench --json` prints for the probe model."""
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["bench", "--model", str(probe), *QUICK, "--json"]) == 0
    result: dict[str, Any] = json.loads(out.getvalue())
    return result


def test_interleaved_rows_take_turns_in_every_order() -> None:
    """Each row follows each other one equally often: a row right after one running the same code
    finds it warm, and a fixed order gave one row that advantage at every frame."""
    ran: list[str] = []

    def row(name: str) -> Row:
        return lambda: ran.append(name) or TimedFrame(0.0)

    samples = interleave({name: row(name) for name in "abcd"}, frames=24, warmup=0)
    assert [len(timed) for timed in samples.values()] == [24] * 4
    rounds = [ran[i : i + 4] for i in range(0, len(ran), 4)]
    assert all(sorted(r) == list("abcd") for r in rounds)
    follows = Counter(pair for r in rounds for pair in itertools.pairwise(r))
    assert len(follows) == 12 and set(follows.values()) == {6}


def test_report_has_every_row_with_latency_and_cpu(report: dict[str, Any]) -> None:
    (run,) = report["runs"]
    assert set(run["rows"]) == {"floor", "full", "viewer", "naive"}
    for row in run["rows"].values():
        assert 0 < row["latency"]["median_ms"] <= row["latency"]["p99_ms"]
        assert row["cpu_ms_per_frame"] >= 0 and row["cores_busy"] >= 0
    assert set(run["rows"]["full"]["stages"]) == set(STAGES)
    assert run["rows"]["floor"]["stages"] == {} and run["rows"]["naive"]["stages"] == {}
    assert run["spinning"] == "during-run"  # the config's default
    assert run["messages_received"] > 0 and run["messages_sent"] >= run["messages_received"]
    assert set(run["rows"]["viewer"]["stages"]) == set(STAGES)
    assert run["view_frames_encoded"] > 0  # the watched row really fed the live view


def test_ratios_and_overhead_come_from_the_medians(report: dict[str, Any]) -> None:
    (run,) = report["runs"]
    floor, full, naive = (run["rows"][k]["latency"]["median_ms"] for k in ("floor", "full", "naive"))
    assert run["full_over_floor"] == pytest.approx(full / floor)
    assert run["naive_over_floor"] == pytest.approx(naive / floor)
    assert run["overhead_ms"] == pytest.approx(full - floor)
    assert math.isfinite(run["paired_overhead_ms"])


def test_report_states_machine_model_settings_and_memory(report: dict[str, Any]) -> None:
    assert report["machine"]["onnxruntime"] == ort.__version__
    assert report["machine"]["logical_cores"] >= 1 and report["machine"]["loadavg_end"] >= 0
    model = report["model"]
    assert model["provider"] == "CPUExecutionProvider" and model["kind"] == "model file"
    assert model["input"] == [1, 3, 64, 64] and model["output"] == [1, 6, 8]
    assert report["settings"]["frames"] == 4 and report["settings"]["cpu_frames"] == 3
    assert report["allocations"]["frames"] == 3 and report["allocations"]["transient_peak_bytes"] >= 0
    assert "heap_blocks" in report["allocations"] and "heap_bytes" in report["allocations"]
    assert report["verdict"]["detections"] == 100 and 0 < report["verdict"]["median_ms"] <= report["verdict"]["p99_ms"]
    assert report["peak_rss_kb"] > 0


def test_naive_reference_agrees_with_edged_on_the_probe(report: dict[str, Any]) -> None:
    assert report["naive_skipped"] is None
    assert report["detections_match"] is True


def test_the_full_path_publishes_the_daemons_message(probe: Path) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        with FullPath(load(probe, spinning="off"), bench_frame()) as full:
            sub.connect(full.publisher.endpoints[0])
            while not sub.poll(10):  # until the connection is up, frames go nowhere
                full()
            topic, payload = sub.recv_multipart()
    finally:
        sub.close(linger=0)
        context.term()
    message = DetectionsMessage.model_validate_json(payload)
    assert topic == b"edged/detections/cam0"
    assert message.frame_size == (1280, 720) and message.input_size == (64, 64)
    assert [d.label for d in message.detections] == ["red"] and message.model.name == probe.stem


def _numpy_buffers_per_frame(full: FullPath, frames: int) -> dict[str, int]:
    """numpy buffers created by each stage over ``frames`` frames, the stages called one by one."""
    counter = NumpyAllocations.get()
    assert counter is not None
    plan = full.plan
    steps: dict[str, Callable[[], object]] = {
        "preprocess": lambda: plan.preprocess(full.image),
        "inference": plan.binding.run,
        "decode": lambda: plan.decoder.decode(plan.output, plan.box_map),
        "frame": full,
    }
    for _ in range(20):
        full()
    buffers = dict.fromkeys(steps, 0)
    with counter.counting():
        for _ in range(frames):
            for name, step in steps.items():
                before = counter.buffers
                step()
                buffers[name] += counter.buffers - before
    # "frame" is the whole full path; what it adds beyond the three stages is publishing.
    buffers["publish"] = buffers["frame"] - buffers["preprocess"] - buffers["inference"] - buffers["decode"]
    buffers["total"] = buffers.pop("frame")
    return buffers


@pytest.mark.parametrize("model", ["probe", "demo"])
def test_the_full_path_creates_no_numpy_array_per_frame(model: str, probe: Path) -> None:
    with FullPath(load(probe if model == "probe" else DEMO_MODEL, spinning="off"), bench_frame()) as full:
        assert _numpy_buffers_per_frame(full, 5) == {"preprocess": 0, "inference": 0, "decode": 0, "publish": 0, "total": 0}


def test_json_output_is_one_object_with_the_table_figures(probe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--model", str(probe), "--frames", "3", "--warmup", "1", "--cpu-frames", "2", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    run = report["runs"][0]
    assert run["full_over_floor"] == pytest.approx(
        run["rows"]["full"]["latency"]["median_ms"] / run["rows"]["floor"]["latency"]["median_ms"]
    )
    assert report["settings"]["alloc_frames"] == 100 and report["settings"]["cpu_frames"] == 2


def test_too_few_frames_for_the_figures_to_mean_much_are_said(
    probe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`edged bench --frames 20` printed a median and p99 of 20 frames as it would of 300, saying
    nothing: a p99 of fewer than 100 samples is the slowest frame or two."""
    quick = ["bench", "--model", str(probe), "--warmup", "1", "--cpu-frames", "3", "--alloc-frames", "3"]
    assert main([*quick, "--frames", "20"]) == 0
    table = capsys.readouterr()
    assert "2 edged full path" in table.out
    assert [line for line in table.err.splitlines() if "too few" in line] == [
        "edged bench: --frames 20 is too few for these figures to mean much: a p99 of fewer than 100 samples is "
        "the slowest one or two, and medians move from run to run; give --frames 100 or more"
    ]
    assert main([*quick, "--frames", "20", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["few_frames"].startswith("--frames 20 is too few")
    assert main([*quick, "--frames", "100", "--json"]) == 0
    enough = capsys.readouterr()
    assert json.loads(enough.out)["few_frames"] is None and "too few" not in enough.err
    # The journal's latencies are percentiles over --frames entries too; a soak's are over its own frames.
    assert (
        main(["bench", "--journal", "--frames", "5", "--camera-fps", "200", "--journal-dir", str(tmp_path), "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["few_frames"].startswith("--frames 5 is too few")
    assert main(["bench", "--model", str(probe), "--soak", "5", "--frames", "5", "--json"]) == 0
    soaked = capsys.readouterr()
    assert "few_frames" not in json.loads(soaked.out) and "too few" not in soaked.err


def test_table_output_names_the_spinning_setting_and_threads(probe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--model", str(probe), *QUICK, "--spinning", "off", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "spinning off" in out and "inference threads 1, as configured" in out
    assert "full/floor" in out and "2 edged full path" in out and "agree" in out and "peak RSS" in out


def test_every_spinning_setting_in_one_run_is_not_an_option(probe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["bench", "--model", str(probe), "--spinning", "all"])
    assert stopped.value.code == EXIT_USAGE and "invalid choice: 'all'" in capsys.readouterr().err


def test_a_missing_model_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--model", str(tmp_path / "none.onnx")]) == EXIT_CONFIG
    assert "does not exist" in capsys.readouterr().err


def test_thread_count_out_of_range_is_a_usage_error(probe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--model", str(probe), "--threads", "-1"]) == EXIT_USAGE
    assert "--threads must be 0 (one per physical core) to 256, got -1" in capsys.readouterr().err


def test_naive_reference_finds_the_same_detections_as_edged() -> None:
    model = load(DEMO_MODEL, spinning="off", conf=0.1)  # a low conf: more candidates for NMS
    with FullPath(model, bench_frame()) as full:
        for index in range(3):
            full.image = np.ascontiguousarray(np.roll(bench_frame(), 97 * index, axis=1))
            mine = full.process().result
            xyxy, scores, class_ids = naive_detect(model, full.image)
            order, theirs = np.argsort(-mine.scores, kind="stable"), np.argsort(-scores, kind="stable")
            assert len(mine) == len(scores) > 0
            np.testing.assert_array_equal(mine.class_ids[order], class_ids[theirs])
            np.testing.assert_allclose(mine.xyxy[order], xyxy[theirs], atol=0.05)
            np.testing.assert_allclose(mine.scores[order], scores[theirs], atol=1e-4)


def test_soak_returns_rss_and_traced_samples(probe: Path) -> None:
    result = soak(load(probe, spinning="off"), 20, images=[bench_frame()], samples=4, warmup=2)
    assert [frame for frame, _, _ in result["samples"]] == [0, 5, 10, 15, 20]
    assert all(rss > 0 for _, rss, _ in result["samples"])
    assert math.isfinite(result["rss_slope_kb_per_1000"]) and math.isfinite(result["traced_slope_kb_per_1000"])
    assert result["median_ms"] > 0


def test_soak_from_the_command_prints_each_sample_and_the_slopes(probe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--model", str(probe), "--soak", "20"]) == 0
    out = capsys.readouterr().out
    assert out.count("  frame ") == 11 and "RSS slope after warm-up" in out and "full path under tracemalloc" in out


def test_the_soak_runs_each_engine_and_precision_and_the_int8_rows_on_the_quantised_model(
    probe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # OpenVINO allocates in its own heap, which only RSS sees: each engine is soaked as it runs.
    pytest.importorskip("openvino", reason="the openvino package (edged[openvino]) is not installed")
    int8 = _quantised(probe, tmp_path / "probe.int8.onnx")
    argv = ["bench", "--model", str(probe), "--soak", "20", "--engine", "onnxruntime,openvino", "--precision", "f32,int8"]
    assert main([*argv, "--int8", str(int8), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["soak"]
    assert [(r["engine"], r["precision"], r["model"], r["provider"]) for r in rows] == [
        ("onnxruntime", "f32", "probe.onnx", "CPUExecutionProvider"),
        ("onnxruntime", "int8", "probe.int8.onnx", "CPUExecutionProvider"),
        ("openvino", "f32", "probe.onnx", "OpenVINO CPU"),
        ("openvino", "int8", "probe.int8.onnx", "OpenVINO CPU"),
    ]
    assert all(len(r["samples"]) == 11 and r["median_ms"] > 0 for r in rows)


def test_cold_start_times_the_real_daemon_with_and_without_its_cache(probe: Path) -> None:
    (result,) = cold_start(probe, trials=1, spinning="during-run", sources=("images",))
    assert result["source"] == "images"
    assert len(result["without_cache_s"]) == len(result["with_cache_s"]) == 1
    assert 0 < result["with_cache_median_s"] < 60 and 0 < result["without_cache_median_s"] < 60
    assert len(result["first_seq"]) == 2  # the seq of each first message, both runs


@pytest.mark.parametrize("kind", ["synthetic", "video"])
def test_cameras_compares_one_process_with_a_process_per_camera(probe: Path, kind: str) -> None:
    out = io.StringIO()
    argv = ["bench", "--model", str(probe), "--cameras", "2", "--camera-source", kind, "--seconds", "2", "--warmup-s", "0.5"]
    argv += ["--repeat", "2", "--seconds", "1"] if kind == "synthetic" else []  # the same time measured, twice
    with redirect_stdout(out):
        code = main([*argv, "--json"])
    assert code == 0
    result = json.loads(out.getvalue())["cameras"]
    assert result["kind"] == kind and all(row["camera_kind"] == kind for row in result["rows"])
    repeat = 2 if kind == "synthetic" else 1
    assert result["repeat"] == repeat and [row["run"] for row in result["rows"]] == [r for r in range(repeat) for _ in "ab"]
    one, separate = result["rows"][-2:]
    assert (one["arrangement"], one["processes"], separate["arrangement"], separate["processes"]) == (
        "one process",
        1,
        "separate processes",
        2,
    )
    for row in (one, separate):
        assert set(row["cameras_fps"]) == {"cam0", "cam1"} and all(fps > 0 for fps in row["cameras_fps"].values())
        assert row["fps_total"] == pytest.approx(sum(row["cameras_fps"].values()))
        assert all(0 < row["age_p50_ms"][c] <= row["age_p99_ms"][c] for c in ("cam0", "cam1"))
        assert row["cpu_s_per_frame"] > 0 and 0 < row["pss_mb"] <= row["rss_mb"]
    assert separate["rss_mb"] > one["rss_mb"]  # two interpreters and sessions against one


def _row(run: int, arrangement: str, p99: float, fps: float) -> dict:
    return {
        "run": run,
        "cameras": 2,
        "arrangement": arrangement,
        "fps_total": fps,
        "age_p50_ms": {"cam0": p99 / 2, "cam1": None},
        "age_p99_ms": {"cam0": p99, "cam1": p99 - 5},
        "cpu_s_per_frame": 0.02,
        "rss_mb": 100.0,
        "pss_mb": 80.0,
    }


def test_repeated_camera_runs_are_reported_as_medians_with_the_range_of_the_worst_p99() -> None:
    rows = [_row(run, "one process", p99, 20.0) for run, p99 in enumerate((30.0, 50.0, 40.0))]
    rows += [
        _row(run, "separate processes", p99, fps)
        for run, (p99, fps) in enumerate(((20.0, 19.0), (60.0, 20.0), (25.0, 18.0)))
    ]
    table = format_rows("m.onnx", "video", 10.0, rows)
    assert "MJPG video 1280x720 cameras at 10 fps each, median of 3 runs" in table
    one, separate = table.splitlines()[-2:]
    assert one.split() == ["2", "one", "process", "20.0", "20.0", "40.0", "[30-50]", "20.0", "100", "80"]
    assert separate.split() == ["2", "separate", "processes", "19.0", "12.5", "25.0", "[20-60]", "20.0", "100", "80"]
    single = format_rows("m.onnx", "video", 10.0, rows[:1])
    assert "median" not in single and "[" not in single.splitlines()[-1]


def test_a_bench_config_loads_as_edged_run_reads_it_with_every_camera_and_the_benchs_settings(
    probe: Path, tmp_path: Path
) -> None:
    tables = "".join(source_table(name, "synthetic", 15.0, tmp_path) for name in camera_ids(2))
    endpoint = f"ipc://{tmp_path}/bench.sock"
    settings = load_config(write_config(tmp_path / "cameras.toml", probe, endpoint, tables, spinning="off", thermal=False))
    assert [(cfg.camera_id, cfg.type, cfg.fps) for cfg in settings.source] == [
        ("cam0", "synthetic", 15.0),
        ("cam1", "synthetic", 15.0),
    ]
    assert settings.model.path == probe.resolve() and list(settings.publish.endpoints) == [endpoint]
    assert settings.runtime.spinning == "off" and settings.runtime.optimized_model_path is None
    assert not settings.thermal.enabled and settings.http.listen == "" and settings.service.log_level == "warning"

    one = '[source]\ntype = "synthetic"\nfps = 30\n'
    cache = tmp_path / "optimized.onnx"
    settings = load_config(write_config(tmp_path / "cold.toml", probe, endpoint, one, spinning="during-run", cache=cache))
    assert len(settings.source) == 1 and settings.runtime.optimized_model_path == cache
    assert settings.thermal.enabled  # edged's default, as a deployed daemon starts


def test_the_journal_bench_times_offer_and_commit_under_each_durability(tmp_path: Path) -> None:
    from edged.tools.bench_journal import format_journal, run_journal_bench

    rows = run_journal_bench(tmp_path, entries=20, fps=200.0)
    assert [r["durability"] for r in rows] == ["normal", "full"]
    for r in rows:
        assert r["recorded"] == 20 and r["errors"] == 0
        assert 0 < r["offer_us"]["p50"] <= r["offer_us"]["p99"]
        assert 0 < r["to_disk_ms"]["p50"] <= r["to_disk_ms"]["p99"] <= r["to_disk_ms"]["max"]
    assert "offer to commit" in format_journal(rows, tmp_path)
    assert list(tmp_path.iterdir()) == []  # its scratch files are gone


def test_the_reject_bench_fires_every_part_and_times_its_pulses() -> None:
    from edged.tools.bench_reject import format_reject, reject_lateness

    row = reject_lateness(None, "idle", 20)
    assert row["line"] == "recording" and row["pulses"] + row["merged"] == 20 and row["pulses"] >= 1
    late = row["lateness_ms"]
    assert 0 <= late["p50"] <= late["p99"] <= late["max"]
    assert "pulse start minus target" in format_reject([row])


def test_engine_variants_pair_each_engine_with_the_precisions_it_can_be_asked_for() -> None:
    variants, skipped = engine_variants(["onnxruntime", "openvino"], ["f32", "bf16", "int8"])
    assert variants == [
        ("onnxruntime", "f32"),
        ("onnxruntime", "int8"),
        ("openvino", "f32"),
        ("openvino", "bf16"),
        ("openvino", "int8"),
    ]
    assert skipped == ["onnxruntime bf16: it runs f32 or int8 (the graph's own types)"]


def test_an_engine_or_precision_that_does_not_exist_is_a_usage_error(
    probe: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["bench", "--model", str(probe), "--engine", "onnxruntime,tensorflow"])
    assert (
        stopped.value.code == EXIT_USAGE and "tensorflow given; choose from onnxruntime, openvino" in capsys.readouterr().err
    )
    assert main(["bench", "--model", str(probe), "--precision", "bf16"]) == EXIT_USAGE
    assert "no engine runs these precisions: onnxruntime bf16" in capsys.readouterr().err


def test_engines_and_precisions_run_side_by_side_in_one_run(probe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("openvino", reason="the openvino package (edged[openvino]) is not installed")
    argv = ["bench", "--model", str(probe), *QUICK, "--engine", "onnxruntime,openvino", "--precision", "f32,int8"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ran = [(r["model"]["engine"], r["model"]["precision"], r["model"]["provider"]) for r in result["variants"]]
    assert ran == [("onnxruntime", "f32", "CPUExecutionProvider"), ("openvino", "f32", "OpenVINO CPU")]
    assert [reason.split(":")[0] for reason in result["skipped"]] == ["onnxruntime int8", "openvino int8"]
    assert all("is not quantised" in reason for reason in result["skipped"])
    for r in result["variants"]:
        assert r["runs"][0]["rows"]["floor"]["latency"]["median_ms"] > 0 and r["detections_match"] is True
    assert main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[3].split()[:2] == ["engine", "precision"]
    assert [line.split()[:2] for line in table[4:6]] == [["onnxruntime", "f32"], ["openvino", "f32"]]
    assert table[6].startswith("skipped: onnxruntime int8: ")


def _quantised(probe: Path, out: Path) -> Path:
    """The probe with a QuantizeLinear/DequantizeLinear pair on its pixels: quantised, and exact (scale 1)."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(probe)
    graph = model.graph
    cast = next(n for n in graph.node if n.op_type == "Cast")
    cast.output[0] = "x_float"
    graph.initializer.extend(
        [
            helper.make_tensor("q_scale", TensorProto.FLOAT, [], [1.0]),
            helper.make_tensor("q_zero", TensorProto.UINT8, [], [0]),
        ]
    )
    at = list(graph.node).index(cast) + 1
    graph.node.insert(at, helper.make_node("QuantizeLinear", ["x_float", "q_scale", "q_zero"], ["x_q"]))
    graph.node.insert(at + 1, helper.make_node("DequantizeLinear", ["x_q", "q_scale", "q_zero"], ["x"]))
    onnx.save(model, out)
    return out


def test_the_int8_rows_run_the_quantised_model_beside_the_float_models_rows(
    probe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    int8 = _quantised(probe, tmp_path / "probe.int8.onnx")
    argv = ["bench", "--model", str(probe), *QUICK, "--precision", "f32,int8", "--int8", str(int8)]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ran = [(r["model"]["name"], r["model"]["precision"]) for r in result["variants"]]
    assert ran == [("probe", "f32"), ("probe.int8", "int8")] and result["skipped"] == []
    assert main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[2] == "  int8 rows: probe.int8, input [1, 3, 64, 64]"
    assert table[4].split()[9] == "speed-up"
    float_row, int8_row = (line.split() for line in table[5:7])
    assert float_row[:2] == ["onnxruntime", "f32"] and float_row[-2] == "1.00x"
    # The table shows milliseconds to 3 places and the ratio of the unrounded ones to 2.
    f32, int8_ms, shown = float(float_row[4]), float(int8_row[4]), float(int8_row[-2].removesuffix("x"))
    lowest, highest = (f32 - 5e-4) / (int8_ms + 5e-4), (f32 + 5e-4) / (int8_ms - 5e-4)
    assert int8_row[:2] == ["onnxruntime", "int8"] and lowest - 5e-3 <= shown <= highest + 5e-3
    assert main(["bench", "--model", str(probe), "--int8", str(int8)]) == EXIT_USAGE
    assert "--precision asks for none: add int8" in capsys.readouterr().err


def test_the_int8_cold_start_runs_the_quantised_model(
    probe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    int8 = _quantised(probe, tmp_path / "probe.int8.onnx")
    argv = ["bench", "--model", str(probe), "--cold-start", "--cold-runs", "1", "--precision", "int8", "--int8", str(int8)]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["cold_start"]
    assert {(r["engine"], r["precision"]) for r in rows} == {("onnxruntime", "int8")} and len(rows) == 2
    assert all(0 < r["with_cache_median_s"] < 60 for r in rows)


def test_cold_start_on_openvino_writes_and_then_loads_its_compiled_model_cache(probe: Path) -> None:
    pytest.importorskip("openvino", reason="the openvino package (edged[openvino]) is not installed")
    (result,) = cold_start(probe, trials=1, spinning="during-run", sources=("images",), engine="openvino")
    assert (result["engine"], result["precision"]) == ("openvino", "f32")
    assert 0 < result["with_cache_median_s"] < 60 and 0 < result["without_cache_median_s"] < 60


def test_the_opcua_bench_times_capture_to_node_update_and_to_a_subscriber(caplog: pytest.LogCaptureFixture) -> None:
    from edged.tools.bench_opcua import format_opcua, opcua_latency
    from edged.tools.bench_rows import resolve_model

    caplog.set_level(logging.WARNING, "asyncua")
    r = opcua_latency(resolve_model(None), verdicts=15, fps=10.0, spinning="off")
    assert not caplog.records  # its client asks for no more than the server grants: no warning amid the figures
    assert r["verdicts"] >= 15 and r["dropped"] == 0
    assert 0 < r["update_ms"]["p50"] <= r["update_ms"]["p99"]
    assert 0 < r["notified_ms"]["p50"] <= r["notified_ms"]["p99"] <= r["notified_ms"]["max"]
    assert "capture to node update" in format_opcua(r) and "capture to notification" in format_opcua(r)


def test_a_segmentation_model_has_its_masks_timed_within_decode() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["bench", "--model", str(Path(__file__).parent / "data" / "tasks" / "seg.onnx"), *QUICK, "--json"]) == 0
    (run,) = json.loads(out.getvalue())["runs"]
    stages = run["rows"]["full"]["stages"]
    assert list(stages) == ["preprocess", "inference", "decode", MASKS, "publish", "view"]
    assert 0 < stages[MASKS]["median_ms"] <= stages["decode"]["median_ms"]


def test_the_modbus_bench_times_capture_to_the_registers_on_the_real_daemon(
    probe: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--modbus", "--model", str(probe), "--frames", "10", "--camera-fps", "20", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["modbus"]
    assert result["verdicts"] == 10 and result["reads"] >= 10
    register, seen = result["capture_to_register_ms"], result["capture_to_client_read_ms"]
    assert 0 < register["p50"] <= register["p99"] <= register["max"]
    assert seen is not None and 0 < seen["p50"] <= seen["p99"]
    assert main(["bench", "--modbus", "--model", str(probe), "--frames", "3", "--camera-fps", "20"]) == 0
    assert "capture to register update p50" in capsys.readouterr().out


def test_the_modbus_abuse_bench_measures_the_rate_quiet_and_while_clients_misbehave(
    probe: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "--modbus", "--abuse", "--abuse-s", "3", "--model", str(probe), "--camera-fps", "20"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["modbus_abuse"]
    from edged.tools.bench_modbus_abuse import format_modbus_abuse

    assert [line.split()[0] for line in format_modbus_abuse(result).splitlines()[:4]] == [
        "modbus",
        "quiet",
        "abuse",
        "quiet",
    ]
    assert list(result["phases"]) == ["quiet", "abuse", "quiet after"]
    assert all(phase["frames"] > 0 for phase in result["phases"].values())
    assert result["change_pct"] is not None and isinstance(result["within_target"], bool)
    abusers, server = result["abusers"], result["server"]
    assert abusers["held_opened"] + abusers["held_failed"] == 200
    assert server["peak_clients"] == 64 and server["refused"] > 0  # held past max_connections: the rest closed
    assert abusers["malformed"]["sent"] > 0 and abusers["never_reads"]["sent"] > 0
    assert abusers["unknown_function"]["answered"] > 0 and server["exceptions"] > 0  # answered, as exceptions


def test_the_opcua_abuse_bench_measures_the_rate_quiet_and_with_fifty_sessions_open(
    probe: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "--opcua", "--abuse", "--abuse-s", "3", "--model", str(probe), "--camera-fps", "20"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["opcua_abuse"]
    from edged.tools.bench_opcua_abuse import format_opcua_abuse

    said = format_opcua_abuse(result).splitlines()
    assert [line.split()[0] for line in said[:4]] == ["opcua", "quiet", "abuse", "quiet"]
    assert list(result["phases"]) == ["quiet", "abuse", "quiet after"]
    assert all(phase["frames"] > 0 for phase in result["phases"].values())
    assert result["change_pct"] is not None and isinstance(result["within_target"], bool)
    abusers = result["abusers"]
    assert abusers["sessions_opened"] + abusers["sessions_failed"] == 50
    assert abusers["silent_subscriber_nodes"] > 0
    assert result["server"]["peak_clients"] >= 2  # the sessions reached the server


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_bench_that_is_stopped_or_killed_leaves_no_edged_run_behind(probe: Path, signum: int, tmp_path: Path) -> None:
    argv = ["bench", "--model", str(probe), "--cameras", "2", "--seconds", "120", "--warmup-s", "0"]
    # With faulthandler, a bench that outlives its SIGTERM is sent SIGABRT and prints every thread's stack;
    # the configurations it writes are the test's to remove (SIGKILL leaves them).
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "TMPDIR": str(tmp_path)}
    with (tmp_path / "bench.err").open("w") as stderr:
        bench = subprocess.Popen(edged_command(*argv), stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    try:
        children = Path(f"/proc/{bench.pid}/task/{bench.pid}/children")

        def runs() -> list[int]:
            """The bench's children that are ``edged run``s by now (past their exec)."""
            found = []
            for pid in children.read_text().split():
                with suppress(OSError):
                    if b"\0run\0" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        found.append(int(pid))
            return found

        assert wait_for(lambda: bool(runs()), timeout_s=60), "bench started no edged run"
        started = runs()
        bench.send_signal(signum)
        try:
            code = bench.wait(30)
        except subprocess.TimeoutExpired:
            bench.send_signal(signal.SIGABRT)
            bench.wait(30)
            pytest.fail(f"the bench ran on 30 s after the signal:\n{(tmp_path / 'bench.err').read_text()}")
        assert code == (128 + signum if signum == signal.SIGTERM else -signum)
    finally:
        bench.kill()
        bench.wait()
    # Killed (by the bench, or by the kernel when the bench died) and reaped, not left running.
    assert wait_for(lambda: not [pid for pid in started if Path(f"/proc/{pid}").exists()], timeout_s=10)
