"""The full path at a camera's pace rather than back to back, where ORT's thread spinning shows
its real cost: a spinning pool burns CPU between frames too, not only during a run.

Frames start on a fixed clock (``1 / fps`` apart, as a camera delivers them); a frame that
overruns its slot starts the next one at once. Reported per spinning setting: latency of the
full path, CPU time of the whole process per frame (every thread), and the share of one core.
The settings take turns in several rounds (each loads its own session, one at a time), so that
drift on a shared machine hits each alike. With ``--capture PRIORITY``, a real capture thread at
that priority decodes the 1280x720 MJPEG clip of `capture_load` at 30 fps throughout, as a
camera would.

    python benchmarks/paced.py --model PATH --fps 30 [--spinning all] [--capture low] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import get_args

from capture_load import CACHE_DIR, decoding_camera

from edged.config import CapturePriority, Spinning
from edged.errors import EdgedError
from edged.tools.bench_rows import FullPath, bench_frame, load, resolve_model, timing

ROUNDS = 3
SPINNING: tuple[Spinning, ...] = get_args(Spinning)


@dataclass(frozen=True, slots=True)
class PacedRun:
    spinning: Spinning
    fps: float
    latency: dict[str, float]  # median_ms, p99_ms
    cpu_ms_per_frame: float
    core_share: float  # CPU time over wall time: 1.0 is one core kept busy


def paced(
    path: Path, *, fps: float, frames: int, warmup: int, spinning: tuple[Spinning, ...], threads: int, conf: float
) -> list[PacedRun]:
    image = bench_frame()
    latency: dict[Spinning, list[float]] = {spin: [] for spin in spinning}
    cpu_ms = dict.fromkeys(spinning, 0.0)
    wall_ms = dict.fromkeys(spinning, 0.0)
    per_round = max(1, frames // ROUNDS)
    for turn in range(ROUNDS):
        for spin in spinning if turn % 2 == 0 else spinning[::-1]:
            with FullPath(load(path, spinning=spin, threads=threads, conf=conf), image) as full:
                for _ in range(warmup):
                    full()
                period = 1.0 / fps
                cpu0, t0 = time.process_time_ns(), time.perf_counter_ns()
                tick = time.monotonic()
                for _ in range(per_round):
                    tick = max(tick + period, time.monotonic())
                    latency[spin].append(full().total_ms)
                    full.drain()
                    time.sleep(max(0.0, tick - time.monotonic()))
                cpu_ms[spin] += (time.process_time_ns() - cpu0) / 1e6
                wall_ms[spin] += (time.perf_counter_ns() - t0) / 1e6
    count = per_round * ROUNDS
    return [
        PacedRun(spin, fps, timing(latency[spin]), cpu_ms[spin] / count, cpu_ms[spin] / wall_ms[spin]) for spin in spinning
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, metavar="PATH", help="ONNX model (default: the demo model)")
    parser.add_argument("--fps", type=float, required=True, help="frames started per second, in (0, 1000]")
    parser.add_argument("--frames", type=int, default=300, help="timed frames per spinning setting (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed frames first, per round (default 20)")
    parser.add_argument("--spinning", choices=(*SPINNING, "all"), default="all", help="runtime.spinning (default all)")
    parser.add_argument("--threads", type=int, default=0, help="runtime.intra_op_threads (default 0)")
    parser.add_argument("--conf", type=float, default=0.25, help="model.conf (default 0.25)")
    parser.add_argument(
        "--capture", choices=get_args(CapturePriority), default=None, metavar="PRIORITY", help="a capture thread beside"
    )
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help=f"where the clip is kept (default {CACHE_DIR})")
    parser.add_argument("--json", action="store_true", help="print the runs as JSON")
    args = parser.parse_args(argv)
    if not 0 < args.fps <= 1000:
        parser.error(f"--fps must be in (0, 1000] frames per second, got {args.fps:g}")
    if args.frames < 1 or args.warmup < 0:
        parser.error("--frames must be >= 1 and --warmup >= 0")
    try:
        path = resolve_model(args.model)
    except EdgedError as e:
        parser.error(str(e))
    spinning = SPINNING if args.spinning == "all" else (args.spinning,)
    beside = decoding_camera(args.capture, args.cache_dir) if args.capture else nullcontext()
    with beside:
        runs = paced(
            path,
            fps=args.fps,
            frames=args.frames,
            warmup=args.warmup,
            spinning=spinning,
            threads=args.threads,
            conf=args.conf,
        )
    if args.json:
        print(json.dumps([asdict(r) for r in runs], indent=2))
        return 0
    camera = f", capture thread ({args.capture}) decoding 1280x720 MJPEG at 30 fps" if args.capture else ""
    print(
        f"full path on {path.name} at {args.fps:g} fps, {args.frames} frames{camera}\n"
        "spinning   latency median    p99 ms  CPU ms/frame  share of a core"
    )
    for r in runs:
        print(
            f"{r.spinning:<11}{r.latency['median_ms']:14.3f}{r.latency['p99_ms']:10.3f}{r.cpu_ms_per_frame:14.3f}"
            f"{r.core_share:17.0%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
