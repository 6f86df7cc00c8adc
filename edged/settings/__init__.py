"""The settings sections, one leaf module each: pydantic and the standard library, nothing of the runtime.

``edged.config`` assembles them into `edged.config.Settings`; the modules that own a section's
runtime (an output, a camera kind) import their section from here, never the other way round.
"""
