"""``[journal]``: the local record of every verdict (`edged.journal` keeps it)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from edged.settings.section import Section
from edged.settings.service_dirs import service_dir

JOURNAL_FILE = "journal.sqlite"


def default_path(config_dir: Path | None) -> Path:
    """The journal in the service's state directory (systemd's ``$STATE_DIRECTORY``); outside systemd
    beside the configuration file, or in the working directory without one."""
    return (service_dir("state") or config_dir or Path.cwd()) / JOURNAL_FILE


class JournalConfig(Section):
    enabled: bool = Field(True, description="Record every verdict in a local SQLite file that survives crashes and outages.")
    path: Path | None = Field(
        None,
        description="The journal file; its folder must exist. Default: journal.sqlite in the service's state "
        "directory under systemd, else beside the configuration file.",
    )
    detections: bool = Field(
        False, description="Also record every detections message sent (one row per frame with results: large)."
    )
    durability: Literal["normal", "full"] = Field(
        "normal",
        description="'normal': a crash of edged loses nothing recorded, a power cut may lose the last batch "
        "(SQLite WAL, synchronous=NORMAL); 'full': every batch is on the disk before the next (fsync; more SD wear).",
    )
    max_bytes: int = Field(500_000_000, gt=0, description="Most bytes the journal may take; the oldest rows go first.")
    max_age_days: float = Field(
        90.0,
        ge=0,
        le=36500,
        description="Rows older than this are deleted; 0 keeps them (at most 36500: a century). A verdict MQTT "
        "has still to send is kept whatever its age, within max_bytes.",
    )

    @property
    def file(self) -> Path:
        """``path``, which `edged.config.load_config` fills in; settings built in code take the default."""
        return self.path or default_path(None)
