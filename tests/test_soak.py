"""The long run: memory flat over thousands of frames of the demo pipeline, on each engine.

Marked slow and left out of the default suite (about a minute an engine); run it with
`scripts/test -m slow`. The bounds are the ones BENCHMARKS.md states for the 10,000-frame soak.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from edged.config import EngineName, ModelConfig, RuntimeConfig
from edged.model import load_model
from edged.tools.bench import soak

pytestmark = pytest.mark.integration

MODEL = Path(__file__).parent.parent / "models" / "demo.onnx"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["onnxruntime", "openvino"])
def test_demo_pipeline_memory_is_flat_after_warm_up(engine: EngineName) -> None:
    if engine == "openvino":  # its own heap, which only RSS sees
        pytest.importorskip("openvino", reason="the openvino package (edged[openvino]) is not installed")
    model = load_model(ModelConfig(path=MODEL, engine=engine), RuntimeConfig())
    result = soak(model, 4000, samples=8, warmup=300)
    # A leak of one small object per frame would be 50+ KB per 1000 frames in traced memory and
    # far more in RSS; allocator pools settling early show as a step, so the late slopes decide.
    # OpenVINO's start_async keeps a pool of small blocks (at most about 220 of 124 B, measured)
    # that fills as the timing of its threads varies, late on a busy machine: its bound is the
    # total growth.
    if engine == "onnxruntime":
        assert result["traced_late_slope_kb_per_1000"] < 5.0, result
    assert result["traced_growth_kb"] < 64.0, result
    assert result["rss_late_slope_kb_per_1000"] < 256.0, result
