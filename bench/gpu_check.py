"""The HTTP-suite half of ``make gpu-check`` (run after ``bench.harness --device cuda``): build the default
engine, serve it, run the HTTP suite against it, print one table.

With TensorRT-LLM (and a CUDA GPU, and an engine it built) the server runs ``--engine trtllm``;
otherwise it says so and runs the same suite on the PyTorch engine, on CUDA when available.
Bounded: every step has a time limit (``--build-timeout``, ``--start-timeout``, ``--test-timeout``, ``--budget``).

    python bench/gpu_check.py [--engine-dir engines/SmolLM2-135M-Instruct] [--port 8765]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def trtserver_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("trtserver")
    return [str(exe)] if exe.exists() else [shutil.which("trtserver") or "trtserver"]


def choose_engine(engine_dir: Path) -> tuple[str, list[str], str]:
    """(engine, extra serve flags, why)."""
    from trtserver.config import ServerConfig
    from trtserver.engine.trtllm import trtllm_unavailable_reason

    reason = trtllm_unavailable_reason(ServerConfig(engine_dir=str(engine_dir)))
    if reason is None:
        return "trtllm", [], "TensorRT-LLM engine"
    device = "cuda" if cuda_available() else "cpu"
    return "torch", ["--device", device], f"TensorRT-LLM NOT tested ({reason}); PyTorch engine on {device}"


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server was not healthy after {timeout:.0f}s")


def results(junit: Path) -> list[tuple[str, str, float]]:
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "FAILED" if child.tag == "failure" else "ERROR"
            elif child.tag == "skipped":
                outcome = "skipped"
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        rows.append((name, outcome, float(case.get("time") or 0)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-dir", type=Path, default=ROOT / "engines" / "SmolLM2-135M-Instruct")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--build-timeout", type=float, default=3600)
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--test-timeout", type=float, default=1200)
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for start-up and the suite together: the suite gets what start-up leaves")
    args = parser.parse_args(argv)

    if not args.skip_build:
        print("== building engines (portable dir, plus a TensorRT-LLM engine where it is installed)",
              flush=True)
        subprocess.run([*trtserver_cmd(), "build"], cwd=ROOT, check=True, timeout=args.build_timeout)
    started = time.monotonic()
    engine, flags, why = choose_engine(args.engine_dir)
    print(f"== engine: {why}", flush=True)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="gpu-check-server-", suffix=".log", delete=False)
    server = subprocess.Popen([*trtserver_cmd(), "serve", str(args.engine_dir), "--engine", engine,
                               "--port", str(port), *flags], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    rows: list[tuple[str, str, float]] = []
    code = 1
    try:
        wait_healthy(url, server, args.start_timeout)
        junit = Path(tempfile.mkdtemp(prefix="gpu-check-")) / "junit.xml"
        device = flags[flags.index("--device") + 1] if "--device" in flags else "cuda"
        # only the plugins the suite uses: a GPU image's own (pytest-benchmark, -xdist, -cov...) stay out
        env = {**os.environ, "TRTSERVER_TEST_BASE_URL": url, "TRTSERVER_TEST_BASE_DEVICE": device,
               "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        test_timeout = args.test_timeout
        if args.budget is not None:
            test_timeout = min(test_timeout, args.budget - (time.monotonic() - started) - 40)
        try:
            # -v: each result is in the log as it happens, should the time limit cut the run short
            cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "pytest_asyncio.plugin",
                   "-p", "pytest_timeout", "-p", "trtserver.testing", "tests/http", f"--junitxml={junit}"]
            done = subprocess.run(cmd, cwd=ROOT, env=env, timeout=test_timeout)
            code = done.returncode
        except subprocess.TimeoutExpired:
            print(f"!! the HTTP suite did not finish in {test_timeout:.0f}s")
        if junit.exists():
            rows = results(junit)
    except RuntimeError as exc:
        print(f"!! {exc}; server log: {log.name}")
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    width = max([len(r[0]) for r in rows] + [10])
    print(f"\n== gpu-check: {why}")
    print(f"{'test':<{width}}  {'result':<8}  seconds")
    for name, outcome, seconds in rows:
        print(f"{name:<{width}}  {outcome:<8}  {seconds:7.2f}")
    passed = sum(1 for r in rows if r[1] == "passed")
    print(f"{passed}/{len(rows)} passed on engine={engine}; server log: {log.name}")
    return code if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
