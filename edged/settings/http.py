"""``[http]``: the live view, status page, metrics and health check server (`edged.http` serves them)."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from edged.settings.numerals import whole_number
from edged.settings.section import Section

MAX_CONNECTIONS = 32  # requests served at once; more are closed at accept, so threads stay bounded


class HttpConfig(Section):
    listen: str = Field(
        "127.0.0.1:8080",
        description="HOST:PORT (an IP address, [v6] or localhost) of the live view, status page, metrics "
        'and health check; "" turns them off.',
    )
    token_file: Path | None = Field(
        None,
        validate_default=True,
        description="File (mode 0600) holding the bearer token every request must carry; "
        "required on a non-loopback address.",
    )
    view_fps: float = Field(5.0, gt=0, le=30, description="Most live-view frames encoded per second (only while watched).")
    view_width: int = Field(960, ge=160, le=3840, description="The live view is scaled down to at most this width.")
    jpeg_quality: int = Field(70, ge=10, le=100, description="JPEG quality of the live view and snapshots.")
    max_viewers: int = Field(
        8,
        ge=1,
        le=MAX_CONNECTIONS - 4,
        description="Live streams, and snapshots waiting for their frame, served at once, of all cameras together; "
        "more get 503.",
    )
    send_timeout_s: float = Field(5.0, gt=0, le=60, description="A viewer that takes no data for this long is dropped.")
    max_connections_per_client: int = Field(
        16,
        ge=1,
        le=MAX_CONNECTIONS,
        description="Connections one address may hold at once; more are closed at accept. Through an SSH "
        "tunnel every viewer comes from 127.0.0.1: raise it with max_viewers.",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host names (or addresses) requests may name in their Host header, besides loopback "
        "names on loopback and, on a network listen, the address asked and the board's host name; "
        "others get 421, so a web page cannot read the view through DNS rebinding.",
    )

    @field_validator("listen")
    @classmethod
    def _host_port(cls, v: str) -> str:
        if v:
            listen_address(v)
        return v

    @field_validator("token_file")
    @classmethod
    def _token_off_loopback(cls, v: Path | None, info: Any) -> Path | None:
        listen = info.data.get("listen")
        if v is None and listen and not is_loopback(listen_address(listen)[0]):
            raise ValueError(
                f"http.listen {listen!r} is not a loopback address: set http.token_file to a file (mode 0600) "
                "holding a token, or listen on 127.0.0.1 and reach it through ssh -L"
            )
        return v

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, v: list[str]) -> list[str]:
        """Each a name in lower case without a final dot, or an address as Python writes it."""
        names = []
        for host in v:
            name = host.strip().lower().removesuffix(".")
            try:
                names.append(str(ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))))
                continue
            except ValueError:
                pass
            if not _HOST_NAME.fullmatch(name):
                raise ValueError(
                    f"{host!r} is not a host name or an IP address: give one name per entry, without a port "
                    'or scheme (["line3-pi.plant1.example", "10.0.0.7"])'
                )
            names.append(name)
        return names


_HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")


def listen_address(listen: str) -> tuple[str, int]:
    """(host, port) of a ``HOST:PORT``; ValueError says what is wrong with it."""
    host, sep, port_text = listen.rpartition(":")
    port = whole_number(port_text, 5)
    if not sep or port is None or not 0 < port < 65536:
        raise ValueError(f"{listen!r} is not HOST:PORT with a port from 1 to 65535")
    host = host.removeprefix("[").removesuffix("]")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"{host!r} is not an IP address or localhost (the server binds an address, not a name)"
            ) from None
    return host, port


def is_loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback
