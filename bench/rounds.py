"""What each server is driven through, for ``bench.harness``: the scenarios, the RSS sampling while they run, the
request fields each server gets (``probe_extra``), and the py-spy round on ours."""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

from bench import peers
from bench.client import completion_usage, run_load
from bench.profiling import py_spy, summarize_profile
from bench.prompts import DOCUMENT, LONG, SHORT
from bench.report import ServerRun


@dataclass
class Scenario:
    name: str
    prompt: str
    streams: int
    per_stream: int
    tokens: int | None = None  # None: --tokens
    shared_prefix: bool = False  # requests share ``prompt`` and differ in a short tail (the first fills the cache)


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    q = args.quick
    if args.device != "cpu":
        out = [Scenario("1 stream", SHORT, 1, 2 if q else 5), Scenario("16 streams", SHORT, 16, 1 if q else 3),
               Scenario("64 streams", SHORT, 64, 1 if q else 2)]
        return [sc for sc in out if not args.scenarios or any(part in sc.name for part in args.scenarios)]
    out = [Scenario("1 stream, short prompt", SHORT, 1, 2 if q else 4),
           Scenario("1 stream, ~230-token prompt", LONG, 1, 1 if q else 3)]
    out += [Scenario("4 streams", SHORT, 4, 1 if q else 2), Scenario("16 streams", SHORT, 16, 1 if q else 2)]
    if getattr(args, "with_64_streams", False):
        out.append(Scenario("64 streams", SHORT, 64, 1))
    out += [Scenario("prefill, ~930-token unique prompt", DOCUMENT, 1, 2 if q else 3, tokens=8),
            Scenario("prefill, ~930-token shared prefix", DOCUMENT, 1, 3 if q else 5, tokens=8, shared_prefix=True)]
    return [sc for sc in out if not args.scenarios or any(part in sc.name for part in args.scenarios)]


class RssSampler:
    """Samples a server's RSS (process tree) every ``interval`` seconds on a thread while a load runs."""

    def __init__(self, server: peers.Server, interval: float = 0.25) -> None:
        self.server, self.interval = server, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.server.sample_rss()

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def model_name(base_url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as resp:
        data = json.load(resp)
    return str(data["data"][0]["id"])


async def probe_extra(server: peers.Server, model: str, tokens: int, ours: bool) -> tuple[dict[str, Any], list[str]]:
    """The request fields this server gets, and what was found out about them (ignore_eos, include_usage)."""
    notes: list[str] = []
    extra: dict[str, Any] = {"stream_options": {"include_usage": True}}
    if not ours:
        # does it accept stream_options? (if it rejects it, count chunks)
        trial = await run_load(server.base_url, model, SHORT, 4, 1, 1, extra=extra, timeout_s=60)
        r = trial.results[0]
        if not r.ok:
            extra = {}
            notes.append(f"{server.name}: stream_options rejected ({r.error[:80]}); tokens counted as SSE chunks")
        elif r.counted_by != "usage":
            notes.append(f"{server.name}: stream_options.include_usage accepted but no usage chunk sent; "
                         "tokens counted as SSE chunks")
    if server.ignore_eos:
        extra["ignore_eos"] = True
    else:
        # ignore_eos: send it and see whether it changes anything; the prompts are chosen not to stop early anyway
        try:
            n, finish, _ = await completion_usage(server.base_url, model, SHORT, tokens, {"ignore_eos": True})
            notes.append(f"{server.name}: `ignore_eos` is not a field of this server (sent, silently "
                         f"ignored; not sent in the runs); the prompts are chosen to run past {tokens} tokens "
                         f"(non-streamed check: {n} tokens, finish_reason={finish})")
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            notes.append(f"{server.name}: `ignore_eos` rejected ({str(exc)[:80]}); not sent")
    for label, prompt in (("short", SHORT), ("long", LONG)):
        fields = {k: v for k, v in extra.items() if k != "stream_options"}
        n, finish, _ = await completion_usage(server.base_url, model, prompt, tokens, fields)
        if n != tokens:
            notes.append(f"{server.name}: WARNING {label} prompt generated {n} tokens, not {tokens} ({finish})")
    return extra, notes


async def drive(servers: list[tuple[peers.Server, ServerRun, bool]], args: argparse.Namespace,
                deadline: float) -> None:
    """Every scenario for every server, one server right after the other: this machine's speed drifts by
    tens of percent over minutes, so ours and each peer's figures for a scenario are taken seconds apart."""
    models: dict[str, str] = {}
    extras: dict[str, dict[str, Any]] = {}
    for server, run, ours in servers:
        models[server.name] = model = model_name(server.base_url)
        run.rss_idle = server.sample_rss()
        extras[server.name], notes = await probe_extra(server, model, args.tokens, ours)
        run.notes += notes
        await run_load(server.base_url, model, SHORT, 16, 1, 1, extra=extras[server.name])  # warm-up
    for sc in scenarios(args):
        for server, run, _ in servers:
            if time.monotonic() > deadline:
                run.notes.append(f"{server.name}: skipped '{sc.name}' (past --max-minutes)")
                continue
            await run_scenario(server, run, sc, models[server.name], extras[server.name], args)
    for server, run, ours in servers:
        if ours and args.profile and args.device == "cpu" and time.monotonic() < deadline:
            for streams in (1, 16):
                if time.monotonic() < deadline:
                    run.profile[streams] = await profile_round(server, models[server.name],
                                                               extras[server.name], args, streams)
        run.rss_peak = server.peak_rss


async def run_scenario(server: peers.Server, run: ServerRun, sc: Scenario, model: str, extra: dict[str, Any],
                       args: argparse.Namespace) -> None:
    cpu0, main0 = server.cpu_seconds(), server.main_thread_cpu_seconds()
    with RssSampler(server):
        tokens = sc.tokens or args.tokens
        load = await run_load(server.base_url, model, sc.prompt, tokens, sc.streams, sc.per_stream,
                              extra=extra, timeout_s=args.request_timeout, shared_prefix=sc.shared_prefix)
    run.loads[sc.name] = load
    run.cpu_s[sc.name] = server.cpu_seconds() - cpu0
    run.main_cpu_s[sc.name] = server.main_thread_cpu_seconds() - main0
    short = [r.tokens for r in load.ok if r.tokens != tokens]
    if load.failures or short:
        errors = {r.error for r in load.results if not r.ok}
        run.notes.append(f"{server.name} '{sc.name}': {load.failures} failed {sorted(errors)[:2]}, "
                         f"{len(short)} streams not {tokens} tokens ({short[:5]})")
    print(f"[bench] {server.name:15s} {sc.name:33s} agg {load.agg_tps:7.1f} tok/s  per-stream "
          f"{load.per_stream_tps:6.1f} tok/s  ttft p50 {1000 * load.pct('ttft_s', 50):7.0f} ms  "
          f"lat p50 {load.pct('latency_s', 50):6.2f} s p99 {load.pct('latency_s', 99):6.2f} s  "
          f"[{load.counted_by}]", flush=True)


async def profile_round(server: peers.Server, model: str, extra: dict[str, Any], args: argparse.Namespace,
                        streams: int) -> str:
    """An extra (unmeasured) round of ``streams`` streams with py-spy sampling our server."""
    exe = py_spy()
    if exe is None or server.proc is None:
        return "(py-spy not found: pip install py-spy into .cache/bench-llamacpp-venv)"
    raw = peers.OUT / f"ours-{streams}streams.pyspy.txt"
    duration = args.profile_seconds
    cmd = [exe, "record", "--pid", str(server.proc.pid), "--duration", str(duration), "--rate", "50",
           "--format", "raw", "--output", str(raw), "--nonblocking", "--threads"]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # enough requests to cover the sampling window (py-spy stops by itself after `duration`)
        per_stream = 3 if streams == 1 else 1
        await run_load(server.base_url, model, SHORT, args.tokens, streams, per_stream, extra=extra,
                       timeout_s=args.request_timeout)
        _, err = spy.communicate(timeout=duration + 30)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait(timeout=10)
        return "(py-spy timed out)"
    if not raw.exists():
        return f"(py-spy failed: {err.decode(errors='replace')[-300:]})"
    return summarize_profile(raw)
