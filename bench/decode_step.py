"""CPU time of one decode step of the default model, through the model runner as the engine calls it, at a few
batch sizes: for comparing two checkouts of the engine, run in turn.

    .venv/bin/python -m bench.decode_step [--rows 1,4,16] [--threads 1] [--steps 150] [--tree PATH]

``--tree`` imports trtserver from another checkout (its engine's C++ kernels are built there on first use).

One process per run, the model loaded as ``trtserver serve`` loads it (dtype and quantization on auto). CPU time,
not wall time, so another process on the machine moves the figures less; still, alternate the two trees over a
few runs and compare medians.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

DEFAULT_ENGINE = Path(__file__).resolve().parent.parent / "engines" / "SmolLM2-135M-Instruct"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-dir", type=Path, default=DEFAULT_ENGINE)
    parser.add_argument("--rows", default="1,4,16", help="decode batch sizes, comma-separated")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=150, help="timed steps per batch size (a quarter above 8 rows)")
    parser.add_argument("--tree", type=Path, help="a checkout to import trtserver from instead of this one")
    args = parser.parse_args()
    if args.tree is not None:
        sys.path.insert(0, str(args.tree.resolve()))

    import trtserver
    from trtserver.config import ServerConfig
    from trtserver.engine.torch import loader
    from trtserver.manifest import load_manifest

    config = ServerConfig(engine_dir=str(args.engine_dir))
    placement = loader.place(config, load_manifest(args.engine_dir), "auto")
    t0 = time.perf_counter()
    loaded = loader.load(args.engine_dir, config, placement, eos_token_ids=(), max_len=2048, seed=0, adapters=None)
    runner = loaded.core.model_runner
    print(f"{Path(trtserver.__file__).parent}: {str(loaded.dtype).removeprefix('torch.')}, "
          f"quantize {placement.quantize}, loaded in {time.perf_counter() - t0:.2f} s, {args.threads} thread(s)")
    torch.set_num_threads(args.threads)
    figures = []
    for rows in (int(r) for r in args.rows.split(",")):
        slots, positions = list(range(rows)), [300 + 7 * r for r in range(rows)]  # scattered lengths, one view
        tokens = torch.ones((rows, 1), dtype=torch.long)
        steps = args.steps if rows <= 8 else max(1, args.steps // 4)
        with torch.inference_mode():
            for _ in range(5):
                runner.forward(tokens, runner.decode_context(slots, positions))
            start = cpu_seconds()
            for _ in range(steps):
                runner.forward(tokens, runner.decode_context(slots, positions))
        figures.append(f"{rows} rows {(cpu_seconds() - start) / steps * 1e3:.2f} ms")
    print("CPU time per step: " + ", ".join(figures))


if __name__ == "__main__":
    main()
