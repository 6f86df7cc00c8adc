"""``[reject]``: the GPIO line that pulses when a judged part reaches the ejector (`edged.reject` drives it).

Every key has a default or is checked once the camera's table and ``[reject]`` are merged
(`edged.config.Settings.reject_for`), so that a ``[source.reject]`` table may give only the keys
that differ from ``[reject]``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from edged.settings.section import Section

# A line by its offset on the chip, or by its name (gpioinfo lists both).
LineId = Annotated[int, Field(ge=0, le=65535)] | Annotated[str, Field(min_length=1, max_length=64)]
LatePolicy = Literal["reject", "pass", "alarm"]
FiringVerdict = Literal["ok", "ng"]

MAX_DELAY_MS = 60_000.0  # a minute of belt travel: beyond it a part is no longer in front of anything


def _ng() -> list[FiringVerdict]:
    return ["ng"]


class RejectConfig(Section):
    """``[reject]``: which line, when after the capture, for how long, and what a missing verdict does."""

    chip: str = Field(
        "gpiochip0",
        min_length=1,
        max_length=256,
        description="The GPIO chip: a name under /dev (gpiochip0; gpiochip4 on a Pi 5), a path, or the chip's label "
        "(a Jetson's tegra234-gpio); gpiodetect lists them.",
    )
    line: LineId | None = Field(
        None, description="Required: the line, by offset on the chip or by name (gpioinfo lists both)."
    )
    active_low: bool = Field(False, description="The line is active when low (the ejector's input inverts).")
    on: list[FiringVerdict] = Field(
        default_factory=_ng,
        min_length=1,
        description="The verdicts that fire the line; 'uncertain' (a part the model cannot tell) is 'ng' here.",
    )
    delay_ms: float | None = Field(
        None,
        ge=0,
        le=MAX_DELAY_MS,
        description="Required: from the frame's capture to the part in front of the ejector (belt travel), ms; "
        "in request mode from the capture of the request's frame.",
    )
    pulse_ms: float = Field(50.0, gt=0, le=10_000, description="How long the line stays active per part, ms.")
    min_gap_ms: float = Field(
        0.0,
        ge=0,
        le=10_000,
        description="Pulses closer than this (end to start) merge into one; overlapping ones do always.",
    )
    late: LatePolicy = Field(
        "reject",
        description="No verdict by capture + delay_ms (inference slow or stuck, frame rejected): 'reject' pulses "
        "anyway (fail-safe), 'pass' lets the part go, 'alarm' drives alarm_line active until verdicts are "
        "on time again.",
    )
    alarm_line: LineId | None = Field(
        None,
        description="The line (same chip) that late = 'alarm' drives active, and that says parts dropped "
        "un-ejected (reject.dropped), until a verdict is on time again; required with late = 'alarm'.",
    )

    def missing(self) -> list[str]:
        """The keys this merged table still lacks, as ``reject.<key>: why`` lines."""
        problems = [f"reject.{key}: required" for key in ("line", "delay_ms") if getattr(self, key) is None]
        if self.late == "alarm" and self.alarm_line is None:
            problems.append("reject.alarm_line: required with late = 'alarm' (the line the alarm drives)")
        if self.alarm_line is not None and self.alarm_line == self.line:
            problems.append("reject.alarm_line: must differ from reject.line")
        return problems
