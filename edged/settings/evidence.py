"""``[evidence]``: which frames are saved as evidence, where, and for how long (`edged.evidence` saves them)."""

from __future__ import annotations

import stat
from contextvars import ContextVar
from pathlib import Path
from typing import Literal

from pydantic import Field

from edged.settings.section import Section
from edged.settings.service_dirs import service_dir

SavePolicy = Literal["ng", "ng+near", "all"]


# The folder of the configuration file being validated, set by `edged.config.load_config`: a section
# cannot see where its file is, and evidence outside systemd goes beside it.
CONFIG_FOLDER: ContextVar[Path | None] = ContextVar("edged_config_folder", default=None)

# How the default folder is named to the operator when it cannot be used.
DEFAULT_NOTE = (
    "evidence.dir is not set, so this is its default: evidence/ in the service's state directory under "
    "systemd ($STATE_DIRECTORY), else beside the configuration file; set evidence.dir to a folder edged may write"
)


def default_dir() -> Path:
    """``evidence/`` in the service's state directory (systemd's ``$STATE_DIRECTORY``), else beside the
    configuration file."""
    # Settings made without a configuration file (in code) have the working directory instead.
    return (service_dir("state") or CONFIG_FOLDER.get() or Path.cwd()) / "evidence"


def dir_problem(path: Path) -> str | None:
    """Why ``path`` can never hold evidence, whatever the permissions: it, or what is above it, is no
    folder. Found when the configuration loads; whether it can be written is `edged check`'s to try."""
    for at in (path, *path.parents):
        try:
            mode = at.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # made when the first frame is saved, unless something above is no folder
        except (OSError, ValueError):
            return None  # cannot tell here (no permission to look): tried by edged check
        if stat.S_ISDIR(mode):
            return None
        what = "a file" if stat.S_ISREG(mode) else "not a folder"
        return f"{path} is {what}" if at == path else f"{at} is {what}, so {path} cannot be made under it"
    return None


class EvidenceConfig(Section):
    dir: Path = Field(
        default_factory=default_dir,
        description="Where evidence goes, a folder per camera and day; created when its parent exists.",
    )
    save: SavePolicy = Field(
        "ng",
        description="Frames saved: 'ng' (the verdict is ng; without [inspect], any detection), 'ng+near' "
        "(also a near miss: a score within near_margin below its class threshold, or an anomaly model's "
        "image score within it below model.anomaly_threshold), 'all'.",
    )
    near_margin: float = Field(
        0.1,
        gt=0,
        le=1,
        description="ng+near: how far below its class threshold (an anomaly model's: model.anomaly_threshold) a "
        "score makes a near miss (never published).",
    )
    max_bytes: int = Field(
        1_000_000_000, gt=0, description="Most bytes this camera's evidence may take; the oldest frames go first."
    )
    max_age_days: float = Field(30.0, ge=0, description="Saved frames older than this are deleted; 0 keeps them.")
    max_per_minute: int = Field(60, ge=0, description="Most frames saved per minute; the rest are counted. 0: no limit.")
    jpeg_quality: int = Field(95, ge=1, le=100, description="JPEG quality of the saved frames.")
