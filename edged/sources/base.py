"""What every camera kind's module builds on: the keys all sources share, the sources read through OpenCV, masking."""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

import cv2
import numpy as np
from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from edged.errors import SourceError
from edged.evidence import EvidenceConfig
from edged.sections import Section
from edged.verdict import InspectConfig
from edged.zones import ZoneName, usable_zones

# How a camera's frames are taken: every one the rate allows ("free"), or one per inspection request.
TriggerMode = Literal["free", "request"]

_CREDENTIALS = re.compile(r"(?<=://)[^/\s]*@")  # user[:password]@ after a URL's scheme


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
    PROCESSING_KEYS: ClassVar[frozenset[str]] = frozenset({"max_fps", "evidence", "inspect", "zones", "trigger"})

    type: str
    camera_id: str = Field(
        "cam0",
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Name of this camera, unique among the [[source]] tables; used as the ZeroMQ topic suffix.",
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
        "bgr", description="Channel order of the frames this source delivers (OpenCV gives bgr)."
    )

    def opening(self) -> dict[str, Any]:
        """The keys that decide how the camera is opened, with their values: all but `PROCESSING_KEYS`."""
        return self.model_dump(exclude=set(self.PROCESSING_KEYS))

    def file_problems(self) -> list[str]:
        """Files this source needs that are missing, one line each, reported when the config loads.

        ``edged check`` and start-up then refuse them with the configuration's other problems
        instead of the capture thread retrying a camera that can never open.
        """
        return []


class OpenCvCapture:
    """What the sources read through one ``cv2.VideoCapture`` share: OpenCV's grab and its retrieve
    straight into ``out`` when its shape fits (no allocation), errors that name the source, close.

    ``what`` names the source; ``undecodable`` is the whole message for a frame that did not
    decode; ``failed`` prefixes OpenCV's own messages (by default "WHAT failed").
    """

    def __init__(self, channel_order: Literal["bgr", "rgb"], what: str, undecodable: str, failed: str | None = None) -> None:
        self.channel_order = channel_order
        self._cap: cv2.VideoCapture | None = None
        self._what = what
        self._undecodable = undecodable
        self._failed = failed or f"{what} failed"

    def _grab(self) -> bool:
        try:
            return bool(self._opened().grab())
        except cv2.error as e:
            raise SourceError(f"{self._failed}: {e}") from e

    def retrieve(self, out: np.ndarray | None) -> np.ndarray:
        """The frame last grabbed, converted straight into ``out`` when its shape fits."""
        try:
            ok, image = self._opened().retrieve(image=out)
        except cv2.error as e:
            raise SourceError(f"{self._failed}: {e}") from e
        if not ok:
            raise SourceError(self._undecodable)
        return image

    def _opened(self) -> cv2.VideoCapture:
        if self._cap is None:
            raise SourceError(f"{self._what} read before open()")
        return self._cap

    def close(self) -> None:
        if self._cap is not None:
            self._cap.release()
            self._cap = None
