"""What ``edged run`` loads: the daemon's stages, never the offline tools, their ONNX dependencies or paho."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

# In a fresh interpreter: the command line as `edged run` parses it, the daemon, and a camera
# source built the way the capture thread builds one; then every module that got imported.
RUN_IMPORTS = """
import sys
from pathlib import Path
from edged.cli import main
main(["run", "--config", sys.argv[1]])  # a missing config: stops after parsing, with exit 78
import edged.daemon
from edged.sources import open_source
from edged.sources.file import FileSourceConfig
open_source(FileSourceConfig(path=Path(sys.argv[1])))
print("\\n".join(sorted(sys.modules)))
"""


def test_edged_run_imports_no_tool_no_onnx_and_without_mqtt_no_paho(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", RUN_IMPORTS, str(tmp_path / "missing.toml")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    modules = set(result.stdout.split())
    assert "edged.daemon" in modules and "edged.sources.file" in modules
    tools = {m for m in modules if m == "edged.tools" or m.startswith("edged.tools.")}
    onnx = {m for m in modules if m.split(".")[0] in ("onnx", "sympy")}
    paho = {m for m in modules if m.split(".")[0] == "paho"}  # imported only for an [mqtt] section
    assert tools == set() and onnx == set() and paho == set()
