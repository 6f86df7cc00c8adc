"""The live frame rate and frame age with and without a shadow trial (``[model.candidate]``).

The real daemon runs on a generated 640x480 scene, its status read over ZeroMQ after a warm-up;
runs with the candidate off and on alternate, so that drift on a shared machine hits both alike.
Two cases: a 64x64 scene model the machine serves easily at 15 fps, and the demo model fed at
240 fps, which saturates the loop. The candidate is the live model itself, offered every frame.

Comparing runs shows the trial's cost only on a quiet machine; each "on" run also prints the cost
the trial measures itself (the status's ``live_delay_ms``: frame age it added per live frame, an
upper bound, over the same statuses), as a share of the run's frame age.

    PYTHONPATH=. python benchmarks/shadow_trial.py [--rounds 4] [--seconds 11] [--warm-up 5] [--case scene]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from daemon import RunningDaemon, free_port, write_config  # noqa: E402
from onnx_models import fixed_scene  # noqa: E402

from edged.messages import CandidateReport, StatusMessage  # noqa: E402

START_TIMEOUT_S = 60.0
CASES = ("scene", "demo")


@dataclass(frozen=True, slots=True)
class Run:
    """One daemon's figures over the statuses after the warm-up."""

    fps: float
    age_ms: float  # the mean of the statuses' frame age p50
    trial: CandidateReport | None  # the last status's
    added_ms: float | None  # the frame age the trial says it added per live frame, over the same statuses

    @property
    def added_share(self) -> float | None:
        return self.added_ms / self.age_ms if self.added_ms is not None and self.age_ms > 0 else None


def added_ms(first: CandidateReport, last: CandidateReport) -> float | None:
    """The trial's added frame age per live frame between two of its reports (their figures are since start)."""
    frames = last.live_frames - first.live_frames
    if frames <= 0:
        return None
    total = (last.live_delay_ms or 0.0) * last.live_frames - (first.live_delay_ms or 0.0) * first.live_frames
    return max(total, 0.0) / frames


def run(folder: Path, model: Path, fps: float, candidate: bool, seconds: float, warm_up_s: float) -> Run:
    """One daemon for ``seconds`` after ``warm_up_s`` from its first status."""
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
    kept: list[StatusMessage] = []
    try:
        if not any(isinstance(message, StatusMessage) for message in daemon.messages(START_TIMEOUT_S)):
            raise SystemExit(f"no status in {START_TIMEOUT_S:g} s: the daemon did not start")
        start = time.monotonic()  # the daemon runs: its model load and first frames are not warm-up
        for message in daemon.messages(warm_up_s + seconds):
            if isinstance(message, StatusMessage) and time.monotonic() - start > warm_up_s:
                kept.append(message)
    finally:
        daemon.stop()
    if len(kept) < 2:
        raise SystemExit(f"{len(kept)} status(es) after the {warm_up_s:g} s warm-up: give --seconds more")
    ages = [status.latency["age"].p50_ms for status in kept if "age" in status.latency]
    first, last = kept[0].candidate, kept[-1].candidate
    return Run(
        fps=statistics.mean(status.fps for status in kept),
        age_ms=statistics.mean(ages) if ages else 0.0,
        trial=last,
        added_ms=added_ms(first, last) if first is not None and last is not None else None,
    )


def line(name: str, fps: float, candidate: bool, got: Run) -> str:
    text = f"{name} at {fps:g} fps, candidate {'on' if candidate else 'off'}: "
    text += f"fps {got.fps:.2f}, frame age p50 {got.age_ms:.1f} ms"
    trial = got.trial
    if trial is not None:
        latency = f"{trial.latency.p50_ms:.2f} / {trial.latency.p99_ms:.2f} ms" if trial.latency else "-"
        text += f"; candidate runs {trial.frames}, skipped (busy) {trial.skipped_busy}, p50 / p99 {latency}"
        delay = f"{trial.live_delay.p50_ms:.2f} / {trial.live_delay.p99_ms:.2f} ms" if trial.live_delay else "-"
        text += f"; live frames delayed {trial.live_delayed} of {trial.live_frames}, by p50 / p99 {delay}"
    if got.added_ms is not None and got.added_share is not None:
        text += f"; added frame age {got.added_ms:.3f} ms per frame = {got.added_share:.2%} of the frame age"
    return text


def summary(name: str, fps: float, off: list[Run], on: list[Run]) -> str:
    """The off/on comparison of the means, and the cost the trial attributes to itself."""
    age_off, age_on = statistics.mean(r.age_ms for r in off), statistics.mean(r.age_ms for r in on)
    fps_off, fps_on = statistics.mean(r.fps for r in off), statistics.mean(r.fps for r in on)
    text = f"{name} at {fps:g} fps, {len(off)} run(s) each: fps {fps_off:.2f} -> {fps_on:.2f} "
    text += f"({fps_on / fps_off - 1:+.1%}), frame age p50 {age_off:.1f} -> {age_on:.1f} ms ({age_on / age_off - 1:+.1%})"
    shares = [r.added_share for r in on if r.added_share is not None]
    if shares:
        text += f"; attributed added frame age {statistics.mean(shares):.2%} (runs {min(shares):.2%}-{max(shares):.2%})"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=11.0, help="measured, after the warm-up")
    parser.add_argument("--warm-up", type=float, default=5.0, help="seconds from the first status before measuring")
    parser.add_argument("--case", choices=CASES, action="append", help="only this case (repeatable; default: both)")
    args = parser.parse_args(argv)
    summaries = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        scene = fixed_scene(folder / "scene.onnx", [(16.0, 20.0, 8.0, 8.0, 0, 0.9), (48.0, 44.0, 8.0, 8.0, 2, 0.7)])
        cases = {"scene": (scene, 15.0), "demo": (ROOT / "models" / "demo.onnx", 240.0)}
        for name in args.case or CASES:
            model, fps = cases[name]
            runs: dict[bool, list[Run]] = {False: [], True: []}
            for _ in range(args.rounds):
                for candidate in (False, True):
                    got = run(folder, model, fps, candidate, args.seconds, args.warm_up)
                    runs[candidate].append(got)
                    print(line(model.stem, fps, candidate, got), flush=True)
            summaries.append(summary(model.stem, fps, runs[False], runs[True]))
    print("\n".join(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
