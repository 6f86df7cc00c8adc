"""Camera sources: the one place that knows how frames are obtained from each kind of camera.

A source only opens, reads and closes; threading, latest-frame slots, pacing and reconnects belong
to ``edged.capture``. Each kind is one module with its reader; its ``[source]`` keys are a class in
``edged.settings.sources``, and ``edged.sources.registry`` maps the kind's name to its reader, so a
new kind is one module, its settings class and one registry line. `edged.sources.base` holds what
every kind builds on (`Frame`, the `Source` protocol).
"""
