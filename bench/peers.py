"""Start, watch and stop the servers the harness compares: ours (``trtserver serve``), llama-cpp-python's and
llama.cpp's own ``llama-server`` (built from the llama.cpp sources that llama-cpp-python vendors, so both peers
run the same llama.cpp).

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
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
LLAMACPP_VENV = CACHE / "bench-llamacpp-venv"
LLAMACPP_VERSION = "0.3.36"  # llama-cpp-python, and the llama.cpp it vendors that llama-server is built from
LLAMACPP_SPEC = f"llama-cpp-python[server]=={LLAMACPP_VERSION}"
LLAMA_SERVER_DIR = CACHE / "bench-llama-server"
OUT = ROOT / "bench" / "out"

# the peers ``bench.harness --peers`` knows, by name, and what the report calls them
PEERS = {"llamacpp-python": "llama-cpp-python's server (`llama_cpp.server`)",
         "llama-server": "llama.cpp's own server (`llama-server`)"}


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
    ensure_build_tools()  # the wheel is compiled from source
    print(f"[bench] installing {LLAMACPP_SPEC} into {venv} (compiles; several minutes) ...", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run([str(py), "-m", "pip", "install", "-q", LLAMACPP_SPEC, "psutil", "py-spy"], check=True,
                   timeout=timeout_s)
    return py


def cpuinfo() -> tuple[str, set[str]]:
    """The CPU's model name and its feature flags, from /proc/cpuinfo (empty elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "", set()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())
    return name, flags


# ggml's x86 options and the /proc/cpuinfo flag each one needs
GGML_ISA_OPTIONS = {"GGML_SSE42": "sse4_2", "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma",
                    "GGML_F16C": "f16c", "GGML_BMI2": "bmi2", "GGML_AVX_VNNI": "avx_vnni",
                    "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni",
                    "GGML_AVX512_BF16": "avx512_bf16"}


def llama_server_cmake_args(flags: set[str]) -> list[str]:
    """Configure flags for a portable build for this CPU: every instruction set named from its flags (never
    GGML_NATIVE), AMX off (its tile instructions die with SIGILL on some machines that report it), one static
    binary, no HTTPS, no web UI (whose assets would be downloaded)."""
    isa = [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for opt, flag in GGML_ISA_OPTIONS.items()]
    return ["-DGGML_NATIVE=OFF", *isa, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
            "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_BUILD_TYPE=Release"]


BUILD_TOOLS = {"cmake": "cmake", "make": "make", "c++": "g++"}  # executable -> Debian package


def ensure_build_tools() -> None:
    """cmake, make and a C++ compiler; the missing ones from apt-get (as root, else through sudo)."""
    missing = [pkg for exe, pkg in BUILD_TOOLS.items() if shutil.which(exe) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise RuntimeError(f"building llama-server needs {', '.join(missing)}; install them")
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"[bench] installing {' '.join(missing)} (apt-get) ...", flush=True)
    subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True, env=env, timeout=600)
    subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], check=True,
                   env=env, timeout=1200)


def ensure_llama_server(version: str = LLAMACPP_VERSION, cache: Path = LLAMA_SERVER_DIR, *, jobs: int = 2,
                        timeout_s: float = 3600.0) -> Path:
    """llama.cpp's ``llama-server``, built once (at the lowest CPU priority) from the llama.cpp sources vendored in
    the llama-cpp-python ``version`` sdist, then reused from ``cache/<version>/``."""
    binary = cache / version / "llama-server"
    if os.access(binary, os.X_OK):
        return binary
    ensure_build_tools()
    print(f"[bench] building llama-server from llama-cpp-python {version}'s llama.cpp into {binary.parent} "
          f"(several minutes) ...", flush=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-llama-server-") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python",
                        f"llama-cpp-python=={version}", "-d", str(work)], check=True, timeout=900)
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"), None)
        if sdist is None:
            raise RuntimeError(f"pip download left no llama-cpp-python {version} sdist in {work}")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        src = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
        if src is None:
            raise RuntimeError(f"the llama-cpp-python {version} sdist vendors no llama.cpp")
        build = work / "build"
        nice = ["nice", "-n", "19"]
        subprocess.run([*nice, "cmake", "-S", str(src), "-B", str(build), *llama_server_cmake_args(cpuinfo()[1])],
                       check=True, timeout=600, stdout=subprocess.DEVNULL)
        subprocess.run([*nice, "cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"], check=True,
                       timeout=timeout_s, stdout=subprocess.DEVNULL)
        binary.parent.mkdir(parents=True, exist_ok=True)
        partial = binary.with_name("llama-server.partial")
        shutil.copy2(build / "bin" / "llama-server", partial)
        partial.replace(binary)  # whole or absent: a build cut short is not mistaken for a finished one
    print(f"[bench] built {binary} in {(time.monotonic() - t0) / 60:.1f} min", flush=True)
    return binary


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


def process_cpu_seconds(pid: int) -> float:
    """CPU time of one process's live threads, without its children, to the nanosecond (the schedulers'
    counts in /proc/<pid>/task/*/schedstat; /proc's stat counts in 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


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
    ignore_eos: bool = True  # honours the ``ignore_eos`` request field
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
    return Server("llamacpp-python", cmd, port, "/v1/models", ignore_eos=False)


def llama_server(binary: Path, gguf: Path, port: int, *, slots: int, threads: int, n_ctx: int = 2048) -> Server:
    """llama.cpp's own server: ``slots`` sequences decoded together (continuous batching, on by default), each
    with ``n_ctx`` tokens of context; EOS is banned per request (``ignore_eos``), as for ours."""
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-t", str(threads), "-c", str(n_ctx * slots), "--no-webui"]
    return Server("llama-server", cmd, port, "/health")


def llama_server_version(binary: Path) -> str:
    """``llama-server --version``'s line, e.g. ``version: 1 (0c1e570)``."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return next((line.strip() for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")), "?")
