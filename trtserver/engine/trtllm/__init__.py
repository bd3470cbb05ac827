"""TensorRT-LLM engine: a thin adapter over TensorRT-LLM's LLM API, one code path per API generation.

``tensorrt_llm`` is imported when a ``TrtllmEngine`` is constructed, never at package import.

* ``version``: which API generation is installed, probed at run time, and the engine's build facts.
* ``mapping``: THE table of what each request field becomes per generation (also in ``docs/deploy.md``).
* ``request``: a request -> ``SamplingParams`` / ``LLM`` / ``generate_async`` keywords.
* ``stream``: TensorRT-LLM's ``RequestOutput`` states -> our deltas.
* ``logits``: our per-request logits processor inside TensorRT-LLM's hook.
* ``availability``: whether TensorRT-LLM can run here (``--engine auto``), without importing it.
* ``engine``: ``TrtllmEngine``, which ties them together.
"""

from trtserver.engine.trtllm.availability import installed_trtllm_version, trtllm_unavailable_reason
from trtserver.engine.trtllm.engine import TrtllmEngine

__all__ = ["TrtllmEngine", "installed_trtllm_version", "trtllm_unavailable_reason"]
