"""shoal: a peer-to-peer volunteer network for training language models."""

__version__ = "0.1.0"
