"""The base of every configuration section: what every key of every section obeys."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Unknown keys are errors, values are fixed once loaded, and NaN or infinity are refused."""

    # NaN passes every range check and means nothing as a threshold or a mean: refuse it.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
