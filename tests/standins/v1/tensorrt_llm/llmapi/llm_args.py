from tensorrt_llm.llmapi.llm import KvCacheConfig, TorchLlmArgs, TrtLlmArgs

__all__ = ["KvCacheConfig", "TorchLlmArgs", "TrtLlmArgs"]
