"""RELIABILITY.md names a test for every fault; each named test must exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_test_named_in_reliability_md_exists() -> None:
    text = (ROOT / "RELIABILITY.md").read_text()
    named = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", text)
    assert len(named) >= 30
    defined = {file: _tests_in(ROOT / file) for file in {file for file, _ in named}}  # each file parsed once
    missing = [f"{file}::{name}" for file, name in named if name not in defined[file]]
    assert not missing, f"RELIABILITY.md names tests that do not exist: {missing}"
