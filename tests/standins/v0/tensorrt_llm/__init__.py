"""Stand-in for TensorRT-LLM 0.16.0 (test-only): ``tensorrt_llm.LLM`` is the TensorRT-engine class."""

from tensorrt_llm.llmapi.llm import LLM
from tensorrt_llm.sampling_params import GuidedDecodingParams, SamplingParams

__version__ = "0.16.0"
__all__ = ["LLM", "SamplingParams", "GuidedDecodingParams", "__version__"]
