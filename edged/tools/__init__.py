"""edged's offline tools: ``edged bench``, ``edged eval``, ``edged quantize``, their metrics, and the
configuration reference ``edged config-reference`` generates.

They measure or prepare models around the daemon and go through its own stages to do so, but the
daemon never imports them: ``edged run`` loads the stages only (the synthetic source imports the
scene generator when it opens, not before).
"""
