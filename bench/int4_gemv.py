"""Two int4 GEMV kernels of our own (``bench/int4_gemv.cpp``) against ATen's ``_weight_int4pack_mm_for_cpu``, the
kernel the engine's small-batch decode runs (about two thirds of a batch-1 step), on SmolLM2-135M's shapes.

    .venv/bin/python -m bench.int4_gemv [--threads 2] [--repeat 200]

Needs AVX-512 BF16 and VNNI (built with ``-march=native`` into ``.cache/bench-int4-gemv``). Weights are random,
quantized the way ``Int4Linear`` quantizes (groups of 32, min/max, bfloat16 scale and zero); activations are random
with a few outlier channels, as a transformer's are. Each kernel is timed alternately with ATen's (median of
``--repeat`` calls each) and compared with a float32 product of the same dequantized weights.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import peers

SOURCE = Path(__file__).with_name("int4_gemv.cpp")
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def build() -> None:
    from torch.utils.cpp_extension import load

    out = peers.CACHE / "bench-int4-gemv"
    out.mkdir(parents=True, exist_ok=True)
    load(name="trtserver_bench_int4", sources=[str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
         extra_ldflags=["-fopenmp"],
         is_python_module=False, build_directory=str(out))


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (N, K) in 0..15, scale and zero (N, K / 32) bfloat16, as ``Int4Linear``: w = (q - 8) * scale + zero."""
    N, K = w.shape
    groups = w.view(N, K // 32, 32)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    q = ((groups - lo) / scale).round().clamp(0, 15).to(torch.int32).view(N, K)
    zero = lo + 8 * scale
    return q, scale.view(N, K // 32).to(torch.bfloat16), zero.view(N, K // 32).to(torch.bfloat16)


def pack_bf16(q: torch.Tensor) -> torch.Tensor:
    N, K = q.shape
    qc = q.view(N // 16, 4, 4, K // 32, 4, 2, 2, 2)  # (block, L, i, group, chunk, nibble, h, j)
    byte = (qc[:, :, :, :, :, 0] | (qc[:, :, :, :, :, 1] << 4)).permute(0, 3, 4, 1, 5, 2, 6)
    return byte.to(torch.uint8).contiguous().view(N // 16, -1)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    N, K = q.shape
    qc = q.view(N // 16, 16, K // 32, 4, 2, 4)  # (block, row, group, chunk, nibble, j)
    byte = (qc[:, :, :, :, 0] | (qc[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)
    return byte.to(torch.uint8).contiguous().view(N // 16, -1)


def timed(fn: Callable[[], object], repeat: int) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare(name: str, N: int, K: int, M: int, repeat: int) -> list[str]:
    torch.manual_seed(N * 7 + K + M)
    q, scale, zero = quantize(torch.randn(N, K) * 0.05)
    x = torch.randn(M, K)
    x[:, :: K // 8] *= 20  # outlier channels
    x = x.to(torch.bfloat16)
    aten_packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([scale.t(), zero.t()], -1).contiguous()
    ops = torch.ops.trtserver_bench_int4
    st, zt = scale.t().contiguous(), zero.t().contiguous()
    kernels: dict[str, Callable[[], torch.Tensor]] = {
        "aten": lambda: torch._weight_int4pack_mm_for_cpu(x, aten_packed, 32, scales_zeros),
        "bf16 dot": (lambda p: lambda: ops.int4_mm_bf16(x, p, st, zt))(pack_bf16(q)),
        "int8 dot": (lambda p: lambda: ops.int4_mm_int8(x, p, st, zt))(pack_int8(q)),
    }
    dequant = ((q.view(N, K // 32, 32).float() - 8) * scale.float().unsqueeze(-1)
               + zero.float().unsqueeze(-1)).view(N, K)
    exact = x.float() @ dequant.t()
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for fn in kernels.values():
        fn()
    for r in range(repeat):
        for key in kernels if r % 2 == 0 else reversed(list(kernels)):
            times[key].append(timed(kernels[key], 1))
    aten_us = statistics.median(times["aten"]) * 1e6
    lines = []
    for key, fn in kernels.items():
        us = statistics.median(times[key]) * 1e6
        err = ((fn().float() - exact).norm() / exact.norm()).item()
        lines.append(f"| {name} {N}×{K}, {M} row{'s' if M > 1 else ''} | {key} | {us:.0f} | {aten_us / us:.2f}× | "
                     f"{N * K / 2 / us / 1e3:.1f} | {err:.1e} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.int4_gemv", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args(argv)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "avx512_bf16" not in flags or "avx512_vnni" not in flags:
        print("this CPU lacks avx512_bf16 or avx512_vnni: nothing to measure", file=sys.stderr)
        return 1
    build()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeat} calls each, alternating\n")
    print("| shape | kernel | µs | ATen / kernel | GB/s of int4 weights | error vs float32 (relative) |")
    print("|---|---|---:|---:|---:|---:|")
    for name, (N, K) in SHAPES.items():
        for M in args.rows:
            print("\n".join(compare(name, N, K, M, args.repeat)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
