"""Shared test set-up: tests import their model builders from this folder; unmarked tests are unit tests.

The .deb is built here, once per run (one pytest-xdist worker builds it, the others wait for it),
for the packaging tests and the systemd tests alike.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from dns_server import DnsServer  # a helper of this folder, importable once it is on the path

# A run started in the background by a shell without job control (`cmd &` in a script) inherits
# SIGINT ignored, and every process it starts with it: the tests that press Ctrl-C on a tool or the
# daemon need it as a terminal gives it. A handler here is reset to the default in each child.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

CATEGORIES = ("unit", "integration", "packaging", "tools")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A module marks itself integration, packaging or tools (``pytestmark``); everything else is unit.

    The packaging tests go first, in their order: the longest of the suite (the .deb built, containers
    booted, an upgrade played through), which pytest-xdist, handing out consecutive tests, gave the
    workers last, so that the run ended waiting on them alone. First, they go to one worker at the
    start (none waits for another's build of the .deb) while the others take the rest."""
    for item in items:
        if not any(item.get_closest_marker(name) for name in CATEGORIES):
            item.add_marker(pytest.mark.unit)
    items.sort(key=lambda item: item.get_closest_marker("packaging") is None)


@pytest.fixture
def dns() -> Iterator[DnsServer]:
    """A DNS server of the test's own on a loopback address (`dns_server.DnsServer`), stopped after."""
    server = DnsServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """packaging/build-deb's package, built by the first worker that asks for it; each worker's
    session fixture would build it again, 20 s of both cores."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _build_deb(tmp_path_factory.mktemp("deb"))
    run = tmp_path_factory.getbasetemp().parent  # this run's folder, shared by its workers
    with (run / "deb.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = run / "deb.path"
        if not built.exists():
            out = run / "deb"
            out.mkdir()
            built.write_text(str(_build_deb(out)))
        return Path(built.read_text())


def _build_deb(out: Path) -> Path:
    """packaging/build-deb's package in ``out``, left uncompressed: xz took minutes of CPU, and gzip -1
    still 10 s here and more again in lintian, dpkg and the containers, each unpacking it."""
    repo = Path(__file__).resolve().parent.parent
    for required in ("config/edged.toml", "models/demo.onnx", "models/demo.labels"):
        if not (repo / required).exists():
            pytest.fail(f"{required} is missing: the package cannot be built without it")
    env = dict(os.environ, DPKG_DEB_COMPRESSOR_TYPE="none", PIP=f"{sys.executable} -m pip")
    proc = subprocess.run(
        [str(repo / "packaging" / "build-deb"), "--output-dir", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"build-deb failed:\n{proc.stderr[-4000:]}"
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert path.parent == out
    return path
