"""The camera kinds: ``source.type`` -> the reader built from its settings, and the checks a kind
runs when the configuration loads.

`edged.settings.sources.KINDS` lists the same names with their settings classes (a test holds the
two lists equal); the configuration's ``source.type`` union and error hints come from there, and
`open_source` from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from edged.settings.sources import SourceBase
from edged.sources import gstreamer, picamera2
from edged.sources.base import Source, frames_vary_in_size
from edged.sources.file import FileSource
from edged.sources.gstreamer import GstreamerSource
from edged.sources.images import ImagesSource
from edged.sources.picamera2 import Picamera2Source
from edged.sources.rtsp import RtspSource
from edged.sources.synthetic import SyntheticSource
from edged.sources.v4l2 import V4l2Source

# source.type -> the source built from that kind's settings.
SOURCES: dict[str, Callable[[Any], Source]] = {
    "synthetic": SyntheticSource,
    "file": FileSource,
    "images": ImagesSource,
    "v4l2": V4l2Source,
    "picamera2": Picamera2Source,
    "rtsp": RtspSource,
    "gstreamer": GstreamerSource,
}

# source.type -> what its runtime refuses when the configuration loads (a missing library, a
# pipeline that does not parse), beyond the files its settings check themselves.
CHECKS: dict[str, Callable[[Any], list[str]]] = {
    "picamera2": picamera2.config_problems,
    "gstreamer": gstreamer.config_problems,
}


def config_problems(cfg: SourceBase) -> list[str]:
    """Everything that would stop camera ``cfg`` from ever opening, one line each."""
    check = CHECKS.get(cfg.type)
    return cfg.file_problems() + (check(cfg) if check is not None else [])


def sizes_vary(cfg: SourceBase) -> bool:
    """Whether the source ``cfg`` builds declares ``frame_sizes_vary`` (see `edged.sources.base.Source`)."""
    return frames_vary_in_size(SOURCES[cfg.type])


def open_source(cfg: SourceBase) -> Source:
    """Build (not open) the source for ``cfg``; the capture thread opens it.

    Pass ``lambda: open_source(cfg)`` to ``Capture`` so that every reconnect starts from a fresh
    source object.
    """
    return SOURCES[cfg.type](cfg)
