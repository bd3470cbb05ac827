"""``decode_stack.cpp``'s ``int4_decode_layers`` (``cpu/decode_stack.py``): every decoder block of a float32 decode
step in one call, bit for bit what the scripted layers compute on the same path, and taken only where it fits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.test_scripted_decode import MAX_LEN, _filled_cache, _runner
from trtserver.engine.torch.cpu import accelerate
from trtserver.engine.torch.cpu.decode_layers import DecodeLayers
from trtserver.engine.torch.cpu.decode_stack import Int4DecodeStack
from trtserver.engine.torch.cpu.scripted import STACK_KIND, DecodePath, ScriptedDecode, _blocks, _projections, _script
from trtserver.engine.torch.cpu.weights import quantize_weights
from trtserver.engine.torch.model import Transformer, load_model


@pytest.fixture(scope="module")
def smol_int4_kernel(smol_dir: Path, ops) -> Transformer:  # type: ignore[no-untyped-def]
    model = load_model(smol_dir, torch.float32, torch.device("cpu"))
    quantize_weights(model, "int4", int4_kernel=True)  # as the loader does where the kernels load
    model.setup_rope(MAX_LEN)
    return model


@pytest.mark.parametrize(("slots", "positions"), [([0], [5]), ([1, 2, 3], [40, 3, 17]), ([4, 0], [20, 33]),
                                                  ([0, 1, 2, 3, 4], [0, 60, 61, 7, 95])])
def test_the_stack_is_the_scripted_int4_path_bit_for_bit(smol_int4_kernel: Transformer, slots: list[int],
                                                         positions: list[int]) -> None:
    model = smol_int4_kernel
    decode = accelerate(model)
    assert decode is not None and isinstance(decode._small.layers, Int4DecodeStack)  # type: ignore[union-attr]
    scripted = _script(DecodeLayers(model, [_projections(layer) for layer in _blocks(model)], STACK_KIND))
    assert scripted is not None
    both = (decode, ScriptedDecode(model, DecodePath(scripted, STACK_KIND), None))
    tokens = torch.tensor([[7 + 3 * i] for i in range(len(slots))])
    caches = [_filled_cache(model) for _ in both]
    runners = [_runner(model, cache, way) for way, cache in zip(both, caches, strict=True)]
    with torch.inference_mode():
        hidden = [r.forward(tokens, r.decode_context(slots, positions, small=True)) for r in runners]
    assert torch.equal(hidden[0], hidden[1])
    for mine, theirs in zip((*caches[0].k, *caches[0].v), (*caches[1].k, *caches[1].v), strict=True):
        assert torch.equal(mine, theirs)  # every layer's K/V written at the same rows, with the same bits
    assert not torch.equal(caches[0].k[-1], _filled_cache(model).k[-1])  # and written they were


def test_the_stack_is_taken_only_where_it_computes_the_model(smol_dir: Path, smol_int4_kernel: Transformer,
                                                             ops) -> None:  # type: ignore[no-untyped-def]
    projections = [_projections(layer) for layer in _blocks(smol_int4_kernel)]
    assert Int4DecodeStack.fits(smol_int4_kernel, projections)
    wo = projections[3][1]
    wo.bias = torch.zeros(wo.out_features)  # type: ignore[assignment]
    try:
        assert not Int4DecodeStack.fits(smol_int4_kernel, projections)  # the op adds no biases
    finally:
        wo.bias = None  # type: ignore[assignment]
    aten_layout = load_model(smol_dir, torch.float32, torch.device("cpu"))
    quantize_weights(aten_layout, "int4")  # ATen's int4 layout: the scripted layers
    decode = accelerate(aten_layout)
    assert decode is not None and isinstance(decode._small.layers, torch.jit.ScriptModule)  # type: ignore[union-attr]


def test_the_stack_refuses_what_it_cannot_read(smol_int4_kernel: Transformer, ops) -> None:  # type: ignore[no-untyped-def]
    model = smol_int4_kernel
    stack = Int4DecodeStack(model, [_projections(layer) for layer in _blocks(model)])
    cache = _filled_cache(model)
    x, cs = torch.randn(2, model.args.dim), torch.randn(2, model.args.head_dim)
    slots, positions = torch.tensor([0, 1]), torch.tensor([3, 4])

    def call(**change: object) -> None:
        args = dict(x=x, cos=cs, sin=cs, k_caches=cache.k, v_caches=cache.v, slots=slots, positions=positions,
                    norms=stack.norms, packed=stack.packed, scales_mins=stack.scales)
        args.update(change)
        ops.int4_decode_layers(*args.values(), stack.n_heads, stack.n_kv_heads, stack.eps)

    call()
    with pytest.raises(RuntimeError, match="float32"):
        call(x=x.bfloat16())
    with pytest.raises(RuntimeError, match="per layer"):
        call(norms=stack.norms[:-1])
    with pytest.raises(RuntimeError, match="outside the cache"):
        call(positions=torch.tensor([3, 10_000]))
    with pytest.raises(RuntimeError, match="output features"):
        call(packed=[stack.packed[1], *stack.packed[1:]], scales_mins=[stack.scales[1], *stack.scales[1:]])
    with pytest.raises(RuntimeError, match="packed must be"):  # a later layer's w2 of another width
        call(packed=[*stack.packed[:7], stack.packed[1], *stack.packed[8:]],
             scales_mins=[*stack.scales[:7], stack.scales[1], *stack.scales[8:]])
    with pytest.raises(RuntimeError, match="one 4-d shape"):
        call(v_caches=[cache.v[0][:1], *cache.v[1:]])
