"""``edged.tools.bench_process``: what a bench starts ends with it, whenever a signal lands."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from edged.tools.bench_process import start

pytestmark = pytest.mark.tools


def _blocked(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)])
def test_a_signal_that_lands_in_the_fork_hooks_still_ends_the_bench(signum: int, code: int) -> None:
    # A fork hook sends the signal, so it lands where logging's own hook would run: inside one, the
    # exception the handler raises (SystemExit, KeyboardInterrupt) is printed and dropped, and the
    # program went on to say "ran on".
    script = f"""
import os, signal
from edged.cli import _exit_on_signal
from edged.tools.bench_process import start
signal.signal(signal.SIGTERM, _exit_on_signal)
os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), {int(signum)}))
start(["true"]).wait()
print("ran on")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (code, ""), done.stderr


def test_the_child_gets_the_benchs_signal_mask_back_and_ends_on_sigterm() -> None:
    child = start(["sleep", "60"])
    try:
        assert _blocked(child.pid) == _blocked(int(Path("/proc/thread-self").resolve().name))
        child.terminate()
        assert child.wait(10) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()
