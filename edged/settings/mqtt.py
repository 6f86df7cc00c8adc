"""``[mqtt]``: the broker edged also publishes to, and how it connects (`edged.mqtt` connects)."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from edged.settings.endpoints import host_port
from edged.settings.section import Section

TOPIC_LEVEL = r"[A-Za-z0-9_.-]+"


def topic_hostname() -> str:
    """The host name as one topic level: anything but letters, digits, ``_ . -`` becomes ``-``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()) or "localhost"


class MqttConfig(Section):
    """``[mqtt]``: absent, edged publishes on ZeroMQ only."""

    url: str = Field(description="Broker: mqtt://host[:1883] or mqtts://host[:8883] (TLS).")
    client_id: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Client id, unique on the broker; default edged-<hostname>-<camera_id> of the first camera (one "
        "connection serves every camera), stable across restarts.",
    )
    username: str | None = Field(None, min_length=1, description="User name for the broker; none: anonymous.")
    password_file: Path | None = Field(
        None, description="File holding the password (mode 0600, or 0640 owned by the service group); never in this file."
    )
    ca_file: Path | None = Field(
        None, description="CA certificate(s) the broker's certificate must chain to; default: the system's."
    )
    cert_file: Path | None = Field(None, description="Client certificate for brokers that ask for one (with key_file).")
    key_file: Path | None = Field(None, description="The client certificate's private key (mode 0600 or 0640).")
    topic_prefix: str | None = Field(
        None,
        pattern=rf"^{TOPIC_LEVEL}(/{TOPIC_LEVEL})*$",
        description="Topics are PREFIX/state and PREFIX/CAMERA/{detections,status,verdict}; default edged/<hostname>.",
    )
    qos_detections: Literal[0, 1, 2] = Field(0, description="QoS of detections messages.")
    qos_events: Literal[0, 1, 2] = Field(1, description="QoS of status, verdicts and the online/offline state.")
    publish_empty: bool = Field(False, description="Also send frames without detections.")
    keepalive_s: int = Field(
        30, ge=5, le=3600, description="Seconds between keepalive pings; a silent link is lost after 1.5x."
    )
    max_queued: int = Field(
        1000,
        ge=1,
        le=100000,
        description="Messages held while the broker is away; the oldest beyond are dropped and counted.",
    )

    @field_validator("url")
    @classmethod
    def _broker_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("mqtt", "mqtts"):
            raise ValueError("must start with mqtt:// or mqtts:// (TLS)")
        if parts.username is not None or parts.password is not None:
            raise ValueError("must not hold credentials: set mqtt.username and mqtt.password_file")
        if parts.netloc.count(":") > 1 and "[" not in parts.netloc:
            raise ValueError(f"an IPv6 address goes in brackets: {parts.scheme}://[::1]:PORT, not {v}")
        if not parts.hostname or parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError("must be mqtt://host[:port] or mqtts://host[:port], nothing after the port")
        if parts.port == 0:  # .port raises ValueError for a port that is no number or out of range
            default = 8883 if parts.scheme == "mqtts" else 1883
            raise ValueError(f"port 0 is no broker's port: leave the port out for {default}, or name the broker's")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> MqttConfig:
        tls = (self.ca_file, self.cert_file, self.key_file)
        if any(f is not None for f in tls) and not self.tls:
            raise ValueError("ca_file, cert_file and key_file need an mqtts:// url")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("set both cert_file and key_file, or neither")
        if self.password_file is not None and self.username is None:
            raise ValueError("password_file needs a username")
        return self

    @property
    def tls(self) -> bool:
        return self.url.startswith("mqtts://")

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or (8883 if self.tls else 1883)

    @property
    def where(self) -> str:
        """HOST:PORT of the broker for messages, an IPv6 address in brackets."""
        return host_port(self.host, self.port)

    def prefix(self) -> str:
        return self.topic_prefix or f"edged/{topic_hostname()}"

    def client_id_for(self, camera_id: str) -> str:
        return self.client_id or f"edged-{topic_hostname()}-{camera_id}"
