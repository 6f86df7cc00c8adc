"""edged: an embedded-Linux vision daemon (camera -> ONNX Runtime -> detections over ZeroMQ)."""

__version__ = "0.4.0"
