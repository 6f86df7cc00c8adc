"""The base of every configuration section, apart from ``edged.config`` so that the modules that own a
section's keys (each camera kind in ``edged.sources``) can define it there without importing the whole
settings tree.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Unknown keys are errors, values are fixed once loaded, and NaN or infinity are refused."""

    # NaN passes every range check and means nothing as a threshold or a mean: refuse it.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
