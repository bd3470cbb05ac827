"""``make bench``: our server against llama.cpp on the same GGUF model: llama.cpp's own server (``llama-server``),
llama-cpp-python's server, and llama.cpp in process.

    python -m bench.harness                 # ours, both llama.cpp servers, llama.cpp in process (~12 min)
    python -m bench.harness --quick         # fewer requests per scenario (~6 min)
    python -m bench.harness --peers llama-server --no-inproc   # ours against llama-server only
    python -m bench.harness --ours-only --no-inproc   # ours alone (nothing to build or install)
    python -m bench.harness --with-64-streams --scenarios "64 streams" --peers llama-server --no-inproc
    python -m bench.harness --device cuda   # GPU: ours only, 1/16/64 streams, batch-1 memory-bandwidth roofline

Request mix (temperature 0, 128 tokens each): one stream with a short and with a ~230-token prompt, then 4 and 16
concurrent closed-loop streams, then two prefill scenarios; aggregate tokens/s, p50/p99 latency, time to first token;
RSS and start-up time. All servers are up together and each scenario runs on ours, then right after on each peer in
turn, so that each ratio compares figures taken seconds apart even on a machine whose speed drifts.

The report is written afresh to ``bench/results/<machine-label>.md`` (one file per machine; ``--label`` names it),
one table per peer, and a copy with the server commands, notes and profiles to ``bench/out/``. llama-cpp-python
runs from its own venv (``.cache/bench-llamacpp-venv``, installed on first use); ``llama-server`` is built on first
use from the llama.cpp sources vendored in the same llama-cpp-python release (``.cache/bench-llama-server/``).
Everything is bounded (per-request and start-up timeouts, ``--max-minutes``), loopback only, and every process
started is stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import peers
from bench.report import (
    _ITEMSIZE,
    ServerRun,
    default_peak_bw,
    fmt,
    git_revision,
    gpu_name,
    llamacpp_version,
    machine_label,
    machine_line,
    peer_sections,
    weight_params,
)
from bench.rounds import drive, scenarios

ROOT = peers.ROOT
DEFAULT_ENGINE = ROOT / "engines" / "SmolLM2-135M-Instruct"
RESULTS_DIR = ROOT / "bench" / "results"


def start_server(server: peers.Server, run: ServerRun, args: argparse.Namespace) -> None:
    print(f"[bench] starting {server.name}: {' '.join(server.cmd)}", flush=True)
    run.startup_s = server.start(timeout_s=args.start_timeout)
    print(f"[bench] {server.name} ready in {run.startup_s:.2f} s, RSS {server.peak_rss / 2**20:.0f} MiB", flush=True)


def peer_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in peers.PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer {', '.join(unknown)}; known: {', '.join(peers.PEERS)}")
    return names


def llama_server_slots(args: argparse.Namespace) -> int:
    """llama-server's parallel slots: the most concurrent streams of any scenario (unfiltered by --scenarios, so
    that the server is the same whichever scenarios run), so that none of its requests waits for a slot."""
    return max(sc.streams for sc in scenarios(argparse.Namespace(**{**vars(args), "scenarios": None})))


def llama_server_threads(args: argparse.Namespace) -> int:
    return args.llama_server_threads or os.cpu_count() or 1


def inproc(python: Path, kind: str, extra: list[str], timeout_s: float) -> dict[str, Any]:
    return result_line([str(python), str(ROOT / "bench" / "inproc.py"), kind, *extra], timeout_s)


def result_line(cmd: list[str], timeout_s: float) -> dict[str, Any]:
    """Run a measurement in its own process; its answer is the line starting ``RESULT `` (JSON)."""
    print(f"[bench] in-process: {' '.join(cmd)}", flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out: dict[str, Any] = json.loads(line[7:])
            print(f"[bench]   {out}", flush=True)
            return out
    return {"error": (proc.stderr or proc.stdout)[-400:]}


# ---- the GPU roofline ---------------------------------------------------------------------------------------------


# ---- the report ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.harness", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests per scenario")
    ap.add_argument("--ours-only", action="store_true", help="skip the llama.cpp peers")
    ap.add_argument("--peers", type=peer_list, default=list(peers.PEERS), metavar="NAME,...",
                    help=f"the peers each scenario also runs on, in this order (default: {','.join(peers.PEERS)})")
    ap.add_argument("--with-64-streams", action="store_true",
                    help="CPU: add 64 concurrent streams (ours with --max-batch-size 64, llama-server with -np 64)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: ours only, 1/16/64 streams, roofline")
    ap.add_argument("--peak-bw-gbs", type=float, default=None,
                    help="GPU peak memory bandwidth in GB/s (default: by GPU name, e.g. H200 = 4800)")
    ap.add_argument("--engine-dir", type=Path, default=DEFAULT_ENGINE)
    ap.add_argument("--gguf", type=Path, default=None, help="default: the cached GGUF of the default model")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--scenarios", nargs="*", default=None, metavar="TEXT",
                    help="run only the scenarios whose names contain one of these (e.g. prefill)")
    ap.add_argument("--peer-threads", type=int, default=1, help="llama-cpp-python server --n_threads")
    ap.add_argument("--llama-server-threads", type=int, default=0,
                    help="llama-server -t (default: every core, as ours)")
    ap.add_argument("--ours-dtype", default="auto",
                    help="--dtype for our server and the in-process run (auto: each picks by itself, as served)")
    ap.add_argument("--ours-args", default="", help="extra flags for `trtserver serve` (space-separated)")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="skip py-spy on our server")
    ap.add_argument("--profile-seconds", type=int, default=20)
    ap.add_argument("--no-inproc", dest="inproc", action="store_false", help="skip the in-process measurements")
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--max-minutes", type=float, default=45.0, help="skip what is left after this long")
    ap.add_argument("--label", default=None, help="the results file's name (default: from the CPU or GPU)")
    ap.add_argument("--results", type=Path, default=None,
                    help="where the report goes (default: bench/results/<label>.md)")
    ap.add_argument("--no-write", dest="write", action="store_false", help="print only; write no files")
    args = ap.parse_args(argv)
    gpu = args.device != "cpu"
    ours_only = args.ours_only or gpu
    t_start = time.monotonic()
    load_before = os.getloadavg()
    revision = git_revision()  # the code the server runs is the working tree at start-up
    deadline = t_start + 60 * args.max_minutes
    engine_dir = args.engine_dir.resolve()
    if not (engine_dir / "config.json").exists():
        print(f"[bench] {engine_dir}: no engine; run `make engines` first", file=sys.stderr)
        return 2

    peer_names = [] if ours_only else args.peers
    llama_py: Path | None = None
    llama_bin: Path | None = None
    gguf: Path | None = None
    if peer_names or (args.inproc and not gpu):
        gguf = (args.gguf or peers.find_gguf()).resolve()
    if "llamacpp-python" in peer_names or (args.inproc and not gpu):
        llama_py = peers.ensure_llamacpp_venv()
        print(f"[bench] peer: llama-cpp-python {llamacpp_version(llama_py)} on {gguf}", flush=True)
    if "llama-server" in peer_names:
        try:
            llama_bin = peers.ensure_llama_server()
            print(f"[bench] peer: {llama_bin} ({peers.llama_server_version(llama_bin)}) on {gguf}", flush=True)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            print(f"[bench] llama-server could not be built, so it is left out: {exc}", file=sys.stderr)

    ours_extra = args.ours_args.split()
    if args.ours_dtype != "auto":
        ours_extra += ["--dtype", args.ours_dtype]
    if gpu or args.with_64_streams:
        ours_extra += ["--max-batch-size", "64"]
    ours = ServerRun("ours")
    server = peers.ours(engine_dir, peers.free_port(), device=args.device, extra=ours_extra)
    pservers: list[tuple[peers.Server, ServerRun]] = []
    for name in peer_names:
        if name == "llamacpp-python" and llama_py is not None and gguf is not None:
            pserver = peers.llamacpp(llama_py, gguf, peers.free_port(), n_threads=args.peer_threads)
        elif name == "llama-server" and llama_bin is not None and gguf is not None:
            pserver = peers.llama_server(llama_bin, gguf, peers.free_port(), slots=llama_server_slots(args),
                                         threads=llama_server_threads(args))
        else:
            continue
        pservers.append((pserver, ServerRun(name)))
    with server, contextlib.ExitStack() as stack:
        try:
            start_server(server, ours, args)
        except (RuntimeError, TimeoutError) as exc:
            print(f"[bench] our server did not start: {exc}\n{server.log_text()[-2000:]}", file=sys.stderr)
            return 1
        ours.notes.append(f"ours: `{' '.join(server.cmd)}` (dtype {args.ours_dtype})")
        driven: list[tuple[peers.Server, ServerRun, bool]] = [(server, ours, True)]
        for pserver, prun in pservers:
            stack.enter_context(pserver)
            try:
                start_server(pserver, prun, args)
                prun.notes.append(f"{prun.name}: `{' '.join(pserver.cmd)}`")
                driven.append((pserver, prun, False))
            except (RuntimeError, TimeoutError) as exc:
                prun.notes.append(f"{prun.name} failed: {exc}")
                print(f"[bench] {exc}\n{pserver.log_text()[-2000:]}", flush=True)
        asyncio.run(drive(driven, args, deadline))
    peer_runs = [run for _, run, is_ours in driven if not is_ours]
    dtype = args.ours_dtype

    notes = ours.notes + [n for _, prun in pservers for n in prun.notes]
    inproc_results: dict[str, dict[str, Any]] = {}
    paired: dict[str, Any] = {}
    if args.inproc and time.monotonic() < deadline:
        repeat = ["--repeat", "1" if args.quick else "3", "--tokens", str(args.tokens)]
        rounds = 4 if args.quick else 12
        paired = result_line([sys.executable, "-m", "bench.overhead", "--json", "--engine-dir", str(engine_dir),
                              "--rounds", str(rounds), "--tokens", str(args.tokens), "--dtype", dtype,
                              "--device", args.device, f"--ours-args={args.ours_args}"],
                             min(900.0, max(60.0, deadline + 60 - time.monotonic())))  # --max-minutes binds it too
        if llama_py is not None and gguf is not None:
            for t in (1, 2):
                inproc_results[f"llamacpp{t}"] = inproc(llama_py, "llamacpp",
                                                        ["--gguf", str(gguf), "--threads", str(t), *repeat], 900)

    single = ours.loads.get("1 stream, short prompt") or ours.loads.get("1 stream")
    sections = peer_sections(ours, peer_runs)

    inproc_rows = []
    for key, v in inproc_results.items():
        if "decode_tps" not in v:
            notes.append(f"in-process {key} failed: {v.get('error', '')[:200]}")
        elif single is not None:
            inproc_rows.append(f"| 1 stream: decode tokens/s (llama.cpp n_threads {v.get('threads')}) | "
                               f"{fmt(single.per_stream_tps)} | {fmt(v['decode_tps'])} | "
                               f"{fmt(single.per_stream_tps / v['decode_tps'], '.2f')}× |")
    if inproc_rows:
        sections.append(("Ours over HTTP against llama.cpp in process (`llama_cpp.Llama`, no server)",
                         ["| metric | ours over HTTP | llama.cpp in process | ours/peer |", "|---|---:|---:|---:|",
                          *inproc_rows]))

    if "overhead_pct" in paired:
        sections.append(("Ours over HTTP against our engine with no server (`python -m bench.overhead`)", [
            "| metric | value |", "|---|---:|",
            f"| time per token, over HTTP / through `engine.generate` with no server (ms, medians) | "
            f"{paired['http_ms']:.2f} / {paired['inproc_ms']:.2f} |",
            f"| server overhead per streamed token, wall clock (median of {paired['rounds']} paired rounds; range) | "
            f"{paired['overhead_pct']:+.1f} % ({paired['overhead_pct_min']:+.1f} to "
            f"{paired['overhead_pct_max']:+.1f} %) |",
            f"| event-loop CPU per streamed token, against the step without HTTP | "
            f"{paired['loop_cpu_ms']:.3f} ms = {paired['loop_cpu_pct']:.1f} % |",
            f"| `engine.generate` with no server: decode tokens/s, batch 1 | {fmt(1000 / paired['inproc_ms'])} |"]))
    elif paired:
        notes.append(f"paired overhead run failed: {paired.get('error', '')[:200]}")

    if gpu and single is not None:
        params = weight_params(engine_dir)
        serve_dtype = dtype if dtype in _ITEMSIZE else "bfloat16"  # auto on CUDA serves bfloat16
        name = gpu_name()
        peak = args.peak_bw_gbs or default_peak_bw(name)
        achieved = params * _ITEMSIZE[serve_dtype] * single.per_stream_tps / 1e9
        frac = f"{100 * achieved / peak:.2f} % of {peak:.0f} GB/s" if peak else "n/a (pass --peak-bw-gbs)"
        sections.append((f"Batch-1 memory-bandwidth roofline ({name or 'GPU'})", [
            "| weights read per token | achieved | of peak |", "|---|---:|---:|",
            f"| {params / 1e6:.1f} M params × {_ITEMSIZE[serve_dtype]} B ({serve_dtype}) | {achieved:.1f} GB/s | "
            f"{frac} |"]))

    kind = "GPU" if gpu else ("against llama.cpp" if peer_runs else "ours only")
    cmd = "python -m bench.harness " + " ".join(argv if argv is not None else sys.argv[1:])
    stamp = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    mix = ", ".join(f"{name} ({len(load.results)} requests)" for name, load in ours.loads.items())
    lines = [f"# {kind}{' (quick)' if args.quick else ''}: {stamp}", "",
             f"- hardware: {machine_line(args)}",
             f"- model: {engine_dir.name}"
             + (f"; the peers serve the same weights from `{gguf.name}`" if peer_runs and gguf else ""),
             f"- request mix: {args.tokens} tokens per request (8 in the prefill scenarios), temperature 0; {mix}",
             f"- command: `{cmd.strip()}` (took {(time.monotonic() - t_start) / 60:.1f} min)",
             f"- code: {revision}",
             "- load average (1/5/15 min) at start {:.1f}/{:.1f}/{:.1f}, at end {:.1f}/{:.1f}/{:.1f} "
             "on {} cores".format(*load_before, *os.getloadavg(), os.cpu_count() or 1)]
    for _, prun in pservers:
        if prun.name == "llamacpp-python" and llama_py is not None:
            lines.append(f"- peer: llama-cpp-python {llamacpp_version(llama_py)}, --n_threads {args.peer_threads}")
        elif prun.name == "llama-server" and llama_bin is not None:
            lines.append(f"- peer: llama-server built from llama-cpp-python {peers.LLAMACPP_VERSION}'s llama.cpp "
                         f"({peers.llama_server_version(llama_bin)}), -np {llama_server_slots(args)}, "
                         f"-t {llama_server_threads(args)}")
    for title, table in sections:
        lines += ["", f"## {title}", "", *table]
    lines += ["", "ours/peer: ↑ higher is better, ↓ lower is better; p99 over few samples is the maximum."]
    report = "\n".join(lines) + "\n"
    counted = {f"{r.name}: {ld.counted_by}" for r in (ours, *peer_runs) for ld in r.loads.values()}
    raw = [report, "## Notes", "", *[f"- {n}" for n in notes],
           f"- token counting: {', '.join(sorted(counted))} (usage = stream_options.include_usage; "
           "chunks = one SSE chunk per token)"]
    for streams, text in ours.profile.items():
        raw += ["", f"py-spy of our server during an extra (unmeasured) {streams}-stream round "
                f"(`py-spy record --nonblocking --threads --rate 50`, {args.profile_seconds} s):", "", "```",
                text, "```"]
    print("\n" + "\n".join(raw), flush=True)
    if args.write:
        label = args.label or machine_label(args.device)
        results = args.results or RESULTS_DIR / f"{label}.md"
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(report)
        peers.OUT.mkdir(parents=True, exist_ok=True)
        raw_path = peers.OUT / f"{label}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.md"
        raw_path.write_text("\n".join(raw) + "\n")
        print(f"[bench] wrote {results} (raw: {raw_path})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
