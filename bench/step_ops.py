"""How many ATen calls one CUDA-graph decode step makes, counted on the CPU: what the README's batch-1 roofline
estimate for a GPU rests on (each call other than a view is about one kernel in the captured graph).

    .venv/bin/python -m bench.step_ops [--rows 1] [--length 256]
"""

from __future__ import annotations

import argparse
import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench import peers
from trtserver.engine.torch.core import EngineCore
from trtserver.engine.torch.graphs import DecodeGraphs
from trtserver.engine.torch.model import load_model

VIEWS = {"view", "_unsafe_view", "split", "split_with_sizes", "slice", "select", "transpose", "unsqueeze", "squeeze",
         "expand", "reshape", "alias", "t", "as_strided", "permute", "detach", "unbind", "chunk"}


class CountCalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_ops", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", default=str(peers.ROOT / "engines" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--length", type=int, default=256)
    args = ap.parse_args(argv)
    model = load_model(args.engine_dir, torch.float32, torch.device("cpu"))
    core = EngineCore(model, num_slots=args.rows, max_len=max(args.length, 256), chunk_size=64, eos_token_ids=[0],
                      device=torch.device("cpu"))
    graphs = DecodeGraphs(core)
    with torch.inference_mode(), CountCalls() as mode:
        graphs._step((args.rows, args.length))
    total = sum(mode.calls.values())
    compute = total - sum(n for name, n in mode.calls.items() if name in VIEWS)
    layers = model.args.n_layers
    print(f"{total} ATen calls, {compute} other than views ({compute / layers:.1f} a layer over {layers} layers)")
    print(", ".join(f"{name} {n}" for name, n in mode.calls.most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
