"""Stand-in for the v0.12.0-jetson wheel (test-only): the 0.12 ``hlapi``, whose names ``tensorrt_llm``
re-exports (0.12 ``__init__.py``: ``from .hlapi.llm import LLM, LlmArgs, SamplingParams``)."""

from tensorrt_llm.hlapi.llm import LLM
from tensorrt_llm.hlapi.llm_utils import LlmArgs
from tensorrt_llm.hlapi.utils import SamplingParams

__version__ = "0.12.0"
__all__ = ["LLM", "LlmArgs", "SamplingParams", "__version__"]
