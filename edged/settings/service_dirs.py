"""The folders systemd makes for the service (the units' ``StateDirectory=``, ``CacheDirectory=`` and
``RuntimeDirectory=``), read from its environment here only, so that every default that follows
them follows them alike."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

Kind = Literal["state", "cache", "runtime"]


def service_dirs(kind: Kind) -> tuple[Path, ...]:
    """The service's ``kind`` folders: systemd's ``$STATE_DIRECTORY``, ``$CACHE_DIRECTORY`` or
    ``$RUNTIME_DIRECTORY`` (several are joined by ``:``); none outside systemd."""
    return tuple(Path(d) for d in os.environ.get(f"{kind.upper()}_DIRECTORY", "").split(":") if d)


def service_dir(kind: Kind) -> Path | None:
    """The first of `service_dirs`, edged's own; None outside systemd."""
    return next(iter(service_dirs(kind)), None)
