"""The live frame rate and frame age with and without a shadow trial (``[model.candidate]``).

The real daemon runs on a generated 640x480 scene, its status read over ZeroMQ after a warm-up;
runs with the candidate off and on alternate, so that drift on a shared machine hits both alike.
Two cases: a 64x64 scene model the machine serves easily at 15 fps, and the demo model fed at
240 fps, which saturates the loop. The candidate is the live model itself, offered every frame.

    PYTHONPATH=. python benchmarks/shadow_trial.py [--rounds 4] [--seconds 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from daemon import RunningDaemon, free_port, write_config  # noqa: E402
from onnx_models import fixed_scene  # noqa: E402

from edged.messages import StatusMessage  # noqa: E402

WARM_UP_S = 5.0


def run(folder: Path, model: Path, fps: float, candidate: bool, seconds: float) -> str:
    """One daemon for ``seconds``: its mean fps, median frame age, and the trial's counters."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    doc = {
        "source": {"type": "synthetic", "width": 640, "height": 480, "fps": fps},
        "model": {"path": str(model)},
        "publish": {"endpoints": [endpoint], "status_interval_s": 1.0},
        "thermal": {"enabled": False},
        "journal": {"enabled": False},
    }
    if candidate:
        doc["model.candidate"] = {"path": str(model), "sample_every": 1, "control": f"ipc://{folder}/control.sock"}
    daemon = RunningDaemon(write_config(folder / "edged.toml", doc), endpoint)
    rates, ages, last = [], [], None
    start = time.monotonic()
    try:
        for message in daemon.messages(seconds):
            if isinstance(message, StatusMessage) and time.monotonic() - start > WARM_UP_S:
                rates.append(message.fps)
                if "age" in message.latency:
                    ages.append(message.latency["age"].p50_ms)
                last = message
    finally:
        daemon.stop()
    line = f"{model.stem} at {fps:g} fps, candidate {'on' if candidate else 'off'}: "
    line += f"fps {statistics.mean(rates):.2f}, frame age p50 {statistics.median(ages):.1f} ms"
    trial = last.candidate if last is not None else None
    if trial is not None:
        latency = f"{trial.latency.p50_ms:.2f} / {trial.latency.p99_ms:.2f} ms" if trial.latency else "-"
        line += f"; candidate runs {trial.frames}, skipped (busy) {trial.skipped_busy}, p50 / p99 {latency}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=16.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        tiny = fixed_scene(folder / "scene.onnx", [(16.0, 20.0, 8.0, 8.0, 0, 0.9), (48.0, 44.0, 8.0, 8.0, 2, 0.7)])
        for model, fps in ((tiny, 15.0), (ROOT / "models" / "demo.onnx", 240.0)):
            for _ in range(args.rounds):
                for candidate in (False, True):
                    print(run(folder, model, fps, candidate, args.seconds), flush=True)


if __name__ == "__main__":
    main()
