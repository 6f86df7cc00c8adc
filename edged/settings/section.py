"""The base of every configuration section: what every key of every section obeys."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _not_only_dots(name: str) -> str:
    """``.`` and ``..`` are folders of their own: a camera so named would write its evidence outside its folder."""
    if name.strip(".") == "":
        raise ValueError("must not be only dots: it becomes a folder and a topic level (letters, digits, _ . -)")
    return name


# A name that becomes a topic level, a folder or a label (a camera's id, a zone's name): letters,
# digits and ``_ . -``, not only dots, never empty, at most 64 characters.
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$"), AfterValidator(_not_only_dots)]


class Section(BaseModel):
    """Unknown keys are errors, values are fixed once loaded, and NaN or infinity are refused."""

    # NaN passes every range check and means nothing as a threshold or a mean: refuse it.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
