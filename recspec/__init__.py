"""recspec: fast, exact inference for LLM-based recommendation through speculative decoding."""

__version__ = "0.1.0"
