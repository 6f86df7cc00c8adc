"""The node, and the pinned npm packages beside it, that the interop tests run other stacks' clients
with (node-opcua, zeromq.js, mqtt.js, ajv): scripts/setup test installs npm from apt where it is
absent, then node 22 and the packages from npm into .node-opcua/ (a distribution's node may be
older than the clients need)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

NODE_MODULES = Path(__file__).resolve().parent.parent / ".node-opcua" / "node_modules"


def node(*packages: str) -> str:
    """The node installed beside ``packages``: a failure where it or they are missing (on CI above
    all), a skip only where npm itself is absent."""
    found = NODE_MODULES / ".bin" / "node"
    if found.exists() and all((NODE_MODULES / name).is_dir() for name in packages):
        return str(found)
    wanted = ", ".join(("node 22", *packages))
    if shutil.which("npm") is None and not os.environ.get("CI"):
        pytest.skip(f"npm is absent: scripts/setup test installs it (apt npm), then {wanted}")
    pytest.fail(f"{wanted} are not installed in {NODE_MODULES.parent}: run scripts/setup test")
