"""``[opcua]``: the OPC UA server a PLC or SCADA reads verdicts from (`edged.opcua` serves it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from edged.settings.evidence import CONFIG_FOLDER
from edged.settings.http import is_loopback, listen_address
from edged.settings.section import Section
from edged.settings.service_dirs import service_dir

SCHEME = "opc.tcp"
ROOT = "edged"  # the string node id of Objects/edged/ (`edged.opcua_server`)
# The names under each camera's object, whose string node ids are CAMERA.NAME (`edged.opcua_server.VARIABLES`
# and the Trigger method): a camera's own id must be no other's node id.
NODE_NAMES = ("Verdict", "Sequence", "PartId", "OkCount", "NgCount", "State", "CaptureToVerdictMs", "LastMessage", "Trigger")


def node_id_clashes(camera_ids: Sequence[str]) -> list[str]:
    """The cameras whose OPC UA node id (the camera id itself) is another node's: ``edged``, the folder
    they are all in, or ``OTHER.Verdict`` and the like, a node of camera ``OTHER``. The server could
    not build such an address space, and would serve none of the cameras."""
    cameras = set(camera_ids)
    problems = []
    for camera in camera_ids:
        if camera == ROOT:
            problems.append(f"camera_id {camera!r} is the node id of Objects/{ROOT}/, the folder every camera is in")
            continue
        owner, _, name = camera.rpartition(".")
        if owner in cameras and name in NODE_NAMES:
            problems.append(f"camera_id {camera!r} is the node id of camera {owner}'s {name}")
    return problems


def default_cert_dir() -> Path:
    """``opcua/`` in the service's state directory (systemd's ``$STATE_DIRECTORY``), else beside the
    configuration file; settings made in code have the working directory instead."""
    return (service_dir("state") or CONFIG_FOLDER.get() or Path.cwd()) / "opcua"


def listen_host_port(listen: str) -> tuple[str, int]:
    """(host, port) of an ``opc.tcp://HOST:PORT`` address; ValueError says what is wrong with it."""
    parts = urlsplit(listen)
    if parts.scheme != SCHEME or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{listen!r} is not opc.tcp://HOST:PORT (an IP address, [v6] or localhost, and a port)")
    return listen_address(parts.netloc)


class OpcuaConfig(Section):
    """``[opcua]``: absent, edged serves no OPC UA."""

    listen: str = Field(
        "opc.tcp://127.0.0.1:4840",
        description="opc.tcp://HOST:PORT the server listens on (an IP address, [v6] or localhost; a path "
        "after the port is the endpoint's). Off loopback it needs users_file.",
    )
    users_file: Path | None = Field(
        None,
        validate_default=True,
        description="File (mode 0600, or 0640 owned by the service group) of USER:PASSWORD lines. Set, every "
        "client signs in with one of them over Basic256Sha256 SignAndEncrypt; unset, clients are "
        "anonymous and unencrypted, which only a loopback listen allows.",
    )
    cert_dir: Path = Field(
        default_factory=default_cert_dir,
        description="Where the server's certificate (server.der) and private key (server.pem, mode 0600) are "
        "made on the first start with users_file, and kept; default: opcua/ in the service's state directory under systemd, "
        "else beside the configuration file.",
    )
    max_clients: int = Field(10, ge=1, le=200, description="Client connections at once; more are refused as they connect.")
    max_queued: int = Field(
        100,
        ge=1,
        le=10000,
        description="Per subscription, notifications kept for a client that does not acknowledge them, and "
        "values queued per monitored item; the oldest beyond are dropped.",
    )

    @field_validator("listen")
    @classmethod
    def _address(cls, v: str) -> str:
        listen_host_port(v)
        return v

    @field_validator("users_file")
    @classmethod
    def _users_off_loopback(cls, v: Path | None, info: Any) -> Path | None:
        listen = info.data.get("listen")
        if v is None and listen and not is_loopback(listen_host_port(listen)[0]):
            raise ValueError(
                f"opcua.listen {listen!r} is not a loopback address: set opcua.users_file to a file (mode 0600) "
                "of USER:PASSWORD lines, so that clients must sign in over Basic256Sha256 SignAndEncrypt, or "
                "listen on 127.0.0.1"
            )
        return v

    @property
    def secured(self) -> bool:
        """Clients sign in, encrypted; else anonymous on loopback."""
        return self.users_file is not None
