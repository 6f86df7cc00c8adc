"""edged: an embedded-Linux vision daemon (camera -> ONNX Runtime -> detections over ZeroMQ)."""

import os

# numpy's OpenBLAS starts a thread per core when numpy is imported, and its threads spin after each
# call. edged's inference has its own thread pool; its one BLAS call on the frame path, a
# segmentation frame's mask product, is small. One thread saves a tenth of a second of CPU at each
# process start (more on a four-core board) and keeps spinning threads off the cores inference
# uses. Set before numpy is first imported; a value in the environment is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# ONNX Runtime's official builds (1.25 and later) report to Microsoft from Linux too: a device id
# and events of every process, session and model, queued in an offline cache under $HOME
# (~/.cache/Microsoft/DeveloperTools) where the network does not reach, as on most lines. A daemon
# on a factory network sends nothing unasked: off unless the environment says otherwise. Read once,
# as ONNX Runtime starts.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

__version__ = "0.4.0"
