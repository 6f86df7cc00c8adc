"""Shared test set-up: tests import their model builders from this folder; unmarked tests are unit tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

CATEGORIES = ("unit", "integration", "packaging", "tools")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A module marks itself integration, packaging or tools (``pytestmark``); everything else is unit."""
    for item in items:
        if not any(item.get_closest_marker(name) for name in CATEGORIES):
            item.add_marker(pytest.mark.unit)
