"""What returning logprobs costs the PyTorch engine: decode with and without ``logprobs=k``,
interleaved in one run (ABAB...), reported as a ratio of tokens per CPU-second of the engine thread.

    .venv/bin/python bench/logprobs_overhead.py [--k 5] [--batch 1 8] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from trtserver.engine.base import GenerationRequest, SamplingParams
from trtserver.engine.torch.engine import TorchEngine

ROOT = Path(__file__).resolve().parents[1]


async def decode(engine: TorchEngine, batch: int, tokens: int, k: int | None) -> float:
    """Tokens per CPU-second of the engine's worker thread for one batch."""
    prompt = engine.tokenizer.encode("Once upon a time, in a land far away,")

    async def one(i: int) -> int:
        params = SamplingParams(max_tokens=tokens, temperature=0.8, ignore_eos=True, seed=i, logprobs=k)
        count = 0
        async for delta in engine.generate(GenerationRequest(f"lp-{k}-{i}-{time.perf_counter()}", prompt, params)):
            count += len(delta.token_ids)
        return count

    clock = time.pthread_getcpuclockid(engine.runner._thread.ident)
    c0 = time.clock_gettime(clock)
    total = sum(await asyncio.gather(*(one(i) for i in range(batch))))
    return total / (time.clock_gettime(clock) - c0)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-dir", default=str(ROOT / "engines" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engine = TorchEngine.from_dir(args.engine_dir, max_batch_size=max(args.batch), max_model_len=512, threads=1)
    await engine.start()
    await decode(engine, 1, 8, None)  # warm-up
    print(f"{'batch':>5} {'plain tok/cpu-s':>16} {'logprobs tok/cpu-s':>19} {'slowdown':>9}")
    for batch in args.batch:
        plain, with_lp = [], []
        for _ in range(args.rounds):
            plain.append(await decode(engine, batch, args.tokens, None))
            with_lp.append(await decode(engine, batch, args.tokens, args.k))
        a, b = sorted(plain)[len(plain) // 2], sorted(with_lp)[len(with_lp) // 2]
        print(f"{batch:5d} {a:16.1f} {b:19.1f} {(a / b - 1) * 100:8.1f}%")
    await engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
