"""``edged.candidate``: a reload's candidate trial, loaded beside the reload's model and said once it starts."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from daemon import write_config
from onnx_models import colour_probe

from edged.candidate import Candidate
from edged.config import Settings, load_config
from edged.model import load_model


def test_a_reloads_candidate_is_said_as_its_trial_starts_not_as_it_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # It loads with the reload's model, and the reload may then be refused: said as it loaded, "the
    # candidate did not load" was logged for a trial that never replaced the one running.
    probe = colour_probe(tmp_path / "probe.onnx")
    (tmp_path / "broken.onnx").write_bytes(b"not a model")
    control = f"ipc://{tmp_path}/control.sock"

    def settings(candidate: str) -> Settings:
        sections = {
            "source": {"type": "synthetic"},
            "model": {"path": str(probe)},
            "model.candidate": {"path": str(tmp_path / candidate), "control": control},
            "publish": {"endpoints": ["tcp://127.0.0.1:5999"]},
        }
        return load_config(write_config(tmp_path / f"{candidate}.toml", sections))

    running, broken = settings("probe.onnx"), settings("broken.onnx")
    live = load_model(running.model, running.runtime)
    with caplog.at_level(logging.INFO, logger="edged"):
        candidate = Candidate(running, live)
        try:
            assert "candidate model probe@" in caplog.text and "on trial beside the live model" in caplog.text
            caplog.clear()
            shadow = candidate.trial_for(broken, live)
            assert shadow is not None and shadow.state == "failed" and "did not load" in (shadow.error or "")
            assert "did not load" not in caplog.text  # loaded, not yet its trial
            report = candidate.report()
            assert report is not None and report.state == "on_trial"  # the running trial goes on meanwhile
            candidate.reload(broken, shadow)
            assert "the candidate did not load" in caplog.text and "the live model goes on alone" in caplog.text
            report = candidate.report()
            assert report is not None and report.state == "failed"
        finally:
            candidate.close()
