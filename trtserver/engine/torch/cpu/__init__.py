"""What makes the model fast on a CPU, behind one seam: the weight formats that replace its projections
(``weights.py``: oneDNN's pre-packed layout, weight-only int4 / int8), the fused C++ kernels
(``kernels.py``, ``kernels.cpp``, ``int4.cpp``) and the decode step through every layer as one TorchScript
call (``scripted.py`` over ``decode_layers.py``). The model (``model.py``) knows none of it; the model runner
(``model_runner.py``) asks ``accelerate`` once and then, step by step, whether the accelerated decode covers
the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trtserver.engine.torch.cpu.scripted import ScriptedDecode
    from trtserver.engine.torch.model import Transformer


def accelerate(model: Transformer, *, fused: bool = True) -> ScriptedDecode | None:
    """The CPU decode function for ``model`` as its weights now are (packed or quantized, LoRA-wrapped or
    not), with the fused kernels where they load and ``fused`` allows; None where only the eager layers fit."""
    from trtserver.engine.torch.cpu.scripted import build

    return build(model, fused=fused)
