from tensorrt_llm.hlapi.llm import LLM
from tensorrt_llm.hlapi.llm_utils import KvCacheConfig
from tensorrt_llm.hlapi.utils import SamplingParams

__all__ = ["LLM", "KvCacheConfig", "SamplingParams"]
