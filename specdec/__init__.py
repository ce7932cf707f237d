"""specdec: lossless speculative decoding — core library (no gRPC here)."""

__version__ = "0.1.0"
