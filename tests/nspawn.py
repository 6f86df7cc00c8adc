"""A real systemd in tests: a container booted with ``systemd-nspawn -b``, systemd its PID 1.

The root file system is a cached debootstrap of the host's release (``scripts/setup test`` makes
it). It boots with ``--volatile=overlay``, so everything written inside (the installed .deb,
changed configs, the journal) lands in a tmpfs and the cache stays clean. The host has no system
bus and no machined, hence ``--register=no --keep-unit``; commands reach the container through
``nsenter`` into the namespaces of its PID 1, not ``machinectl``. ``--private-network`` leaves the
container only its own loopback.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path


def _codename() -> str:
    for line in Path("/etc/os-release").read_text().splitlines():
        key, _, value = line.partition("=")
        if key == "VERSION_CODENAME":
            return value.strip('"')
    return "unknown"


# The same default as scripts/setup, which makes it.
ROOTFS = Path(os.environ.get("EDGED_TEST_ROOTFS") or f"/var/cache/edged-test/rootfs-{_codename()}")
ENV = ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "SYSTEMD_PAGER=cat", "SYSTEMD_COLORS=0", "TERM=dumb"]


def unavailable(rootfs: Path) -> str | None:
    """Why a container cannot be booted here, or None when it can be tried."""
    if os.geteuid() != 0:
        return "systemd-nspawn needs root"
    missing = [tool for tool in ("systemd-nspawn", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (apt install systemd-container util-linux)"
    if not (rootfs / "lib" / "systemd" / "systemd").exists():
        return f"no test rootfs at {rootfs} (set EDGED_TEST_ROOTFS, or run scripts/setup test as root to debootstrap it)"
    return None


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """tests/waiting.py's wait_for at a pace fit for checks that fork nsenter and systemctl each time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


class BootFailed(Exception):
    """The container did not come up; the message carries nspawn's own words."""


class Container:
    """A booted container, driven from the host through its PID 1's namespaces."""

    def __init__(self, pid1: int) -> None:
        self.pid1 = pid1

    def run(self, *args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``args`` inside the container as its root, with a clean environment."""
        return subprocess.run(
            ["nsenter", "-t", str(self.pid1), "-a", "env", "-i", *ENV, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ok(self, *args: str, stdin: str | None = None, timeout: float = 120) -> str:
        """Stdout of ``args``, which must succeed."""
        proc = self.run(*args, stdin=stdin, timeout=timeout)
        assert proc.returncode == 0, f"{' '.join(args)}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def popen(self, *args: str) -> subprocess.Popen[str]:
        """``args`` inside the container, running in the background; stdout and stderr piped."""
        return subprocess.Popen(
            ["nsenter", "-t", str(self.pid1), "-a", "env", "-i", *ENV, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def write(self, path: str, text: str) -> None:
        self.ok("sh", "-c", 'cat > "$1"', "sh", path, stdin=text)

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        """The manager's live view of ``unit``: ``systemctl show`` properties by name."""
        out = self.ok("systemctl", "show", unit, *(f"--property={p}" for p in properties))
        pairs = (line.partition("=") for line in out.splitlines())
        return {key: value for key, _, value in pairs}

    def journal_cursor(self) -> str:
        out = self.ok("journalctl", "--lines=0", "--show-cursor", "--quiet")
        return out.strip().removeprefix("-- cursor: ")

    def journal(self, cursor: str, *filters: str) -> str:
        """Journal lines written since ``cursor`` (short format), ``filters`` as journalctl takes them."""
        return self.ok("journalctl", "--no-hostname", f"--after-cursor={cursor}", *filters)

    def journal_once(self, cursor: str, text: str, *filters: str, timeout_s: float = 30) -> str:
        """`journal` once it holds ``text``: what the manager says of a unit it has just marked failed or
        restarted reaches journald a moment later, and a read at once may miss it."""
        said = ""

        def holds() -> bool:
            nonlocal said
            said = self.journal(cursor, *filters)
            return text in said

        wait_until(holds, timeout_s)
        return said


def _child_named(parent: int, name: str) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == parent and comm == name:
            return int(entry.name)
    return None


@contextmanager
def booted(rootfs: Path, log: Path, binds: Mapping[Path, str], timeout_s: float = 120) -> Iterator[Container]:
    """A container booted from ``rootfs`` until its manager is up; powered off (SIGTERM to nspawn) on exit.

    ``binds`` maps host directories to read-only paths inside. Raises BootFailed with nspawn's
    output when systemd does not reach ``running`` (or ``degraded``) in ``timeout_s``.
    """
    machine = f"edged-test-{os.getpid()}"
    command = [
        "systemd-nspawn",
        "--boot",
        f"--directory={rootfs}",
        "--volatile=overlay",
        "--register=no",
        "--keep-unit",
        "--private-network",
        f"--machine={machine}",
        "--console=pipe",
        *(f"--bind-ro={host}:{inside}" for host, inside in binds.items()),
    ]
    with log.open("w") as out:
        nspawn = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        pid1: list[int] = []

        def manager_up() -> bool:
            if nspawn.poll() is not None:
                return True
            if not pid1:
                found = _child_named(nspawn.pid, "systemd")
                if found is None:
                    return False
                pid1.append(found)
            state = Container(pid1[0]).run("systemctl", "is-system-running", timeout=30).stdout.strip()
            return state in ("running", "degraded")

        wait_until(manager_up, timeout_s)
        if nspawn.poll() is not None or not pid1:
            raise BootFailed(f"systemd-nspawn did not boot {rootfs}: {log.read_text()[-2000:]}")
        container = Container(pid1[0])
        state = container.run("systemctl", "is-system-running").stdout.strip()
        if state not in ("running", "degraded"):
            raise BootFailed(f"the container's systemd is {state!r} after {timeout_s:.0f} s: {log.read_text()[-2000:]}")
        yield container
    finally:
        nspawn.send_signal(signal.SIGTERM)  # nspawn turns it into a clean poweroff of the container
        try:
            nspawn.wait(timeout=60)
        except subprocess.TimeoutExpired:
            nspawn.kill()
            nspawn.wait()
