"""``http.listen`` on an IPv6 address, written with brackets or without: ``edged check`` and the log give
the live view's address as a browser takes it, and the real server answers there."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from daemon import RunningDaemon, free_port, run_cli, write_config
from onnx_models import colour_probe
from waiting import wait_for

pytestmark = pytest.mark.integration


def test_an_ipv6_listen_is_said_and_served_as_a_url(tmp_path: Path) -> None:
    colour_probe(tmp_path / "probe.onnx")
    port, endpoint = free_port(), f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "synthetic", "width": 64, "height": 48, "fps": 5},
            "model": {"path": "probe.onnx"},
            "publish": {"endpoints": [endpoint]},
            "thermal": {"enabled": False},
            "journal": {"enabled": False},
            "http": {"listen": f"::1:{port}"},  # no brackets: the last colon is the port's
        },
    )
    url = f"http://[::1]:{port}/"
    checked = run_cli("check", "--config", str(config))
    assert checked.returncode == 0, checked.stderr
    assert f"http.listen: {url} (bound and released)" in checked.stdout
    d = RunningDaemon(config, endpoint)
    try:
        assert wait_for(lambda: f"live view, status page and metrics on {url}" in d.log(), 30), d.log()
        with urllib.request.urlopen(f"{url}healthz", timeout=10) as answer:
            assert answer.status == 200
        assert d.stop() == 0
    finally:
        d.close()
