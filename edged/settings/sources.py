"""``[source]``: the keys every camera kind shares, and each kind's own (`edged.sources` reads the cameras).

A camera kind's keys are one class here, with ``type`` its name; `KINDS` lists them for the
configuration's ``source.type`` union and its error hints, and `edged.sources.registry` maps the
same names to the readers. Checks that need a kind's runtime (its library, a pipeline parse) live
with the kind (`edged.sources.registry.config_problems`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from edged.settings.evidence import EvidenceConfig
from edged.settings.inspect import InspectConfig, ZoneName, usable_zones
from edged.settings.reject import RejectConfig
from edged.settings.section import Name, Section

# How a camera's frames are taken: every one the rate allows ("free"), or one per inspection request.
TriggerMode = Literal["free", "request"]


_CREDENTIALS = re.compile(r"(?<=://)[^/\s]+@")  # user[:password]@ after a URL's scheme (ipc://@name has none)
MIN_SIDE, MAX_WIDTH, MAX_HEIGHT = 32, 7680, 4320  # the frame sizes asked of a camera or generated: up to 8K
MAX_SIDE = 65535  # the longest side of an image file decoded (`edged.sources.images`), a JPEG's longest
# The longest side libjpeg encodes (its JPEG_MAX_DIMENSION): a PNG may be taller or wider, up to MAX_SIDE,
# so the live view scales such a frame to it and evidence saves such a frame as PNG.
JPEG_MAX_SIDE = 65500


def mask_credentials(text: str) -> str:
    """``text`` with every URL's ``user:password@`` replaced by ``***@``: how edged shows a source anywhere.

    It works on any text holding URLs (an RTSP URL, a pipeline with a ``location=`` URL, an error),
    so logs, status messages, ``edged check`` and configuration errors never show a camera's password.
    """
    return _CREDENTIALS.sub("***@", text)


def _switch_or_table(value: Any) -> str:
    """Which reading of a camera's ``evidence`` key applies, so that a bad table gets its own error only."""
    return "table" if isinstance(value, (dict, EvidenceConfig)) else "switch"


# A camera's evidence: true or false, or a [source.evidence] table.
CameraEvidence = Annotated[
    Annotated[bool, Tag("switch")] | Annotated[EvidenceConfig, Tag("table")], Discriminator(_switch_or_table)
]


class SourceBase(Section):
    """The ``[source]`` keys every camera kind has; each kind's module adds ``type`` and its own keys."""

    # What is done with the camera's frames, not how it is opened: a reload that changes only these
    # keeps the camera's capture running.
    PROCESSING_KEYS: ClassVar[frozenset[str]] = frozenset({"max_fps", "evidence", "inspect", "zones", "trigger", "reject"})

    type: str = Field(description="The camera kind: it decides which other keys apply.")
    camera_id: Name = Field(
        "cam0", description="Name of this camera, unique among the [[source]] tables; used as the ZeroMQ topic suffix."
    )
    max_fps: float | None = Field(
        None, ge=0, le=1000, description="Cap on this camera's processed frames per second; default: service.max_fps."
    )
    evidence: CameraEvidence = Field(
        True,
        description="false: save none of this camera's evidence; a [source.evidence] table: this camera's "
        "evidence keys, in place of those keys of [evidence] (the others come from there), saved even "
        "without an [evidence] section; true: [evidence] as it is.",
    )
    inspect: InspectConfig | None = Field(
        None,
        description="A [source.inspect] table: this camera's inspection keys, in place of those keys of "
        "[inspect] (the others come from there); the camera is inspected even without an [inspect] section.",
    )
    reject: RejectConfig | None = Field(
        None,
        description="A [source.reject] table: this camera's reject-line keys, in place of those keys of [reject] "
        "(the others come from there); the camera drives a reject line even without a [reject] section.",
    )
    trigger: TriggerMode | None = Field(
        None, description="This camera's trigger.mode ('free' or 'request'); default: trigger.mode."
    )
    zones: dict[ZoneName, list[tuple[float, float]]] | None = Field(
        None, description="Short for this camera's inspect.zones: its zones in place of inspect.zones."
    )

    @field_validator("zones")
    @classmethod
    def _usable_zones(cls, v: dict[str, list[tuple[float, float]]] | None) -> dict[str, list[tuple[float, float]]] | None:
        if v is not None:
            usable_zones(v)
        return v

    @model_validator(mode="after")
    def _zones_once(self) -> SourceBase:
        """``zones`` is short for inspect.zones: both at once would leave the user guessing which wins."""
        if self.zones is not None and self.inspect is not None and "zones" in self.inspect.model_fields_set:
            raise ValueError(f"camera {self.camera_id} gives its zones twice, as zones and as inspect.zones: keep one")
        return self

    channel_order: Literal["bgr", "rgb"] = Field(
        "bgr",
        description="Channel order of the frames this source delivers: bgr, except where the kind can "
        "deliver rgb (picamera2, gstreamer). Not the model's order: that is model.channel_order.",
    )

    # Why this kind delivers bgr frames only, or None when it can deliver either order: declaring rgb
    # where the frames are bgr swaps red and blue before the model, which shifts every score.
    BGR_ONLY: ClassVar[str | None] = "OpenCV decodes its frames, and OpenCV always delivers bgr"

    @field_validator("channel_order")
    @classmethod
    def _deliverable(cls, v: str) -> str:
        if v != "bgr" and cls.BGR_ONLY is not None:
            raise ValueError(
                f"{v!r} cannot be right for source type {cls.model_fields['type'].default!r}: {cls.BGR_ONLY}; "
                "remove the key (the order the model takes is model.channel_order, and edged converts to it)"
            )
        return v

    def opening(self) -> dict[str, Any]:
        """The keys that decide how the camera is opened, with their values: all but `PROCESSING_KEYS`."""
        return self.model_dump(exclude=set(self.PROCESSING_KEYS))

    @property
    def ends(self) -> bool:
        """Whether the source reaches an end (a file or folder read once): what it gives is over in
        seconds, so the stream's subscribers already waiting are heard first (`edged.publish`)."""
        return getattr(self, "loop", True) is False

    @property
    def opens_within_s(self) -> float | None:
        """How long the camera may take to open and give its first frame before it counts as lost (a
        stream's ``open_timeout_s``); None where its kind sets no such limit."""
        return None

    def file_problems(self) -> list[str]:
        """Files this source needs that are missing, one line each, reported when the config loads.

        ``edged check`` and start-up then refuse them with the configuration's other problems
        instead of the capture thread retrying a camera that can never open.
        """
        return []


class FileSourceConfig(SourceBase):
    type: Literal["file"] = "file"
    path: Path = Field(description="Video file decoded with OpenCV's FFmpeg backend.")
    loop: bool = Field(True, description="Start again at the end instead of reporting end of stream.")
    realtime: bool = Field(
        True,
        description="Pace frames to the file's own fps, like a camera: a frame that comes while the model is "
        "busy is dropped. false: every frame once per pass, each decoded as soon as the model has taken the one "
        "before, none dropped (a recorded shift checked offline).",
    )

    def file_problems(self) -> list[str]:
        # os.path.isfile, unlike Path.is_file, answers False for a name the filesystem cannot hold.
        if os.path.isfile(self.path):
            return []
        if os.path.isdir(self.path):
            return [f'source.path: {self.path} is a folder, not a video file (a folder of images is type = "images")']
        return [f"source.path: video file {self.path} does not exist"]


class ImagesSourceConfig(SourceBase):
    type: Literal["images"] = "images"
    path: str = Field(
        description="A folder (every image in it, sorted) or a glob pattern. JPEG, PNG, WebP, BMP or TIFF "
        f"images of at most {MAX_WIDTH * MAX_HEIGHT} pixels ({MAX_WIDTH}x{MAX_HEIGHT}) and {MAX_SIDE} on a side "
        "are read; others, and images cut short (a JPEG still being written), are skipped, logged and counted."
    )
    loop: bool = Field(True, description="Start again after the last image.")
    fps: float = Field(5.0, gt=0, le=240, description="Images delivered per second (with pace = true).")
    pace: bool = Field(
        True,
        description="true: deliver fps images per second like a camera, the model taking the newest; false: "
        "every image once per pass, each read as soon as the model has taken the one before, none dropped.",
    )


class SyntheticSourceConfig(SourceBase):
    BGR_ONLY = "its scenes are rendered in bgr"

    type: Literal["synthetic"] = "synthetic"
    width: int = Field(1280, ge=MIN_SIDE, le=MAX_WIDTH, description="Frame width in pixels.")
    height: int = Field(720, ge=MIN_SIDE, le=MAX_HEIGHT, description="Frame height in pixels.")
    fps: float = Field(15.0, gt=0, le=240, description="Frames generated per second.")
    seed: int = Field(
        0,
        ge=0,
        description="Scene seed; the same seed gives the same stream. Its textures (31 MB) are made at the first start "
        "and kept for the next in the cache directory ($CACHE_DIRECTORY/scenes under systemd, else ~/.cache/edged/scenes), "
        "which keeps the most recently used within 256 MB.",
    )


class V4l2SourceConfig(SourceBase):
    type: Literal["v4l2"] = "v4l2"
    device: str = Field("/dev/video0", description="Device path or index (e.g. 0).")
    width: int = Field(1280, ge=MIN_SIDE, le=MAX_WIDTH, description="Requested width; read back after open.")
    height: int = Field(720, ge=MIN_SIDE, le=MAX_HEIGHT, description="Requested height; read back after open.")
    fps: float = Field(30.0, gt=0, le=240, description="Requested frame rate.")
    fourcc: Literal["MJPG", "YUYV"] = Field("MJPG", description="Pixel format asked of the camera.")


DEFAULT_PORTS = {"rtsp": 554, "rtsps": 322}


class RtspSourceConfig(SourceBase):
    type: Literal["rtsp"] = "rtsp"
    url: str = Field(
        description="rtsp:// or rtsps:// URL of the stream; user:password@ in it is allowed and never logged.",
    )
    transport: Literal["tcp", "udp"] = Field(
        "tcp", description="RTP transport: tcp survives packet loss and NAT; udp has less latency on a clean LAN."
    )
    open_timeout_s: float = Field(
        10.0, gt=0, le=120, description="Longest wait to connect and get the first frame; until then the camera is starting."
    )
    read_timeout_s: float = Field(
        5.0, gt=0, le=120, description="No new frame for this long means the camera stalled: it is lost and reopened."
    )

    @property
    def opens_within_s(self) -> float:
        return self.open_timeout_s

    @field_validator("url")
    @classmethod
    def _rtsp_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
            raise ValueError("must be an rtsp:// or rtsps:// URL with a host")
        return url


ControlValue = bool | int | float | list[int] | list[float]


# Controls that edged sets from its own keys; setting them in source.controls as well would fight them.
OWN_CONTROLS: dict[str, str] = {"FrameDurationLimits": "source.fps", "FrameRate": "source.fps"}


class Picamera2SourceConfig(SourceBase):
    BGR_ONLY = None  # the ISP writes either order

    type: Literal["picamera2"] = "picamera2"
    camera: int = Field(0, ge=0, le=15, description="Camera index as libcamera lists them (`rpicam-hello --list-cameras`).")
    width: int = Field(1280, ge=64, le=9152, description="Width of the main stream; the ISP scales the sensor mode to it.")
    height: int = Field(720, ge=64, le=6944, description="Height of the main stream.")
    fps: float = Field(30.0, gt=0, le=240, description="Frame rate; sets FrameDurationLimits to a fixed 1/fps.")
    buffer_count: int = Field(
        4,
        ge=2,
        le=16,
        description="Frame buffers: picamera2 keeps one queued and edged holds one while copying; "
        "the rest keep the sensor streaming (each costs width x height x 3 bytes of CMA memory).",
    )
    controls: dict[str, ControlValue] = Field(
        default_factory=dict,
        description="libcamera controls passed to set_controls, e.g. ExposureTime, AnalogueGain, AfMode "
        "(names as the camera's camera_controls list them; checked when the camera opens).",
    )
    hflip: bool = Field(False, description="Mirror the image left to right (in the ISP, at no cost).")
    vflip: bool = Field(False, description="Flip the image upside down (with hflip: rotate by 180 degrees).")

    @field_validator("controls")
    @classmethod
    def _not_own(cls, v: dict[str, ControlValue]) -> dict[str, ControlValue]:
        for name, key in OWN_CONTROLS.items():
            if name in v:
                raise ValueError(f"{name} is set from {key}; remove it from source.controls")
        return v


class GstreamerSourceConfig(SourceBase):
    BGR_ONLY = None  # the pipeline converts to either order

    type: Literal["gstreamer"] = "gstreamer"
    pipeline: str = Field(
        min_length=1,
        description="A gst-launch-1.0 description. Ending in an appsink (named 'edged' if there are several), "
        "it is used as is; otherwise edged appends 'videoconvert ! video/x-raw,format=BGR (RGB with "
        'channel_order = "rgb") ! appsink name=edged\'. The appsink always keeps only the newest frame.',
    )
    open_timeout_s: float = Field(
        20.0,
        gt=0,
        le=300,
        description="Longest wait for the pipeline to start and deliver its first frame (a CSI camera's ISP "
        "may take seconds); until then the camera is starting.",
    )
    read_timeout_s: float = Field(
        5.0, gt=0, le=120, description="No new frame for this long means the camera stalled: it is lost and reopened."
    )

    @property
    def opens_within_s(self) -> float:
        return self.open_timeout_s


# source.type -> its settings class: the configuration's ``source.type`` union and its error hints.
KINDS: dict[str, type[SourceBase]] = {
    "synthetic": SyntheticSourceConfig,
    "file": FileSourceConfig,
    "images": ImagesSourceConfig,
    "v4l2": V4l2SourceConfig,
    "picamera2": Picamera2SourceConfig,
    "rtsp": RtspSourceConfig,
    "gstreamer": GstreamerSourceConfig,
}
