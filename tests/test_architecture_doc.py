"""ARCHITECTURE.md's module map names every module of the package, so that it does not fall behind."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_every_module_is_named_in_architecture_md() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    modules = [p for p in (ROOT / "edged").rglob("*.py") if p.stem not in ("__init__", "__main__")]
    assert len(modules) >= 100
    missing = [str(p.relative_to(ROOT)) for p in modules if not re.search(rf"`{p.stem}(\.py)?`", text)]
    assert not missing, f"ARCHITECTURE.md names no module {missing}: add each to its module map"
