"""``[modbus]``: a Modbus TCP server a PLC polls for each camera's state and verdicts (`edged.modbus` serves it)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from edged.settings.http import is_loopback, listen_address
from edged.settings.section import Section

ADDRESSES = 65536  # a Modbus address is 16 bits
BLOCK = 16  # holding registers (and coil addresses) per camera: camera i's block starts at base + 16 * i
MAX_CONNECTIONS = 64  # the most ``max_connections`` may allow: each client costs a few kilobytes, never a thread


class ModbusConfig(Section):
    """``[modbus]``: absent, edged serves no Modbus."""

    listen: str = Field(
        "127.0.0.1:5020",
        description="HOST:PORT (an IP address, [v6] or localhost) of the Modbus TCP server. Modbus has no "
        "authentication: an address off loopback needs allow_remote = true; a port below 1024 (502) needs "
        "the unit's AmbientCapabilities=CAP_NET_BIND_SERVICE (see docs/outputs.md, Modbus TCP).",
    )
    allow_remote: bool = Field(
        False,
        description="Serve on an address other machines can reach: anyone there may read the registers and "
        "trigger inspections (Modbus has no authentication).",
    )
    unit_id: int = Field(
        1, ge=1, le=247, description="The unit (slave) id edged answers to; a request for another gets exception 0x0B."
    )
    base: int = Field(
        0,
        ge=0,
        le=0xF000,
        description="Address of the first camera's block of 16 holding registers (and of its request coil); "
        "camera i's block starts at base + 16 * i, in [[source]] order.",
    )
    max_connections: int = Field(
        8,
        ge=1,
        le=MAX_CONNECTIONS,
        description="Clients connected at once; more are closed as they connect (counted), unless one has "
        "been silent for reclaim_idle_s.",
    )
    reclaim_idle_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="With every connection taken, a new client takes the place of the one silent longest, "
        "if silent this long (counted): a PLC reconnecting after a restart or a cable fault gets past its own "
        "stale connections and clients that connect and never ask. A quiet client keeps its connection "
        "while there is room.",
    )

    @field_validator("listen")
    @classmethod
    def _host_port(cls, v: str) -> str:
        """Checked here, so that the problem names modbus.listen, not the whole section."""
        listen_address(v)
        return v

    @model_validator(mode="after")
    def _loopback_unless_allowed(self) -> ModbusConfig:
        """Modbus has no authentication: a server others can reach is refused when the configuration loads
        (exit 78) unless ``allow_remote`` accepts exactly that."""
        host, _ = listen_address(self.listen)
        if not self.allow_remote and not is_loopback(host):
            raise ValueError(
                f"modbus.listen {self.listen!r} is not a loopback address, and Modbus has no authentication: "
                "anyone who reaches it could read the registers and trigger inspections; listen on 127.0.0.1, "
                "or set modbus.allow_remote = true to accept that (and keep the port behind a firewall)"
            )
        return self

    def host_port(self) -> tuple[str, int]:
        return listen_address(self.listen)
