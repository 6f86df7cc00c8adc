"""The base of every configuration section: what every key of every section obeys."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# A name that becomes a topic level, a folder or a label (a camera's id, a zone's name): letters,
# digits and ``_ . -``, never empty, at most 64 characters.
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class Section(BaseModel):
    """Unknown keys are errors, values are fixed once loaded, and NaN or infinity are refused."""

    # NaN passes every range check and means nothing as a threshold or a mean: refuse it.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
