"""trtserver: an OpenAI-compatible /v1/completions server for TensorRT-LLM and PyTorch engines."""

from trtserver.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["hookimpl", "__version__"]
