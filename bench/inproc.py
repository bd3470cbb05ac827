"""llama.cpp decoding in process, run in its own process (the peer's venv) by the harness; prints one JSON line.

    .cache/bench-llamacpp-venv/bin/python bench/inproc.py llamacpp --gguf X.gguf --threads 1

``llama_cpp.Llama.generate`` (greedy, EOS not checked) for exactly ``--tokens`` tokens: the stretch target's
reference. Our engine without a server is measured by ``bench.overhead``, paired with the same requests over HTTP.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prompts import LONG, SHORT  # noqa: E402

PROMPTS = {"short": SHORT, "long": LONG}


def summarize(runs: list[tuple[float, list[float]]], tokens: int) -> dict[str, float]:
    """runs: (ttft_s, arrival time of each token from start). Medians across runs."""
    decode_tps, gaps, ttfts = [], [], []
    for ttft, times in runs:
        ttfts.append(ttft)
        if len(times) >= 2:
            decode_tps.append((len(times) - 1) / (times[-1] - times[0]))
            gaps.append(statistics.median(b - a for a, b in zip(times, times[1:], strict=False)))
    return {"decode_tps": statistics.median(decode_tps), "tpot_ms": statistics.median(gaps) * 1000,
            "ttft_ms": statistics.median(ttfts) * 1000, "tokens": tokens, "runs": len(runs)}


def llamacpp_runs(args: argparse.Namespace) -> dict[str, object]:
    from llama_cpp import Llama

    llm = Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=2048,
                verbose=False)
    prompt = llm.tokenize(PROMPTS[args.prompt].encode(), add_bos=True)
    results = []
    for i in range(args.repeat + 1):
        llm.reset()
        t0 = time.perf_counter()
        times: list[float] = []
        for _ in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter() - t0)
            if len(times) >= args.tokens:
                break
        if i > 0:
            results.append((times[0], times))
    out: dict[str, object] = dict(summarize(results, args.tokens))
    out.update(kind="llamacpp", threads=args.threads, prompt=args.prompt, prompt_tokens=len(prompt))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["llamacpp"])
    ap.add_argument("--gguf")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompt", choices=list(PROMPTS), default="short")
    args = ap.parse_args()
    out = llamacpp_runs(args)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
