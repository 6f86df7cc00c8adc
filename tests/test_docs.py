"""The documents that list the package's parts name every one of them, so that they do not fall behind."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from edged.cli import _parser

ROOT = Path(__file__).parent.parent


def test_every_module_is_named_in_architecture_md() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    modules = [p for p in (ROOT / "edged").rglob("*.py") if p.stem not in ("__init__", "__main__")]
    assert len(modules) >= 100
    missing = [str(p.relative_to(ROOT)) for p in modules if not re.search(rf"`{p.stem}(\.py)?`", text)]
    assert not missing, f"ARCHITECTURE.md names no module {missing}: add each to its module map"


def test_every_command_is_in_docs_commands_md_and_the_readmes_tour() -> None:
    (commands,) = (a.choices for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert "run" in commands and "tune" in commands
    reference = (ROOT / "docs" / "commands.md").read_text()
    tour = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| [docs/commands.md]"))
    assert [c for c in commands if f"`edged {c}" not in reference] == []
    assert [c for c in commands if f"`{c}`" not in tour and f"`edged {c}`" not in tour] == []
