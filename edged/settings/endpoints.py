"""What a ZeroMQ endpoint setting says about who can reach it (``publish.endpoints``, ``trigger.endpoint``)."""

from __future__ import annotations

import ipaddress
import socket


def loopback_host(host: str) -> bool:
    """Whether only this machine can reach ``host``: a loopback address, or a name that resolves to loopback alone."""
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:  # an interface name or hostname: loopback only if it resolves there
            return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


def on_the_network(endpoint: str) -> bool:
    """Whether ``endpoint`` is tcp on a host (``*``, an address, a name) other machines can reach."""
    return endpoint.startswith("tcp://") and not loopback_host(endpoint[len("tcp://") :].rsplit(":", 1)[0])
