"""``edged bench``: what edged's per-frame path costs over bare inference, on this machine.

The rows (floor, full path, naive reference, `edged.tools.bench_rows`) run interleaved after a
warm-up on one 1280x720 scene, all on the engine's one session; medians and p99 come from the
interleaved samples, CPU time per frame from a block per row, since process CPU time cannot be
split between interleaved rows. ``--soak`` and ``--cold-start`` measure whole runs instead. The
report is a table, or one JSON object with ``--json``. ``--cameras`` compares one process serving
several cameras with a process per camera (`edged.tools.bench_cameras`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import cv2
import numpy as np
import onnxruntime as ort
import zmq

from edged.config import ORT_PRECISIONS, EngineName, Precision, Spinning, check_thread_option
from edged.cpus import online_cpus, physical_cores
from edged.errors import ColdStartError, ConfigError, SetupError, UsageError
from edged.model import LoadedModel
from edged.sources.scenes import SceneGenerator
from edged.tools import bench_process
from edged.tools import bench_rows as rows
from edged.tools.bench_cameras import CameraKind, format_rows, run_cameras
from edged.tools.bench_config import write_config
from edged.tools.bench_journal import format_journal, run_journal_bench
from edged.tools.bench_modbus import format_modbus, run_modbus_bench
from edged.tools.bench_modbus_abuse import format_modbus_abuse, run_modbus_abuse_bench
from edged.tools.bench_reject import format_reject, run_reject_bench

ROW_TITLES = {
    "floor": "1 floor: inference alone",
    "full": "2 edged full path",
    "viewer": "2b the same, live view watched",
    "naive": "3 naive reference",
}
STARTUP_TIMEOUT_S = 120.0
VIEW_ENCODE_WAIT_S = 10.0  # for the live view's encoder thread to finish what the watched row handed it
COLD_SOURCES = ("synthetic", "images")
SOAK_IMAGES = 8  # the soak cycles through this many 1280x720 scenes
# The fewest timed samples (--frames) a latency figure means much over. A p99 of fewer than 100 has
# no sample above it: NumPy interpolates between the slowest two, so it is the slowest frame, or
# nearly; and a median of a few dozen moves between runs by more than the differences the rows are
# read for. The default is 300, and the shortest runs BENCHMARKS.md reports are 100 per row.
ENOUGH_FRAMES = 100


def run_bench(args: argparse.Namespace) -> int:
    """``edged bench``: prints the report; raises UsageError, ModelError, ContractError or ColdStartError."""
    try:
        check_thread_option(args.threads)
    except ValueError as e:
        raise UsageError(str(e)) from None
    path = rows.resolve_model(args.model)
    spinning = cast(Spinning, args.spinning)  # argparse checked it
    variants, skipped = engine_variants(args.engine, args.precision)
    if args.int8 is not None and "int8" not in args.precision:
        raise UsageError("--int8 gives the model of the int8 rows, but --precision asks for none: add int8")
    report: dict[str, Any] = {}
    if args.cold_start:
        report["cold_start"] = [
            r for variant in variants for r in _cold_start(_variant_model(path, args, variant), spinning, args, variant)
        ]
    if args.soak:
        report["soak"] = [_soak(_variant_model(path, args, variant), spinning, args, variant) for variant in variants]
    if args.cameras:
        report["cameras"] = _cameras(path, spinning, args)
    if args.journal:
        report["journal"] = run_journal_bench(args.journal_dir, args.frames, args.camera_fps)
        if not args.json:
            print(format_journal(report["journal"], args.journal_dir))
    if args.reject:
        report["reject"] = run_reject_bench(args.frames)
        if not args.json:
            print(format_reject(report["reject"]))
    if args.opcua and args.abuse:
        from edged.tools.bench_opcua_abuse import format_opcua_abuse, run_opcua_abuse_bench

        report["opcua_abuse"] = run_opcua_abuse_bench(path, args.camera_fps, args.abuse_s, spinning)
        if not args.json:
            print(format_opcua_abuse(report["opcua_abuse"]))
    elif args.opcua:
        from edged.tools.bench_opcua import format_opcua, opcua_latency  # asyncua: only for this figure

        report["opcua"] = opcua_latency(path, args.frames, args.camera_fps, spinning)
        if not args.json:
            print(format_opcua(report["opcua"]))
    if args.modbus and args.abuse:
        report["modbus_abuse"] = run_modbus_abuse_bench(path, args.camera_fps, args.abuse_s, spinning)
        if not args.json:
            print(format_modbus_abuse(report["modbus_abuse"]))
    elif args.modbus:
        report["modbus"] = run_modbus_bench(path, args.frames, args.camera_fps, spinning)
        if not args.json:
            print(format_modbus(report["modbus"]))
    if not (args.cold_start or args.soak or args.cameras or args.journal or args.reject or args.opcua or args.modbus):
        if len(variants) == 1 and not skipped:
            report = bench(path, spinning, args, variants[0])
            report["model"]["kind"] = "demo model" if args.model is None else "model file"
            if not args.json:
                print(format_report(report))
        else:
            report = _variants(path, spinning, args, variants, skipped)
    if _timed_over_frames(args):
        report["few_frames"] = few_frames(args.frames)
        if report["few_frames"]:
            print(f"edged bench: {report['few_frames']}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    return 0


def _timed_over_frames(args: argparse.Namespace) -> bool:
    """Whether this run's figures are percentiles over ``--frames`` samples: the per-frame rows, and
    the journal, reject, OPC UA and Modbus latencies; not the cold start, soak, cameras or abuse runs."""
    instead = args.cold_start or args.soak or args.cameras or args.journal or args.reject or args.opcua or args.modbus
    return bool(not instead or args.journal or args.reject or ((args.opcua or args.modbus) and not args.abuse))


def few_frames(frames: int) -> str | None:
    """What to say of figures over ``frames`` samples each: None where they are enough (`ENOUGH_FRAMES`)."""
    if frames >= ENOUGH_FRAMES:
        return None
    return (
        f"--frames {frames} is too few for these figures to mean much: a p99 of fewer than {ENOUGH_FRAMES} samples "
        f"is the slowest one or two, and medians move from run to run; give --frames {ENOUGH_FRAMES} or more"
    )


Variant = tuple[EngineName, Precision]


def engine_variants(engines: list[str], precisions: list[str]) -> tuple[list[Variant], list[str]]:
    """Each engine at each precision it can be asked for, and why each other pairing is left out."""
    variants: list[Variant] = []
    skipped = []
    for engine in engines:
        for precision in precisions:
            if engine == "onnxruntime" and precision not in ORT_PRECISIONS:
                skipped.append(f"onnxruntime {precision}: it runs {' or '.join(ORT_PRECISIONS)} (the graph's own types)")
            else:
                variants.append((cast(EngineName, engine), cast(Precision, precision)))
    if not variants:
        raise UsageError(f"no engine runs these precisions: {'; '.join(skipped)}")
    return variants, skipped


def _variants(
    path: Path, spinning: Spinning, args: argparse.Namespace, variants: list[Variant], skipped: list[str]
) -> dict[str, Any]:
    """Every variant's per-frame rows, one after the other, and a table of them side by side; a variant
    this machine or model cannot run (a precision the device lacks, int8 on a float model) is said and skipped.
    The int8 rows run ``--int8``'s model when given, so that a float model's rows and its quantised model's
    share one table."""
    reports = []
    for variant in variants:
        try:
            reports.append(bench(_variant_model(path, args, variant), spinning, args, variant))
        except SetupError as e:
            reason = "; ".join(e.problems) if isinstance(e, ConfigError) else str(e)
            skipped.append(f"{' '.join(variant)}: {reason}")
    if not reports:
        raise UsageError(f"no variant runs here: {'; '.join(skipped)}")
    for r in reports:
        r["model"]["kind"] = "demo model" if args.model is None else "model file"
    if not args.json:
        print(format_variants(reports, skipped))
    return {"variants": reports, "skipped": skipped}


def _variant_model(path: Path, args: argparse.Namespace, variant: Variant) -> Path:
    """The model a variant runs: ``--int8``'s for the int8 rows when given, else ``--model``'s."""
    return cast(Path, args.int8) if variant[1] == "int8" and args.int8 is not None else path


def _cameras(path: Path, spinning: Spinning, args: argparse.Namespace) -> dict[str, Any]:
    kind = cast(CameraKind, args.camera_source)  # argparse checked it
    machine = machine_info()  # its load average is the one before the runs
    rows = run_cameras(
        path,
        args.cameras,
        kind=kind,
        fps=args.camera_fps,
        seconds=args.seconds,
        warmup_s=args.warmup_s,
        spinning=spinning,
        repeat=args.repeat,
    )
    if not args.json:
        print(format_rows(path.name, kind, args.camera_fps, rows))
    return {
        "machine": machine,
        "kind": kind,
        "fps": args.camera_fps,
        "seconds": args.seconds,
        "repeat": args.repeat,
        "rows": rows,
    }


def _cold_start(path: Path, spinning: Spinning, args: argparse.Namespace, variant: Variant) -> list[dict[str, Any]]:
    engine, precision = variant
    results = cold_start(path, trials=args.cold_runs, spinning=spinning, engine=engine, precision=precision)
    if not args.json:
        print(
            f"cold start of `edged run` on {path.name}, {engine} {precision}: process start -> first detections "
            f"message received, {args.cold_runs} trial(s) each"
        )
        for r in results:
            for state, key in (("cold", "without_cache"), ("warm", "with_cache")):
                trials = ", ".join(f"{s:.3f}" for s in r[f"{key}_s"])
                median = r[f"{key}_median_s"]
                print(f"  {r['source']:<9} source, {engine} cache {state}: median {median:.3f} s  ({trials})")
            print(f"  {r['source']:<9} source, seq of each first message received: {r['first_seq']}")
    return results


def _soak(path: Path, spinning: Spinning, args: argparse.Namespace, variant: Variant) -> dict[str, Any]:
    """One variant's soak, as a row naming its engine and precision (each engine allocates in its own
    native heap, which only RSS sees)."""

    def show(frame: int, rss: float, traced: float) -> None:
        print(f"  frame {frame:>8}  RSS {rss / 1024:9.1f} MB  traced {traced:9.1f} KB", flush=True)

    engine, precision = variant
    model = rows.load(path, spinning=spinning, threads=args.threads, conf=args.conf, engine=engine, precision=precision)
    if not args.json:
        print(
            f"soak: full path on {path.name}, {engine} {precision}, {args.soak} frames cycling {SOAK_IMAGES} "
            "scenes, tracemalloc on"
        )
    ran = {"engine": engine, "precision": precision, "model": path.name, "provider": model.info.provider}
    r = {**ran, **soak(model, args.soak, on_sample=None if args.json else show)}
    if not args.json:
        print(
            f"  RSS slope after warm-up {r['rss_slope_kb_per_1000']:+.1f} KB / 1000 frames (second half "
            f"{r['rss_late_slope_kb_per_1000']:+.1f}); traced growth {r['traced_growth_kb']:+.1f} KB, "
            f"{r['traced_slope_kb_per_1000']:+.2f} KB / 1000 frames (second half "
            f"{r['traced_late_slope_kb_per_1000']:+.2f})\n"
            f"  full path under tracemalloc: median {r['median_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms"
        )
        for line in r["top_growth"]:
            print(f"  grew: {line}")
    return r


def bench(
    path: Path, spinning: Spinning, args: argparse.Namespace, variant: Variant = ("onnxruntime", "f32")
) -> dict[str, Any]:
    """Every per-frame measurement on the model at ``path`` on one engine at one precision: the report that
    ``--json`` prints."""
    settings = {
        "frames": args.frames,
        "warmup": args.warmup,
        "cpu_frames": args.cpu_frames or max(10, args.frames // 3),
        "threads": args.threads,
        "conf": args.conf,
        "alloc_frames": args.alloc_frames,
        "frame": "1280x720 BGR scene 0, seed 0",
    }
    machine = machine_info()
    engine, precision = variant
    model = rows.load(path, spinning=spinning, threads=args.threads, conf=args.conf, engine=engine, precision=precision)
    with rows.FullPath(model, rows.bench_frame()) as full:
        paths: dict[str, rows.Row] = {
            "floor": rows.floor_row(model, full.plan.preprocess.tensor),
            "full": full,
            "viewer": rows.watched(full),
        }
        skipped = rows.naive_unsupported(model)
        if skipped is None:
            paths["naive"] = rows.timed(lambda: rows.naive_detect(model, full.image))
        samples = rows.interleave(paths, args.frames, args.warmup)
        cpu = {name: rows.cpu_per_frame(row, settings["cpu_frames"], min(args.warmup, 10)) for name, row in paths.items()}
        run = _run(spinning, samples, cpu, full)
        heap = rows.heap_per_frame(full, args.alloc_frames)
        verdict = rows.verdict_cost(args.frames)
        # The naive path's input differs from edged's in the last bit (a multiplication by 1/255, where
        # edged's is exact). At f32 that moves nothing the cross-check sees; at bf16 or f16 it moves
        # scores by about 0.01, and at int8 it can move a quantised activation by a step: on a trained
        # YOLOv8n, box edges by up to 0.6 px and scores by up to 0.016. So it is exact at f32 only.
        inexact = None if precision == "f32" else f"exact only at f32, not at {precision}"
        matches = None if skipped or inexact else rows.detections_match(model, full)
        model_info = {
            "path": str(path),
            "name": model.engine.identity.name,
            "engine": engine,
            "precision": precision,
            "provider": model.engine.provider,
            "threads": model.engine.threads.summary,
            "input": list(model.contract.shape),
            "output": list(full.plan.output.shape),
            "head": model.head,
            "classes": model.num_classes,
        }
    machine["loadavg_end"] = round(os.getloadavg()[0], 2)
    return {
        "machine": machine,
        "model": model_info,
        "settings": settings,
        "runs": [run],
        "allocations": heap,
        "verdict": verdict,
        "detections_match": matches,
        "naive_skipped": skipped or inexact,
        "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def _run(
    spinning: Spinning, samples: dict[str, list[rows.TimedFrame]], cpu: dict[str, dict[str, float]], full: rows.FullPath
) -> dict[str, Any]:
    """Each row's latency, CPU and stage times, and the full path against the floor."""
    table: dict[str, dict[str, Any]] = {}
    for name, timed in samples.items():
        stages = {k: rows.timing([t.stages[k] for t in timed]) for k in timed[0].stages}
        table[name] = {"latency": rows.timing([t.total_ms for t in timed]), **cpu[name], "stages": stages}
    floor, full_ms = (table[k]["latency"]["median_ms"] for k in ("floor", "full"))
    paired = np.array([t.total_ms for t in samples["full"]]) - np.array([t.total_ms for t in samples["floor"]])
    naive = table.get("naive")
    return {
        "spinning": spinning,
        "rows": table,
        "full_over_floor": full_ms / floor,
        "naive_over_floor": naive["latency"]["median_ms"] / floor if naive else None,
        "overhead_ms": full_ms - floor,
        "paired_overhead_ms": float(np.median(paired)),  # per-frame differences: robust to drift
        "messages_sent": full.publisher.sent,
        # The view encodes on its own thread: what the watched row handed it is counted once encoded.
        "view_frames_encoded": (full.view.next_jpeg(0, VIEW_ENCODE_WAIT_S) or (full.view.seq, b""))[0],
        "messages_received": full.received,
    }


def machine_info() -> dict[str, Any]:
    """CPU model from /proc/cpuinfo ("model name" on x86, "Model" on a Raspberry Pi); cores from sysfs.
    Not `platform.processor`, which on Linux runs ``uname -p`` in a child process for the same word."""
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key in ("model name", "Model"):
                cpu = value
    except OSError:
        pass
    online = online_cpus() or frozenset(range(os.cpu_count() or 1))
    return {
        "cpu": cpu,
        "logical_cores": len(online),
        "physical_cores": physical_cores(online),
        "onnxruntime": ort.__version__,
        "openvino": _installed("openvino"),
        "numpy": np.__version__,
        "opencv": cv2.__version__,
        "python": platform.python_version(),
        "loadavg_start": round(os.getloadavg()[0], 2),
    }


def _installed(package: str) -> str | None:
    """A package's version without importing it (openvino takes half a second), or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def format_report(r: dict[str, Any]) -> str:
    """The report as a table."""
    m, model, s, a, run, v = r["machine"], r["model"], r["settings"], r["allocations"], r["runs"][0], r["verdict"]
    lines = [
        f"edged bench: {model['name']} ({model['kind']})",
        f"  input {model['input']} output {model['output']}; provider {model['provider']}; "
        f"inference threads {model['threads']}",
        f"  {m['cpu']}, {m['logical_cores']} cores ({m['physical_cores']} physical); onnxruntime {m['onnxruntime']}, "
        f"numpy {m['numpy']}, opencv {m['opencv']}; load {m['loadavg_start']} -> {m['loadavg_end']}",
        f"  {s['frames']} frames per row, interleaved, after {s['warmup']} warm-up; frame {s['frame']}; conf {s['conf']}",
        "",
        f"spinning {run['spinning']:<21} median ms    p99 ms  CPU ms/frame  cores busy",
    ]
    for name, row in run["rows"].items():
        t = row["latency"]
        lines.append(
            f"{ROW_TITLES[name]:<30}{t['median_ms']:9.3f} {t['p99_ms']:9.3f}  "
            f"{row['cpu_ms_per_frame']:12.3f}  {row['cores_busy']:10.2f}"
        )
        lines += [f"    {stage:<26}{t['median_ms']:9.3f} {t['p99_ms']:9.3f}" for stage, t in row["stages"].items()]
    naive = f"  naive/floor {run['naive_over_floor']:.3f}" if run["naive_over_floor"] else ""
    verdict = "agree" if r["detections_match"] else "DISAGREE"
    lines += [
        f"full/floor {run['full_over_floor']:.3f}{naive}  overhead of 2 over 1: "
        f"{run['overhead_ms']:+.3f} ms median ({run['paired_overhead_ms']:+.3f} ms paired)",
        f"messages sent {run['messages_sent']}, received by the SUB {run['messages_received']}; "
        f"live-view frames encoded while watched {run['view_frames_encoded']}",
        "",
        f"Python heap per frame (full path, steady state): net {a['heap_blocks']:+.2f} blocks, {a['heap_bytes']:+.0f} B; "
        f"transient peak {a['transient_peak_bytes'] / 1024:.1f} KB",
        f"[inspect] verdict at {v['detections']} detections (2 zones by overlap): {v['median_ms']:.4f} ms median, "
        f"{v['p99_ms']:.4f} ms p99",
        f"naive cross-check skipped: {r['naive_skipped']}"
        if r["detections_match"] is None
        else f"detections: edged and the naive reference {verdict} on the bench frame",
        f"peak RSS {r['peak_rss_kb'] / 1024:.0f} MB",
    ]
    return "\n".join(lines)


def format_variants(reports: list[dict[str, Any]], skipped: list[str]) -> str:
    """Several engines and precisions side by side: each one's floor and full path (median, p99), and how
    many times faster its full path runs than ONNX Runtime f32's when that row is in the table."""
    first = reports[0]
    m, model, s = first["machine"], first["model"], first["settings"]
    lines = [
        f"edged bench: {model['name']} ({model['kind']}), input {model['input']}",
        f"  {m['cpu']}, {m['logical_cores']} cores ({m['physical_cores']} physical); onnxruntime {m['onnxruntime']}, "
        f"openvino {m['openvino'] or 'not installed'}; {s['frames']} frames per row, "
        f"interleaved within each variant, after {s['warmup']} warm-up; frame {s['frame']}",
    ]
    lines += sorted(
        {
            f"  int8 rows: {r['model']['name']}, input {r['model']['input']}"
            for r in reports
            if r["model"]["name"] != model["name"]
        }
    )
    lines += [
        "",
        f"{'engine':<12}{'precision':<10}{'floor ms':>9}{'p99':>8}{'full ms':>9}{'p99':>8}{'full/floor':>11}"
        f"{'speed-up':>9}  detections vs naive",
    ]
    baseline = next(
        (
            r["runs"][0]["rows"]["full"]["latency"]["median_ms"]
            for r in reports
            if (r["model"]["engine"], r["model"]["precision"]) == ("onnxruntime", "f32")
        ),
        None,
    )
    for r in reports:
        run, info = r["runs"][0], r["model"]
        floor, full = run["rows"]["floor"]["latency"], run["rows"]["full"]["latency"]
        agree = "skipped" if r["detections_match"] is None else "agree" if r["detections_match"] else "DISAGREE"
        speed_up = "-" if baseline is None else f"{baseline / full['median_ms']:.2f}x"
        lines.append(
            f"{info['engine']:<12}{info['precision']:<10}{floor['median_ms']:9.3f}{floor['p99_ms']:8.3f}"
            f"{full['median_ms']:9.3f}{full['p99_ms']:8.3f}{run['full_over_floor']:11.3f}{speed_up:>9}  {agree}"
        )
    lines += [f"skipped: {reason}" for reason in skipped]
    return "\n".join(lines)


def rss_kb() -> float:
    """Current resident set size (not the peak) from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024


def soak(
    model: LoadedModel,
    frames: int,
    *,
    images: list[np.ndarray] | None = None,
    samples: int = 10,
    warmup: int = 100,
    on_sample: Callable[[int, float, float], None] | None = None,
) -> dict[str, Any]:
    """The full path for ``frames`` frames cycling through ``images``, RSS and traced memory
    sampled ``samples + 1`` times from the end of warm-up; ``on_sample(frame, rss_kb, traced_kb)``.

    Traced memory leaves out the soak's own bookkeeping. Slopes are per 1000 frames; the late ones
    fit the second half only, since allocator pools settling early is a step, not a leak.
    """
    if images is None:  # scenes with different defects, so detection counts vary
        scenes = SceneGenerator(1280, 720, seed=0)
        images = [scenes.render(i).image for i in range(SOAK_IMAGES)]
    every = max(1, frames // samples)
    points: list[tuple[int, float, float]] = []  # (frame, RSS KB, traced KB)
    times = np.empty(frames)

    def sample(frame: int) -> None:
        traced_kb = sum(stat.size for stat in _edged_traces().statistics("filename")) / 1024
        points.append((frame, rss_kb(), traced_kb))
        if on_sample:
            on_sample(*points[-1])

    with rows.FullPath(model, images[0]) as full:
        for i in range(warmup):
            full.image = images[i % len(images)]
            full()
        tracemalloc.start(1)
        try:
            start = _edged_traces()
            for i in range(frames):
                if i % every == 0:
                    sample(i)
                full.image = images[i % len(images)]
                t0 = time.perf_counter_ns()
                full()
                times[i] = (time.perf_counter_ns() - t0) / 1e6
            sample(frames)
            growth = _edged_traces().compare_to(start, "lineno")
        finally:
            tracemalloc.stop()
    x, rss, traced = (np.array(column, float) for column in zip(*points, strict=True))
    late = len(points) // 2
    return {
        "frames": frames,
        "samples": points,
        "rss_slope_kb_per_1000": _slope(x, rss),
        "rss_late_slope_kb_per_1000": _slope(x[late:], rss[late:]),
        "traced_growth_kb": float(traced[-1] - traced[0]),
        "traced_slope_kb_per_1000": _slope(x, traced),
        "traced_late_slope_kb_per_1000": _slope(x[late:], traced[late:]),
        **rows.timing(times),
        "top_growth": [str(s) for s in growth[:3] if s.size_diff > 0],
    }


def _edged_traces() -> tracemalloc.Snapshot:
    """Traced blocks, less those of this module (the soak's bookkeeping; the per-frame path is
    elsewhere) and of tracemalloc itself."""
    ours = [tracemalloc.Filter(False, __file__), tracemalloc.Filter(False, tracemalloc.__file__)]
    return tracemalloc.take_snapshot().filter_traces(ours)


def _slope(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.polyfit(x, y, 1)[0]) * 1000 if len(x) >= 2 else 0.0


def cold_start(
    model: Path,
    *,
    trials: int,
    spinning: Spinning,
    sources: tuple[str, ...] = COLD_SOURCES,
    engine: EngineName = "onnxruntime",
    precision: Precision = "f32",
) -> list[dict[str, Any]]:
    """Seconds from starting ``edged run`` to the first detections message, per source.

    A SUB is connected before the child starts (ZeroMQ retries every 10 ms until it binds), so the
    clock runs as a consumer waiting for edged sees it. Sources: ``synthetic`` (which first
    synthesises its texture pool) and ``images`` (one scene PNG, a camera that delivers at once).
    Each trial runs with the engine's cache deleted (ONNX Runtime's optimised model, OpenVINO's
    compiled model), which builds and writes it, then loading it; the OS file cache is warm in both.
    ``first_seq`` 0 means no message was missed.
    """
    results = []
    for source in sources:
        seconds: dict[str, list[float]] = {"without_cache_s": [], "with_cache_s": []}
        seqs = []
        with tempfile.TemporaryDirectory(prefix="edged-cold-") as tmp:
            folder = Path(tmp)
            camera = _cold_source(folder, source)
            cache = folder / ("optimized.onnx" if engine == "onnxruntime" else "cache")
            for _ in range(trials):
                endpoint = f"tcp://127.0.0.1:{_free_port()}"
                config = write_config(
                    folder / "edged.toml",
                    model,
                    endpoint,
                    camera,
                    spinning=spinning,
                    cache=cache,
                    engine=engine,
                    precision=precision,
                )
                for stale in folder.glob(f"{cache.name}*"):
                    if stale.is_dir():
                        shutil.rmtree(stale)
                    else:
                        stale.unlink()
                for runs in seconds.values():
                    elapsed, seq = _first_message(config, endpoint)
                    runs.append(elapsed)
                    seqs.append(seq)
                    if not (cache.is_file() or any(p.is_file() for p in cache.rglob("*"))):
                        raise ColdStartError(f"cold start: edged run did not write the {engine} cache {cache}")
        medians = {f"{key.removesuffix('_s')}_median_s": float(np.median(runs)) for key, runs in seconds.items()}
        results.append({"source": source, "engine": engine, "precision": precision, **seconds, "first_seq": seqs, **medians})
    return results


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cold_source(folder: Path, source: str) -> str:
    """The cold start's one camera at 30 fps: synthetic, or an image folder of one scene PNG written into ``folder``."""
    if source == "synthetic":
        return '[source]\ntype = "synthetic"\nwidth = 1280\nheight = 720\nfps = 30\n'
    (folder / "frames").mkdir(exist_ok=True)
    cv2.imwrite(str(folder / "frames" / "scene.png"), SceneGenerator(1280, 720, seed=0).render(0).image)
    return f'[source]\ntype = "images"\npath = {json.dumps(str(folder / "frames"))}\nfps = 30\n'


def _first_message(config: Path, endpoint: str) -> tuple[float, int]:
    """Start ``edged run``; return (seconds to the first detections message, its seq)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RECONNECT_IVL, 10)
    sub.setsockopt(zmq.SUBSCRIBE, b"edged/detections/")
    sub.connect(endpoint)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGED_")}
    argv = [sys.executable, "-m", "edged", "run", "--config", str(config)]
    with tempfile.TemporaryFile() as stderr:
        t0 = time.perf_counter()
        child = bench_process.start(argv, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
        try:
            while time.perf_counter() - t0 < STARTUP_TIMEOUT_S:
                if sub.poll(20):
                    elapsed = time.perf_counter() - t0
                    return elapsed, int(json.loads(sub.recv_multipart()[1])["seq"])
                if child.poll() is not None:
                    break
            stderr.seek(0)
            tail = stderr.read().decode(errors="replace").strip().splitlines()[-5:]
            raise ColdStartError(f"cold start: edged run (exit {child.poll()}) published nothing: " + " | ".join(tail))
        finally:
            child.kill()  # timed up to its first message; how it shuts down is not measured
            child.wait()
            sub.close(linger=0)
            context.term()
