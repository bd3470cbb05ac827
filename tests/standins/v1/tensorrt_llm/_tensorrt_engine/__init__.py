from tensorrt_llm.llmapi.llm import _TrtLLM as LLM

__all__ = ["LLM"]
