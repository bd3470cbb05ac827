from tensorrt_llm.llmapi.llm import LLM, RequestOutput
from tensorrt_llm.llmapi.llm_utils import KvCacheConfig
from tensorrt_llm.sampling_params import GuidedDecodingParams, SamplingParams

__all__ = ["LLM", "KvCacheConfig", "RequestOutput", "GuidedDecodingParams", "SamplingParams"]
