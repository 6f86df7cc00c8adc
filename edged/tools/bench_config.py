"""The ``edged run`` config a bench starts the daemon with, one writer for every bench that times a whole daemon."""

from __future__ import annotations

import json
from pathlib import Path

from edged.config import EngineName, Precision, Spinning


def write_config(
    path: Path,
    model: Path,
    endpoint: str,
    sources: str,
    *,
    spinning: Spinning,
    cache: Path | None = None,
    thermal: bool = True,
    engine: EngineName = "onnxruntime",
    precision: Precision = "f32",
) -> Path:
    """Write ``path``: the cameras (``sources``, their ``[source]`` or ``[[source]]`` tables), the model
    on ``engine`` at ``precision``, ``spinning``, the engine's ``cache`` if any (ONNX Runtime's
    optimised-model file, OpenVINO's cache folder), and one ``endpoint`` to receive on.

    Warnings only in the log and no HTTP server, so that neither costs the run anything it measures;
    ``thermal = False`` leaves out the thermal watch, whose throttling would cap a rate being compared.
    """
    key = "optimized_model_path" if engine == "onnxruntime" else "cache_dir"
    cache_key = f"{key} = {json.dumps(str(cache))}\n" if cache is not None else ""
    thermal_table = "" if thermal else "[thermal]\nenabled = false\n"
    path.write_text(
        f"{sources}[model]\npath = {json.dumps(str(model.resolve()))}\n"
        f'engine = "{engine}"\nprecision = "{precision}"\n'
        f'[runtime]\nspinning = "{spinning}"\n{cache_key}'
        f"[publish]\nendpoints = [{json.dumps(endpoint)}]\n"
        f'[service]\nlog_level = "warning"\n{thermal_table}[http]\nlisten = ""\n'
    )
    return path
