"""Preprocess and decode + NMS each alone in a tight loop, caches warm: the form in which their
targets are stated (BENCHMARKS.md, Targets). Inside the full path, which `edged bench` times
stage by stage, the same code is slower.

Preprocess takes the 1280x720 bench frame into the model's input; decode + NMS takes the model's
output for that frame. Reported with the candidates the head sees (all anchors, and those at or
above conf) and the detections that come out.

    python benchmarks/stages_alone.py [--model PATH] [--frames 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edged.errors import EdgedError
from edged.heads.registry import head_named
from edged.tools.bench_rows import FullPath, bench_frame, load, resolve_model, timing


def time_alone(fn: Callable[[], object], frames: int, warmup: int) -> dict[str, float]:
    """Median and p99 wall ms of ``fn`` in a tight loop."""
    for _ in range(warmup):
        fn()
    out = np.empty(frames)
    for i in range(frames):
        t0 = time.perf_counter_ns()
        fn()
        out[i] = (time.perf_counter_ns() - t0) / 1e6
    return timing(out)


def stages_alone(path: Path, *, frames: int, warmup: int, conf: float) -> dict[str, Any]:
    model = load(path, spinning="off", conf=conf)  # the loops run no inference: spinning plays no part
    with FullPath(model, bench_frame()) as full:
        plan = full.plan
        detections = len(full.process().result)
        output = plan.output.copy()
        m = plan.box_map
        head = head_named(model.head)
        return {
            "preprocess": time_alone(lambda: plan.preprocess(full.image), frames, warmup),
            "decode": time_alone(lambda: plan.decoder.decode(output, m), frames, warmup),
            "frame_size": [m.frame_w, m.frame_h],
            "input_size": [m.input_w, m.input_h],
            "anchors": int(output.shape[head.candidate_axis]),
            # The head's own selection counts the candidates at or above conf, whatever its layout.
            "candidates": head(output.shape, model.num_classes, conf).select(output[0]),
            "detections": detections,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, metavar="PATH", help="ONNX model (default: the demo model)")
    parser.add_argument("--frames", type=int, default=300, help="timed calls per stage (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls first (default 20)")
    parser.add_argument("--conf", type=float, default=0.25, help="model.conf (default 0.25)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.frames < 1 or args.warmup < 0:
        parser.error("--frames must be >= 1 and --warmup >= 0")
    try:
        path = resolve_model(args.model)
    except EdgedError as e:
        parser.error(str(e))
    r = stages_alone(path, frames=args.frames, warmup=args.warmup, conf=args.conf)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    (fw, fh), (iw, ih) = r["frame_size"], r["input_size"]
    print(
        f"stages alone on {path.name}: preprocess {fw}x{fh} -> {iw}x{ih} {r['preprocess']['median_ms']:.3f} ms median; "
        f"decode + NMS of {r['anchors']} candidates, {r['candidates']} at or above conf -> {r['detections']} detections "
        f"{r['decode']['median_ms']:.3f} ms median"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
