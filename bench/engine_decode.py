"""Decode speed of the PyTorch engine, in process: tokens/s at batch 1 and 16.

Tokens per second of wall time, and per CPU second of the whole process (every thread: the
engine's worker, OpenMP's, the event loop): the second figure is what the work costs even while
other processes share the machine, and the fairer one on a busy box.

    .venv/bin/python bench/engine_decode.py [--dtype float32 bfloat16] [--batch 1 16] [--tokens 128] \
        [--threads 1 2] [--quantize int8 int4]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from trtserver.engine.base import GenerationRequest, SamplingParams
from trtserver.engine.torch.engine import TorchEngine

ROOT = Path(__file__).resolve().parents[1]


async def run(engine: TorchEngine, batch: int, tokens: int, temperature: float) -> tuple[float, float]:
    prompt = engine.tokenizer.encode("Once upon a time, in a land far away,")

    async def one(i: int) -> int:
        params = SamplingParams(max_tokens=tokens, temperature=temperature, ignore_eos=True, seed=i)
        n = 0
        async for delta in engine.generate(GenerationRequest(f"bench-{batch}-{i}-{time.time()}", prompt, params)):
            n += len(delta.token_ids)
        return n

    await one(0)  # warm-up
    core = engine.core
    t0, c0, d0 = time.perf_counter(), time.process_time(), core.num_decode_forwards
    total = sum(await asyncio.gather(*(one(i) for i in range(batch))))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = core.num_decode_forwards - d0
    return total / elapsed, elapsed / max(steps, 1) * 1000, total / cpu


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-dir", default=str(ROOT / "engines" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--dtype", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, nargs="+", default=[0], help="0: the engine's default (cores - 1)")
    ap.add_argument("--quantize", nargs="*", default=[], choices=["int8", "int4"],
                    help="also run bfloat16 with these weight-only quantizations")
    ap.add_argument("--int4", action="store_true", help="same as --quantize int4")
    args = ap.parse_args()
    quants = list(dict.fromkeys(args.quantize + (["int4"] if args.int4 else [])))
    runs = [(dtype, None) for dtype in args.dtype] + [("bfloat16", q) for q in quants]
    for threads in args.threads:
        for dtype, quantize in runs:
            engine = TorchEngine.from_dir(args.engine_dir, dtype=dtype, max_batch_size=max(args.batch),
                                          max_model_len=1024, threads=threads, quantize=quantize)
            await engine.start()
            label = f"{dtype + ('+' + quantize if quantize else '')} t{threads}"
            for batch in args.batch:
                tps, ms, cpu_tps = await run(engine, batch, args.tokens, args.temperature)
                print(f"{label:17s} batch {batch:3d}: {tps:7.1f} tokens/s  "
                      f"({ms:.1f} ms/step wall; {cpu_tps:.1f} tokens per process CPU second)", flush=True)
            await engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
