"""Stand-in for TensorRT-LLM 1.2.0 (test-only). ``tensorrt_llm.LLM`` is the PyTorch backend."""

from tensorrt_llm.llmapi.llm import LLM
from tensorrt_llm.sampling_params import GuidedDecodingParams, SamplingParams

__version__ = "1.2.0"
__all__ = ["LLM", "SamplingParams", "GuidedDecodingParams", "__version__"]
