"""Stand-in for the v0.12.0-jetson wheel (test-only). The LLM class lives in ``tensorrt_llm.hlapi``;
whether ``from tensorrt_llm import LLM`` works on 0.12 is unverified, so it is not exported here."""

__version__ = "0.12.0"
