"""What the small-batch kernels cost in accuracy: the same text scored token by token through the
batch decode path (bfloat16, or float32 where bfloat16 weights cannot be packed) and through the
small-batch path (int4 projections and the refined int4 head), on the real default model.

    .venv/bin/python -m bench.quality [--engine-dir DIR] [--dtype float32]

Prints perplexity under each path, how often their top-1 tokens agree, and the largest difference
in the logprob of the text's next token.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from bench.prompts import LONG
from trtserver.engine.torch.cpu import accelerate
from trtserver.engine.torch.engine import TorchEngine

ROOT = Path(__file__).resolve().parents[1]


@torch.inference_mode()
def score(engine: TorchEngine, ids: list[int], small: bool) -> tuple[list[float], list[int]]:
    """Logprob of each next token of ``ids`` and the top-1 prediction, one decode step per token."""
    core = engine.core
    assert core is not None, "engine not loaded"
    runner = core.model_runner
    model, device = core.model, core.device
    logprobs, top1 = [], []
    for i in range(len(ids) - 1):
        ctx = runner.decode_context([0], [i], small=small)
        hidden = runner.forward(torch.tensor([[ids[i]]], device=device), ctx)
        lp = torch.log_softmax(model.logits(hidden[:, 0]).float(), dim=-1)[0]
        logprobs.append(lp[ids[i + 1]].item())
        top1.append(int(lp.argmax()))
    return logprobs, top1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", default=str(ROOT / "engines" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="the served model's dtype: float32 on CPUs without AVX-512 (no bfloat16 packing)")
    args = ap.parse_args()
    engine = TorchEngine.from_dir(args.engine_dir, device="cpu", dtype=args.dtype, quantization="int4",
                                  max_batch_size=1, max_model_len=512, threads=1)
    engine.load()
    ids = engine.tokenizer.encode(LONG)
    reference = TorchEngine.from_dir(args.engine_dir, device="cpu", dtype="float32", max_batch_size=1,
                                     max_model_len=512, threads=1)
    reference.load()
    ref, ref_top = score(reference, ids, small=False)
    n = len(ref)
    print(f"{n} tokens of bench.prompts.LONG, one decode step each; against float32 weights and arithmetic")
    print("| path | perplexity | top-1 = float32's | largest logprob difference from float32 |")
    print("|---|---:|---:|---:|")
    print(f"| float32 (the GGUF's weights dequantized) | {math.exp(-sum(ref) / n):.3f} | - | - |")
    core = engine.core
    assert core is not None, "engine not loaded"
    fused = accelerate(core.model)
    unfused = accelerate(core.model, fused=False)
    dtype = args.dtype
    for label, small, decode in (
            (f"{dtype} (prefill; decode above 4 rows without int4.cpp; --batch-invariant), as ATen calls", False,
             unfused),
            (f"{dtype}, with the fused RMSNorm and RoPE of kernels.cpp (the default where they build)", False, fused),
            ("small-batch kernels (float32 attention, int4 + refined head), as ATen calls", True, unfused),
            ("small-batch kernels, through the fused CPU kernels (the default where they build)", True, fused)):
        core.model_runner.accelerated = decode
        if decode is fused and not (fused is not None and (fused.fused_small if small else fused.fused_batch)):
            label += " [no fused kernels on this path (not built, or float32 batches): ATen calls]"
        elif decode is unfused and not (unfused is not None and unfused.covers(small)):
            label += " [the eager layers: the ATen calls do not read the kernels' int4 layout]"
        lps, top = score(engine, ids, small=small)
        agree = sum(a == b for a, b in zip(top, ref_top)) / n
        worst = max(abs(a - b) for a, b in zip(lps, ref))
        print(f"| {label} | {math.exp(-sum(lps) / n):.3f} | {100 * agree:.1f} % | {worst:.3f} |")


if __name__ == "__main__":
    main()
