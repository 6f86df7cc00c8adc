"""Cold start: process start to the first detections message a subscriber receives.

``edged run`` is started as a child process with a temporary config that publishes on a free
tcp loopback port, once per source kind: ``synthetic`` (the built-in scene generator, which
first synthesises its texture pool) and ``images`` (a folder holding one 1280x720 scene PNG,
standing in for a camera that delivers its first frame at once). A SUB socket connects before
the child starts (ZeroMQ keeps retrying until the child binds, every 10 ms here), so the clock
runs from ``Popen`` to the first detections message, exactly what a consumer waiting for edged
would see. Each trial runs once with the optimised-model cache
(``runtime.optimized_model_path``) deleted, which builds and writes it, then once more loading
it. The operating system's file cache is warm in both (Python, onnxruntime and the model were
read recently); a first boot from slow flash adds its read time on top.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import zmq

from edged.bench import DEFAULT_SPINNING
from edged.config import Spinning
from edged.scenes import SceneGenerator

STARTUP_TIMEOUT_S = 120.0
SOURCES = ("synthetic", "images")


class ColdStartError(Exception):
    """The daemon exited or stayed silent; the message carries the end of its stderr."""


@dataclass(frozen=True, slots=True)
class ColdStart:
    """Seconds from process start to the first detections message, per trial, for one source."""

    source: str
    without_cache_s: list[float]
    with_cache_s: list[float]
    first_seq: list[int]  # seq of the first message received; 0 means none was missed

    @property
    def without_cache_median_s(self) -> float:
        return float(np.median(self.without_cache_s))

    @property
    def with_cache_median_s(self) -> float:
        return float(np.median(self.with_cache_s))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _source_section(folder: Path, source: str) -> str:
    if source == "synthetic":
        return '[source]\ntype = "synthetic"\nwidth = 1280\nheight = 720\nfps = 30\n'
    frames = folder / "frames"
    frames.mkdir(exist_ok=True)
    cv2.imwrite(str(frames / "scene.png"), SceneGenerator(1280, 720, seed=0).render(0).image)
    return f'[source]\ntype = "images"\npath = {json.dumps(str(frames))}\nfps = 30\n'


def write_config(folder: Path, model: Path, endpoint: str, *, source: str, spinning: Spinning) -> Path:
    """A minimal daemon config: the source, the model, the optimised-model cache, the endpoint."""
    text = f"""
{_source_section(folder, source)}
[model]
path = {json.dumps(str(model.resolve()))}

[runtime]
optimized_model_path = {json.dumps(str(folder / "optimized.onnx"))}
spinning = "{spinning}"

[publish]
endpoints = [{json.dumps(endpoint)}]

[service]
log_level = "warning"
"""
    path = folder / "edged.toml"
    path.write_text(text)
    return path


def _first_message(config: Path, endpoint: str) -> tuple[float, int]:
    """Start ``edged run``; return (seconds to the first detections message, its seq)."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RECONNECT_IVL, 10)
    sub.setsockopt(zmq.SUBSCRIBE, b"edged/detections/")
    sub.connect(endpoint)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGED_")}
    with tempfile.TemporaryFile() as stderr:
        t0 = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, "-m", "edged", "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
        )
        try:
            while time.perf_counter() - t0 < STARTUP_TIMEOUT_S:
                if sub.poll(20):
                    elapsed = time.perf_counter() - t0
                    _, payload = sub.recv_multipart()
                    return elapsed, int(json.loads(payload)["seq"])
                if child.poll() is not None:
                    break
            stderr.seek(0)
            tail = stderr.read().decode(errors="replace").strip().splitlines()[-5:]
            raise ColdStartError(f"edged run (exit {child.poll()}) published nothing: " + " | ".join(tail))
        finally:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            sub.close(linger=0)
            context.term()


def cold_start(
    model: Path, *, trials: int = 3, spinning: Spinning = DEFAULT_SPINNING, sources: tuple[str, ...] = SOURCES
) -> list[ColdStart]:
    """Per source, ``trials`` pairs: cache deleted (built and written), then warm (loaded)."""
    return [_trials(model, source, trials, spinning) for source in sources]


def _trials(model: Path, source: str, trials: int, spinning: Spinning) -> ColdStart:
    without, with_cache, seqs = [], [], []
    with tempfile.TemporaryDirectory(prefix="edged-cold-") as tmp:
        folder = Path(tmp)
        for _ in range(trials):
            endpoint = f"tcp://127.0.0.1:{_free_port()}"
            config = write_config(folder, model, endpoint, source=source, spinning=spinning)
            for stale in folder.glob("optimized.onnx*"):
                stale.unlink()
            seconds, seq = _first_message(config, endpoint)
            without.append(seconds)
            seqs.append(seq)
            if not (folder / "optimized.onnx").is_file():
                raise ColdStartError("edged run did not write the optimised-model cache")
            seconds, seq = _first_message(config, endpoint)
            with_cache.append(seconds)
            seqs.append(seq)
    return ColdStart(source, without, with_cache, seqs)
