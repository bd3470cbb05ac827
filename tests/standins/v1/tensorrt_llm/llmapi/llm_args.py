from tensorrt_llm.llmapi.llm import TorchLlmArgs, TrtLlmArgs

__all__ = ["TorchLlmArgs", "TrtLlmArgs"]
