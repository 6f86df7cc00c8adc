"""``edged bench``: what edged's per-frame path costs over bare inference, on this machine.

This module owns the command: its arguments, which measurements a run makes, and the report
(a readable table, or one JSON object with ``--json``). The measurements live in
`edged.bench.run` (per-frame rows), `edged.bench.memory` (allocations, soak), `edged.bench.cold`
(cold start), `edged.bench.contention` (capture beside inference), `edged.bench.demand` (decoding
on demand), `edged.bench.paced` (a camera's pace) and `edged.bench.timing_model` (the
YOLOv8n-sized timing model).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast, get_args

from edged.config import CapturePriority, RuntimeConfig, Spinning, check_thread_option
from edged.errors import EXIT_CONFIG, EXIT_FAILURE, UsageError

DEMO_MODEL = Path("models") / "demo.onnx"
ROW_TITLES = {"floor": "1 floor: session.run", "full": "2 edged full path", "naive": "3 naive reference"}
SOAK_IMAGES = 8  # the soak cycles through this many scenes, so detection counts vary
YOLOV8N_CANDIDATES = 64
CACHE_DIR = Path(tempfile.gettempdir()) / "edged-bench"
SPINNING: tuple[Spinning, ...] = get_args(Spinning)
DEFAULT_SPINNING: Spinning = RuntimeConfig.model_fields["spinning"].default


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--model", type=Path, default=None, metavar="PATH", help=f"ONNX model to time (default: {DEMO_MODEL} when present)"
    )
    which.add_argument(
        "--yolov8n",
        action="store_true",
        help="time a YOLOv8n-sized model (640x640, ~8.7 GFLOPs, [1,84,8400], random weights "
        f"with the class head calibrated so {YOLOV8N_CANDIDATES} anchors pass conf on the "
        "bench frame), built once and cached; needs the onnx package",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=CACHE_DIR,
        metavar="DIR",
        help=f"where --yolov8n keeps its model and --capture-load its video (default: {CACHE_DIR})",
    )
    parser.add_argument("--frames", type=_positive, default=300, help="timed frames per row (default 300)")
    parser.add_argument("--warmup", type=_positive, default=20, help="untimed frames first (default 20)")
    parser.add_argument(
        "--cpu-frames", type=_positive, default=None, help="frames per row in the CPU-time blocks (default: frames / 3)"
    )
    parser.add_argument(
        "--alloc-frames", type=_positive, default=100, help="frames in the allocation measurement (default 100)"
    )
    parser.add_argument(
        "--spinning",
        choices=(*SPINNING, "all"),
        default=DEFAULT_SPINNING,
        help=f"runtime.spinning for the session (default {DEFAULT_SPINNING}); all measures each "
        "in turn where a mode compares them (the per-frame rows, --pace)",
    )
    parser.add_argument("--threads", type=int, default=0, help="runtime.intra_op_threads (default 0: one per physical core)")
    parser.add_argument("--conf", type=float, default=0.25, help="model.conf (default 0.25)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--cold-start",
        action="store_true",
        help="instead of the per-frame rows: time `edged run` from process start to the "
        "first detections message, without and with the optimised-model cache",
    )
    parser.add_argument("--cold-runs", type=_positive, default=3, help="cold-start trials (default 3)")
    parser.add_argument(
        "--capture-load",
        action="store_true",
        help="instead of the per-frame rows: time the floor and the full path with no capture "
        "thread, then beside a real capture thread decoding 1280x720 MJPEG at 30 fps, at "
        "each capture priority, and the full path fed by that capture thread",
    )
    parser.add_argument(
        "--decode-demand",
        action="store_true",
        help="instead of the per-frame rows: the capture thread's CPU under a consumer slower "
        "than a 30 fps 1280x720 MJPEG camera, decoding every frame and on demand",
    )
    parser.add_argument(
        "--pace",
        type=float,
        default=None,
        metavar="FPS",
        help="instead of the per-frame rows: run the full path at FPS frames per second, as a "
        "camera delivers them, and report latency and CPU per frame for each --spinning setting",
    )
    parser.add_argument(
        "--pace-capture",
        choices=get_args(CapturePriority),
        default=None,
        metavar="PRIORITY",
        help="with --pace: a real capture thread at this priority (normal, low, idle) decodes "
        "1280x720 MJPEG at 30 fps throughout, as a camera would",
    )
    parser.add_argument(
        "--soak",
        type=_positive,
        default=None,
        metavar="N",
        help="instead of the per-frame rows: run the full path N frames and report RSS and traced memory every N/10 frames",
    )


def _check_usage(args: argparse.Namespace) -> None:
    if args.pace_capture is not None and args.pace is None:
        raise UsageError("--pace-capture only applies with --pace FPS")
    try:
        check_thread_option(args.threads)
    except ValueError as e:
        raise UsageError(str(e)) from None


def resolve_model(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The model to time and what the report should say about where it came from."""
    if args.yolov8n:
        from edged.bench.timing_model import cached_yolov8n

        path = cached_yolov8n(args.cache_dir, candidates=YOLOV8N_CANDIDATES, conf=args.conf)
        return path, {
            "kind": "YOLOv8n-sized timing model: random weights, class head calibrated to "
            f"{YOLOV8N_CANDIDATES} candidates at conf {args.conf:g} on the bench frame"
        }
    if args.model is not None:
        if not args.model.is_file():
            raise UsageError(f"model file {args.model} does not exist")
        return args.model, {"kind": "model file"}
    for candidate in (DEMO_MODEL, Path(__file__).resolve().parents[1] / DEMO_MODEL):
        if candidate.is_file():
            return candidate, {"kind": "demo model"}
    raise UsageError(
        f"no model to time: {DEMO_MODEL} is not here; pass --model PATH, or --yolov8n for a YOLOv8n-sized timing model"
    )


def run_bench(args: argparse.Namespace) -> int:
    """``edged bench``: returns the exit code (78 when the model cannot be used)."""
    from edged.bench.cold import ColdStartError
    from edged.bench.timing_model import MissingOnnx
    from edged.errors import ContractError, ModelError

    try:
        _check_usage(args)
        path, origin = resolve_model(args)
        report: dict[str, Any] = {}
        if args.cold_start:
            report["cold_start"] = _cold_start(path, args)
        if args.soak:
            report["soak"] = _soak(path, args)
        if args.capture_load:
            report["capture_load"] = _capture_load(path, args)
        if args.decode_demand:
            report["decode_demand"] = _decode_demand(args)
        if args.pace is not None:
            report["paced"] = _paced(path, args)
        if not (args.cold_start or args.soak or args.capture_load or args.decode_demand or args.pace is not None):
            report = _per_frame(path, origin, args)
    except (UsageError, ModelError, ContractError, MissingOnnx) as e:
        print(f"edged bench: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except ColdStartError as e:
        print(f"edged bench: cold start failed: {e}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    return 0


def _spinning(choice: str) -> tuple[Spinning, ...]:
    return SPINNING if choice == "all" else (_one_spinning(choice),)


def _one_spinning(choice: str) -> Spinning:
    """The setting for a mode that measures only one: the default where ``all`` was asked."""
    return DEFAULT_SPINNING if choice == "all" else cast(Spinning, choice)  # argparse checked the choice


def _per_frame(path: Path, origin: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from edged.bench.run import bench

    result = bench(
        path,
        frames=args.frames,
        warmup=args.warmup,
        cpu_frames=args.cpu_frames or max(10, args.frames // 3),
        spinning=_spinning(args.spinning),
        threads=args.threads,
        conf=args.conf,
        alloc_frames=args.alloc_frames,
        model_info=origin,
    )
    report = result.to_dict()
    if not args.json:
        print(format_report(report))
    return report


def _cold_start(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from edged.bench.cold import cold_start

    results = cold_start(path, trials=args.cold_runs, spinning=_one_spinning(args.spinning))
    if not args.json:
        print(
            f"cold start of `edged run` on {path.name}: process start -> first detections message "
            f"received, {args.cold_runs} trial(s) each"
        )
    for r in results:
        if not args.json:
            for state, median, trials in (
                ("cold", r.without_cache_median_s, r.without_cache_s),
                ("warm", r.with_cache_median_s, r.with_cache_s),
            ):
                print(
                    f"  {r.source:<9} source, optimised-model cache {state}: median {median:.3f} s  "
                    f"({', '.join(f'{s:.3f}' for s in trials)})"
                )
            print(f"  {r.source:<9} source, seq of each first message received: {r.first_seq}")
    return [
        {**asdict(r), "without_cache_median_s": r.without_cache_median_s, "with_cache_median_s": r.with_cache_median_s}
        for r in results
    ]


def _capture_load(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from edged.bench.contention import capture_contention

    rows = capture_contention(
        path,
        frames=args.frames,
        warmup=args.warmup,
        spinning=_one_spinning(args.spinning),
        threads=args.threads,
        conf=args.conf,
        cache_dir=args.cache_dir,
    )
    if not args.json:
        print(
            f"capture beside inference on {path.name}: {args.frames} frames per row and condition, "
            "capture decoding 1280x720 MJPEG at 30 fps\n"
            "capture            floor median    p99 ms   full median    p99 ms  inference median   decoded fps"
        )
        for r in rows:
            floor = f"{r.floor.median_ms:12.3f}{r.floor.p99_ms:10.3f}" if r.floor else f"{'-':>12}{'-':>10}"
            print(
                f"{r.capture:<18}{floor}{r.full.median_ms:13.3f}{r.full.p99_ms:10.3f}{r.inference.median_ms:18.3f}"
                f"{r.decoded_fps:14.1f}"
            )
    return [asdict(r) for r in rows]


def _decode_demand(args: argparse.Namespace) -> list[dict[str, Any]]:
    from edged.bench.demand import CAMERA_FPS, decode_on_demand

    rows = decode_on_demand(frames=args.frames)
    if not args.json:
        print(
            f"capture thread under a slower consumer: {CAMERA_FPS:g} fps 1280x720 MJPEG camera (decoded in "
            f"retrieve, as OpenCV's V4L2 backend does), {args.frames} camera frames per row\n"
            "consumer fps  decoding       cores  decoded fps  taken fps  frame age median ms  newest"
        )
        for r in rows:
            print(
                f"{r.consumer_fps:12g}  {r.decode:<12}{r.cores:8.3f}{r.decoded_fps:13.1f}{r.taken_fps:11.1f}"
                f"{r.age_ms:21.1f}{r.newest:8.0%}"
            )
    return [asdict(r) for r in rows]


def _paced(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from edged.bench.paced import paced

    if not 0 < args.pace <= 1000:
        raise UsageError(f"--pace must be in (0, 1000] frames per second, got {args.pace:g}")
    runs = paced(
        path,
        fps=args.pace,
        frames=args.frames,
        warmup=args.warmup,
        spinning=_spinning(args.spinning),
        threads=args.threads,
        conf=args.conf,
        capture=args.pace_capture,
        cache_dir=args.cache_dir,
    )
    if not args.json:
        beside = f", capture thread ({args.pace_capture}) decoding 1280x720 MJPEG at 30 fps" if args.pace_capture else ""
        print(
            f"full path on {path.name} at {args.pace:g} fps, {args.frames} frames{beside}\n"
            "spinning   latency median    p99 ms  CPU ms/frame  share of a core"
        )
        for r in runs:
            print(
                f"{r.spinning:<11}{r.latency.median_ms:14.3f}{r.latency.p99_ms:10.3f}"
                f"{r.cpu_ms_per_frame:14.3f}{r.core_share:17.0%}"
            )
    return [asdict(r) for r in runs]


def _soak(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    from edged.bench.memory import soak, soak_images
    from edged.bench.run import load

    model = load(path, spinning=_one_spinning(args.spinning), threads=args.threads, conf=args.conf)
    images = soak_images(SOAK_IMAGES)

    def show(frame: int, rss: float, traced: float) -> None:
        if not args.json:
            print(f"  frame {frame:>8}  RSS {rss / 1024:9.1f} MB  traced {traced:9.1f} KB", flush=True)

    if not args.json:
        print(f"soak: full path on {path.name}, {args.soak} frames cycling {SOAK_IMAGES} scenes, tracemalloc on")
    result = soak(model, args.soak, images=images, on_sample=show)
    if not args.json:
        print(
            f"  RSS slope after warm-up {result.rss_slope_kb_per_1000:+.1f} KB / 1000 frames "
            f"(second half {result.rss_late_slope_kb_per_1000:+.1f}); traced growth "
            f"{result.traced_growth_kb:+.1f} KB, {result.traced_slope_kb_per_1000:+.2f} KB / 1000 frames "
            f"(second half {result.traced_late_slope_kb_per_1000:+.2f})"
        )
        print(f"  full path under tracemalloc: median {result.median_ms:.2f} ms, p99 {result.p99_ms:.2f} ms")
        for line in result.top_growth:
            print(f"  grew: {line}")
    return asdict(result)


def _ms(t: dict[str, float]) -> str:
    return f"{t['median_ms']:9.3f} {t['p99_ms']:9.3f}"


def format_report(r: dict[str, Any]) -> str:
    m, model, alone = r["machine"], r["model"], r["alone"]
    flops = ""
    if model.get("gflops") is not None:
        flops = f", {model['gflops']:.2f} GFLOPs, {model['params'] / 1e6:.2f} M params"
    lines = [
        f"edged bench: {model['name']} ({model['kind']})",
        f"  input {model['input']} output {model['output']}{flops}; provider {model['provider']}; "
        f"inference threads {model['threads']}",
        f"  {m['cpu']}, {m['logical_cores']} cores ({m['physical_cores']} physical); onnxruntime "
        f"{m['onnxruntime']}, numpy {m['numpy']}, opencv {m['opencv']}; load {m['loadavg_start']} -> "
        f"{m['loadavg_end']}{_others(m)}",
        f"  {r['settings']['frames']} frames per row, interleaved, after {r['settings']['warmup']} "
        f"warm-up; frame {r['settings']['frame']}; conf {r['settings']['conf']}",
    ]
    for run in r["runs"]:
        lines += ["", _run_table(run)]
    lines += [
        "",
        _alone_line(alone),
        _alloc_line(r["allocations"]),
        _match_line(r),
        f"peak RSS {r['peak_rss_kb'] / 1024:.0f} MB",
    ]
    return "\n".join(lines)


def _others(m: dict[str, Any]) -> str:
    if "steal_cores" not in m:
        return ""
    return f"; meanwhile other guests took {m['steal_cores']:.2f} and other processes {m['other_cores']:.2f} cores"


def _run_table(run: dict[str, Any]) -> str:
    head = f"spinning {run['spinning']:<21} median ms    p99 ms  CPU ms/frame  cores busy"
    lines = [head]
    for name, row in run["rows"].items():
        lines.append(
            f"{ROW_TITLES[name]:<30}{_ms(row['latency'])}  {row['cpu_ms_per_frame']:12.3f}  {row['cores_busy']:10.2f}"
        )
        for stage, t in row["stages"].items():
            lines.append(f"    {stage:<26}{_ms(t)}")
    naive = f"  naive/floor {run['naive_over_floor']:.3f}" if run["naive_over_floor"] else ""
    lines.append(
        f"full/floor {run['full_over_floor']:.3f}{naive}  overhead of 2 over 1: "
        f"{run['overhead_ms']:+.3f} ms median ({run['paired_overhead_ms']:+.3f} ms paired)"
    )
    lines.append(f"messages sent {run['messages_sent']}, received by the SUB {run['messages_received']}")
    return "\n".join(lines)


def _alone_line(a: dict[str, Any]) -> str:
    fw, fh = a["frame_size"]
    iw, ih = a["input_size"]
    cands = f", {a['candidates']} at or above conf" if a["candidates"] is not None else ""
    return (
        f"stages alone: preprocess {fw}x{fh} -> {iw}x{ih} {a['preprocess']['median_ms']:.3f} ms median; "
        f"decode + NMS of {a['anchors']} candidates{cands} -> {a['detections']} detections "
        f"{a['decode']['median_ms']:.3f} ms median"
    )


def _alloc_line(a: dict[str, Any]) -> str:
    heap = (
        f"Python heap net {a['heap_blocks']:+.2f} blocks, {a['heap_bytes']:+.0f} B per frame; "
        f"transient peak {a['transient_peak_bytes'] / 1024:.1f} KB per frame"
    )
    if a["numpy_buffers"] is None:
        return f"allocations (full path, steady state): numpy count unavailable here; {heap}"
    counts = ", ".join(f"{k} {v:g}" for k, v in a["numpy_buffers"].items())
    kb = a["numpy_bytes"]["total"] / 1024
    return f"allocations per frame (full path, steady state): numpy arrays {counts} ({kb:.1f} KB); {heap}"


def _match_line(r: dict[str, Any]) -> str:
    if r["detections_match"] is None:
        return f"naive cross-check skipped: {r['naive_skipped']}"
    verdict = "agree" if r["detections_match"] else "DISAGREE"
    return f"detections: edged and the naive reference {verdict} on the bench frame"
