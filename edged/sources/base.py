"""What every camera kind's module builds on: the keys all sources share, OpenCV's retrieve into a slot, masking."""

from __future__ import annotations

import re
from typing import Literal

import cv2
import numpy as np
from pydantic import Field, field_validator

from edged.errors import SourceError
from edged.sections import Section
from edged.zones import ZoneName, usable_zones

_CREDENTIALS = re.compile(r"(?<=://)[^/\s]*@")  # user[:password]@ after a URL's scheme


def mask_credentials(text: str) -> str:
    """``text`` with every URL's ``user:password@`` replaced by ``***@``: how edged shows a source anywhere.

    It works on any text holding URLs (an RTSP URL, a pipeline with a ``location=`` URL, an error),
    so logs, status messages, ``edged check`` and configuration errors never show a camera's password.
    """
    return _CREDENTIALS.sub("***@", text)


class SourceBase(Section):
    """The ``[source]`` keys every camera kind has; each kind's module adds ``type`` and its own keys."""

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
    evidence: bool = Field(True, description="With an [evidence] section: save this camera's evidence; false: not.")
    trigger: Literal["free", "request"] | None = Field(
        None, description="This camera's trigger.mode ('free' or 'request'); default: trigger.mode."
    )
    zones: dict[ZoneName, list[tuple[float, float]]] | None = Field(
        None, description="This camera's [inspect] zones, in place of inspect.zones; default: those."
    )

    @field_validator("zones")
    @classmethod
    def _usable_zones(cls, v: dict[str, list[tuple[float, float]]] | None) -> dict[str, list[tuple[float, float]]] | None:
        if v is not None:
            usable_zones(v)
        return v

    channel_order: Literal["bgr", "rgb"] = Field(
        "bgr", description="Channel order of the frames this source delivers (OpenCV gives bgr)."
    )

    def file_problems(self) -> list[str]:
        """Files this source needs that are missing, one line each, reported when the config loads.

        ``edged check`` and start-up then refuse them with the configuration's other problems
        instead of the capture thread retrying a camera that can never open.
        """
        return []


def retrieve_frame(cap: cv2.VideoCapture, out: np.ndarray | None, *, failed: str, undecodable: str) -> np.ndarray:
    """OpenCV's ``retrieve`` of the frame last grabbed, straight into ``out`` when its shape fits.

    Errors become ``SourceError``: ``failed`` prefixes OpenCV's own message, ``undecodable`` is
    the whole message for a frame that did not decode.
    """
    try:
        ok, image = cap.retrieve(image=out)
    except cv2.error as e:
        raise SourceError(f"{failed}: {e}") from e
    if not ok:
        raise SourceError(undecodable)
    return image
