"""Running the real daemon in tests: `edged run` as a subprocess, read over a real SUB socket."""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import cv2
import numpy as np
import zmq

from edged.messages import AnyMessage, DetectionsMessage, StatusMessage, parse_message

Message = AnyMessage


PORT_BLOCK = 1000  # ports of one test process
PORT_BLOCKS = 16  # blocks just below the kernel's ephemeral range


def _port_block() -> range:
    """This test process's own ports: a block just below the kernel's ephemeral range that no other
    test process on the machine holds.

    Each process claims its block with a lock on a file (`fcntl.flock`), held until it exits, so
    two test runs side by side, or a run beside a single test, never share one; an xdist worker
    tries its own block first. Where every block is held, or the range leaves no room, the kernel
    picks (`free_port`).
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    first_choice = int(worker) % PORT_BLOCKS if worker.isdigit() else 0
    locks = Path(tempfile.gettempdir()) / f"edged-test-ports-{os.getuid()}"
    locks.mkdir(exist_ok=True)
    for k in range(PORT_BLOCKS):
        index = (first_choice + k) % PORT_BLOCKS
        first = low - (index + 1) * PORT_BLOCK
        if first < 1024:
            continue
        lock = (locks / f"{first}.lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        _HELD.append(lock)
        return range(first, first + PORT_BLOCK)
    return range(0)


_HELD: list[IO[str]] = []  # the lock on this process's block, held open until it exits
_BLOCK = _port_block()
_next = itertools.count()


def free_port() -> int:
    """A loopback port free now, for a daemon to bind later.

    A port the kernel picks (bind to 0) is one it may pick again for another worker's test, or as a
    client socket's own port, before the daemon binds it; then two daemons share a test's port, and
    the test reads the other's answers. So each test process hands out its own block in turn, below
    the ephemeral range (`_port_block`); where it has none, the kernel picks.
    """
    for _ in range(len(_BLOCK)):
        port = _BLOCK[next(_next) % len(_BLOCK)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(str(value))


def write_config(path: Path, sections: dict[str, dict[str, Any] | list[dict[str, Any]]]) -> Path:
    """A config file of ``sections``, a list being an array of tables (``[[source]]``); the HTTP server
    is off unless a section says otherwise, so that daemons started side by side do not compete
    for its default port."""
    lines = []
    for name, tables in {"http": {"listen": ""}, **sections}.items():
        for keys in tables if isinstance(tables, list) else [tables]:
            lines.append(f"[[{name}]]" if isinstance(tables, list) else f"[{name}]")
            lines += [f"{key} = {toml_value(value)}" for key, value in keys.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def images_config(
    tmp_path: Path, model_file: Path, images: Sequence[Path], endpoint: str, **sections: dict[str, Any]
) -> Path:
    """``tmp_path/edged.toml``: ``model_file`` (copied beside it) on a looping folder of ``images`` at 10 fps,
    publishing on ``endpoint``; each of ``sections`` is added, or its keys put over the table's."""
    shutil.copy(model_file, tmp_path / model_file.name)
    (tmp_path / "frames").mkdir()
    for image in images:
        shutil.copy(image, tmp_path / "frames" / image.name)
    doc: dict[str, dict[str, Any]] = {
        "source": {"type": "images", "path": "frames", "loop": True, "fps": 10},
        "model": {"path": model_file.name},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.5},
        "thermal": {"enabled": False},
    }
    for name, keys in sections.items():
        doc.setdefault(name, {}).update(keys)
    return write_config(tmp_path / "edged.toml", doc)


def write_video(
    path: Path, colours: list[tuple[int, int, int]], size: tuple[int, int] = (128, 96), fps: float = 20.0
) -> Path:
    """An MJPG video whose frame i is a solid colours[i] (BGR), decodable by OpenCV's FFmpeg."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, size)
    frame = np.empty((size[1], size[0], 3), np.uint8)
    for colour in colours:
        frame[:] = colour
        writer.write(frame)
    writer.release()
    return path


def board_config(tmp_path: Path, root: Path, endpoint: str, fps: float = 20.0, **sections: dict[str, Any]) -> Path:
    """``tmp_path/edged.toml``: the colour probe on a looping red clip at ``fps``, the thermal watch on
    the board tree ``root`` polled every 0.2 s, a status every 0.25 s on ``endpoint``; ``sections`` added."""
    from onnx_models import colour_probe

    colour_probe(tmp_path / "probe.onnx")
    write_video(tmp_path / "clip.avi", [(0, 0, 255)] * 40, fps=fps)
    doc: dict[str, dict[str, Any]] = {
        "source": {"type": "file", "path": "clip.avi", "loop": True, "realtime": True},
        "model": {"path": "probe.onnx"},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.25},
        "thermal": {"root": str(root), "poll_interval_s": 0.2, "use_vcgencmd": False},
    }
    return write_config(tmp_path / "edged.toml", doc | sections)


def write_mjpeg(path: Path, width: int, height: int, frames: int = 3) -> Path:
    """A video of ``frames`` black ``width`` x ``height`` JPEGs one after another (FFmpeg's raw MJPEG, as
    an IP camera's HTTP stream is recorded): 1.6 MB a frame at 10000x10000, encoded from zeros never
    written, so making it costs no such frame in memory."""
    jpeg = cv2.imencode(".jpg", np.zeros((height, width, 3), np.uint8))[1].tobytes()
    path.write_bytes(jpeg * frames)
    return path


MEMORY_LIMIT_ENV = {"MALLOC_ARENA_MAX": "2"}  # address space reserved per thread, whatever the cores: see `limit_memory`


def limit_memory(pid: int, limit_bytes: int) -> None:
    """Cap a daemon's address space (RLIMIT_AS) at ``limit_bytes``: an allocation past it fails instead of
    taking the machine's memory. Set from outside as soon as it starts, long before its first frame (a
    preexec_fn may deadlock a child forked beside threads); start it with `MEMORY_LIMIT_ENV`, so that
    glibc's arenas, 64 MB of address space each and one per thread up to 8 per core, do not make the
    limit depend on the machine's cores."""
    resource.prlimit(pid, resource.RLIMIT_AS, (limit_bytes, limit_bytes))


def peak_rss_kb(pid: int) -> int:
    """A running process's peak resident memory (VmHWM) in KB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for process {pid}")


def rss_kb(pid: int) -> int:
    """A process's resident memory in KB, for tests that assert it stays flat."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for process {pid}")


def edged_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "edged", *args]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        edged_command(*args), capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


class RunningDaemon:
    """`edged run` in a subprocess plus a SUB socket on its endpoint; always killed at the end."""

    def __init__(
        self,
        config: Path,
        endpoint: str,
        env: dict[str, str] | None = None,
        wrap: Callable[[list[str]], list[str]] | None = None,
    ) -> None:
        """``wrap``: the command line run in place of ``edged run``'s (a namespace of its own, say)."""
        self.endpoint = endpoint
        self._context = zmq.Context()
        self.sub = self._context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.log_path = config.with_suffix(".log")
        self._log = self.log_path.open("w")
        argv = edged_command("run", "--config", str(config))
        self.proc = subprocess.Popen(
            wrap(argv) if wrap is not None else argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def messages(self, timeout: float) -> Iterator[Message]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.proc.poll() is not None and not self.sub.poll(0):
                raise AssertionError(f"edged exited with {self.proc.returncode}:\n{self.log()}")
            if self.sub.poll(int(min(left, 0.5) * 1000) + 1):
                topic, payload = self.sub.recv_multipart()
                msg = parse_message(payload)
                assert topic.decode().split("/")[1] == msg.kind
                yield msg

    def collect(self, kind: str, count: int, timeout: float = 20) -> list[Message]:
        got = [m for m in self._until(kind, count, timeout)]
        if len(got) < count:
            raise AssertionError(f"only {len(got)} {kind} message(s) in {timeout} s:\n{self.log()}")
        return got

    def _until(self, kind: str, count: int, timeout: float) -> Iterator[Message]:
        n = 0
        for msg in self.messages(timeout):
            if msg.kind == kind:
                n += 1
                yield msg
                if n >= count:
                    return

    def captured_after(self, since_ns: int, count: int, timeout: float = 20) -> list[DetectionsMessage]:
        """``count`` detections messages of frames captured after ``since_ns`` (wall clock): published since."""
        got: list[DetectionsMessage] = []
        for msg in self.messages(timeout):
            if isinstance(msg, DetectionsMessage) and msg.capture_time_ns > since_ns:
                got.append(msg)
                if len(got) == count:
                    return got
        raise AssertionError(f"only {len(got)} frame(s) captured since then were published in {timeout} s:\n{self.log()}")

    def wait_status(self, condition: Callable[[StatusMessage], bool], timeout: float = 20) -> StatusMessage:
        """The first status message that satisfies ``condition``."""
        for msg in self.messages(timeout):
            if isinstance(msg, StatusMessage) and condition(msg):
                return msg
        raise AssertionError(f"no status message satisfied the condition in {timeout} s:\n{self.log()}")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 5) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.close()

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.sub.close(linger=0)
        self._context.term()
        self._log.close()


def served_and_stopped(config: Path, endpoint: str) -> tuple[list[tuple[str, tuple[float, ...]]], str]:
    """The daemon on ``config``: its first detections message's (label, box) pairs, once it has
    stopped with exit 0 on SIGTERM, and its whole log."""
    daemon = RunningDaemon(config, endpoint)
    try:
        (message,) = daemon.collect("detections", 1, timeout=60)
        assert isinstance(message, DetectionsMessage)
        assert daemon.stop(timeout=15) == 0, daemon.log()
    finally:
        daemon.close()
    return [(d.label, d.box) for d in message.detections], daemon.log_path.read_text()


def refused_by_check_and_run(config: Path, endpoint: str, *check: str) -> tuple[str, str]:
    """`edged check` (with ``check``'s options) and `edged run` of ``config``, each of which must exit 78:
    what each said (check's stderr, the daemon's log)."""
    checked = run_cli("check", *check, "--config", str(config))
    assert checked.returncode == 78, checked.stdout + checked.stderr
    d = RunningDaemon(config, endpoint)
    try:
        assert d.proc.wait(60) == 78, d.log()
        return checked.stderr, d.log()
    finally:
        d.close()
