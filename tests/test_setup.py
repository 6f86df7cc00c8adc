"""``scripts/setup``: what it says once it has succeeded (its installs are run by ``scripts/test`` itself)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup"


@pytest.mark.unit
def test_a_successful_setup_ends_by_saying_how_to_run_edged(tmp_path: Path) -> None:
    script = SETUP.read_text()
    assert script.rstrip().splitlines()[-1] == "how_to_run", "the last thing setup does, after every install"
    function = script[script.index("how_to_run() {") : script.index("\n}\n", script.index("how_to_run() {")) + 3]
    said = subprocess.run(
        ["bash", "-c", f"{function}how_to_run"], cwd=tmp_path, capture_output=True, text=True, check=True, timeout=30
    ).stdout
    assert f"Run it as {tmp_path}/.venv/bin/edged," in said
    assert f"    . {tmp_path}/.venv/bin/activate\n    edged --help\n" in said
