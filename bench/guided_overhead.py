"""Cost of guided decoding per token (xgrammar) against a plain decode step of the real model.

Per step and batch B: ``fill_bitmask`` for every row + unpacking/applying the (B, ceil(V/32)) mask
to the logits (the torch ops the PyTorch engine uses) + ``accept_token`` for every row, with every
row inside a JSON string (the common, widest state). The model step is one batched decode forward
of SmolLM2-135M with a KV cache (transformers' Llama, float32, CPU). Prints the ratio; target < 5 %.

    .venv/bin/python bench/guided_overhead.py [--engine-dir engines/SmolLM2-135M-Instruct] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from trtserver_guided.plugin import guided_decoder

from trtserver.guided import GuideContext, GuideSpec
from trtserver.tokenizer import Tokenizer

NEG_INF = float("-inf")


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, shifts: torch.Tensor) -> None:
    bits = (mask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.view(mask.shape[0], -1)[:, : logits.shape[1]].bool()
    logits.masked_fill_(~allowed, NEG_INF)


def model_step_ms(engine_dir: Path, batch: int, steps: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(engine_dir), dtype=torch.float32).eval()
    ids = torch.full((batch, 32), 28, dtype=torch.long)
    times = []
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for i in range(steps + 3):
            t = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            if i >= 3:
                times.append(time.perf_counter() - t)
            past = out.past_key_values
    return statistics.median(times) * 1000


def guided_step_ms(tok: Tokenizer, vocab_size: int, batch: int, steps: int) -> tuple[float, float, float]:
    ctx = GuideContext(tokenizer=tok, vocab_size=vocab_size, eos_token_ids=tok.eos_token_ids)
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    decoder = guided_decoder(GuideSpec("json", schema), "xgrammar", ctx)
    assert decoder is not None
    states = [decoder.new_state() for _ in range(batch)]
    for st in states:
        for t in tok.encode('{"s": "', add_special_tokens=False):
            assert st.accept_token(t)
    letter = tok.encode("a", add_special_tokens=False)[0]
    words = (vocab_size + 31) // 32
    shifts = torch.arange(32, dtype=torch.int32)
    logits = torch.randn(batch, vocab_size)
    fills, applies, accepts = [], [], []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        mask = torch.zeros(batch, words, dtype=torch.int32)
        for row, st in enumerate(states):
            st.fill_bitmask(mask, row)
        t1 = time.perf_counter()
        apply_bitmask(logits, mask, shifts)
        t2 = time.perf_counter()
        for st in states:
            assert st.accept_token(letter)
            st.is_terminated()
        t3 = time.perf_counter()
        if i >= 3:
            fills.append(t1 - t0)
            applies.append(t2 - t1)
            accepts.append(t3 - t2)
    return tuple(statistics.median(x) * 1000 for x in (fills, applies, accepts))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-dir", default=str(Path(__file__).resolve().parents[1] / "engines"
                                                      / "SmolLM2-135M-Instruct"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batches", default="1,16")
    args = parser.parse_args()
    engine_dir = Path(args.engine_dir)
    tok = Tokenizer.from_dir(engine_dir)
    vocab_size = int(json.loads((engine_dir / "config.json").read_text())["vocab_size"])
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, vocab {vocab_size}")
    header = ("batch", "model ms", "fill ms", "apply ms", "accept ms", "guided ms", "ratio")
    print("{:>5} {:>9} {:>8} {:>9} {:>10} {:>10} {:>7}".format(*header))
    for batch in (int(b) for b in args.batches.split(",")):
        model_ms = model_step_ms(engine_dir, batch, args.steps)
        fill, apply, accept = guided_step_ms(tok, vocab_size, batch, args.steps * 3)
        total = fill + apply + accept
        print(f"{batch:>5} {model_ms:>9.2f} {fill:>8.3f} {apply:>9.3f} {accept:>10.3f} {total:>10.3f} "
              f"{100 * total / model_ms:>6.2f}%")


if __name__ == "__main__":
    main()
