"""Guided decoding for trtserver: JSON schema, regex, choice and grammar constraints.

Four backends, each an optional install, each imported lazily on first use:
``xgrammar`` (default), ``llguidance`` (alias ``guidance``), ``outlines`` (outlines-core) and
``lm-format-enforcer``. All fill the same int32 token bitmask (xgrammar's format). The plugin
is registered through the ``trtserver`` entry point ``guided = "trtserver_guided.plugin"``.

This module imports nothing heavy: the outlines compile worker imports it in a subprocess.
"""

__version__ = "0.1.0"
