"""The offline install bundle (trtserver/bundle.py): what it pins, how it splits, and that its
install.sh installs with pip --no-index from the directory alone."""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from trtserver import bundle
from trtserver.bundle import BundleError, Pin, closure, local_projects, parse_size, target_environment

ROOT = Path(__file__).resolve().parents[2]

FAKE = {
    "app": ("1.0", ["lib>=1", "old-backport; python_version < '3.11'", "fancy; extra == 'all'", "torch>=2",
                    "armonly; platform_machine == 'aarch64'"]),
    "lib": ("2.5", ["leaf", "typing-extensions; python_version < '3.13'"]),
    "leaf": ("0.3", []),
    "fancy": ("4.0", ["leaf"]),
    "typing-extensions": ("4.16.0", []),
    "armonly": ("1.1", []),
    "mine": ("0.1", ["app[all]"]),
}


def lookup(name: str) -> tuple[str, list[str]] | None:
    return FAKE.get(name)


def test_closure_pins_what_the_target_python_and_platform_need() -> None:
    pins = closure(["app"], target_environment("3.12", "linux-x86_64"), set(), lookup)
    assert pins == [Pin("app", "1.0"), Pin("leaf", "0.3"), Pin("lib", "2.5"), Pin("typing-extensions", "4.16.0")]

    jetson = closure(["app"], target_environment("3.10", "linux-aarch64"), set(), lookup)
    assert Pin("armonly", "1.1") in jetson
    # a backport this environment lacks is carried unpinned, for pip to choose for the target
    assert Pin("old-backport", None) in jetson and str(Pin("old-backport", None)) == "old-backport"

    with_extra = closure(["mine"], target_environment("3.13", "linux-x86_64"), {"mine"}, lookup)
    names = [p.name for p in with_extra]
    assert "fancy" in names and "mine" not in names and "typing-extensions" not in names


def test_closure_leaves_the_targets_torch_alone() -> None:
    def strict(name: str) -> tuple[str, list[str]] | None:
        assert name != "torch", "torch was looked up"
        return lookup(name)

    assert "torch" not in [p.name for p in closure(["app"], target_environment("3.12", "linux-x86_64"), set(), strict)]
    assert bundle.left_to_target("nvidia-cublas-cu12") and not bundle.left_to_target("numpy")


def test_closure_of_this_project_pins_what_is_installed_here() -> None:
    projects = local_projects(ROOT, None)
    roots = [bundle.with_extras(n, f) for n, f in projects]
    pins = closure(roots, target_environment("3.11", "linux-x86_64"), {n for n, _ in projects})
    by_name = {p.name: p.version for p in pins}
    assert by_name["msgspec"] and by_name["aiohttp"] and by_name["xgrammar"]
    assert "torch" not in by_name and "trtserver" not in by_name and "pytest" not in by_name


def test_local_projects_are_trtserver_and_the_chosen_plugins(tmp_path: Path) -> None:
    every = local_projects(ROOT, None)
    folders = sorted(p.parent.name for p in ROOT.glob("plugins/*/pyproject.toml"))
    assert every[0] == ("trtserver", ROOT) and [f.name for _, f in every[1:]] == folders
    assert [n for n, _ in local_projects(ROOT, ["guided"])] == ["trtserver", "trtserver-guided"]
    assert local_projects(ROOT, []) == [("trtserver", ROOT)]
    guided = ROOT / "plugins" / "guided"
    assert bundle.with_extras("trtserver-guided", guided).startswith("trtserver-guided[")
    assert "xgrammar" in bundle.with_extras("trtserver-guided", guided) and "test" not in bundle.with_extras(
        "trtserver-guided", guided)
    assert bundle.with_extras("trtserver", ROOT) == "trtserver"  # its dev tools stay home
    with pytest.raises(BundleError, match="no such plugin"):
        local_projects(ROOT, ["nope"])
    with pytest.raises(BundleError, match="not a trtserver checkout"):
        local_projects(tmp_path, None)


def test_part_sizes() -> None:
    assert parse_size("2G") == 2 << 30 and parse_size("500M") == 500 << 20 and parse_size("1MiB") == 1 << 20
    for bad in ("2T", "", "12k"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_an_invalid_engine_dir_leaves_the_last_bundle_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "keep").write_text("old")
    with pytest.raises(BundleError, match="not an engine directory"):
        bundle.write_bundle(out, python_version="3.10", platform="linux-aarch64", engine_dir=tmp_path)
    assert (out / "keep").read_text() == "old" and not (tmp_path / "bundle.partial").exists()


def toy_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel, written by hand: package ``bundletoy`` 1.0."""
    files = {"bundletoy/__init__.py": b"ANSWER = 42\n",
             "bundletoy-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: bundletoy\nVersion: 1.0\n",
             "bundletoy-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              b"Tag: py3-none-any\n"}
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("bundletoy-1.0.dist-info/RECORD,,")
    path = folder / "bundletoy-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("bundletoy-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return path


def lay_out(root: Path, payload: bytes) -> None:
    """A bundle as write_bundle lays it out: wheels, a large file, requirements, sums, install.sh."""
    (root / "wheels").mkdir(parents=True)
    toy_wheel(root / "wheels")
    (root / "data").mkdir()
    (root / "data" / "large.bin").write_bytes(payload)
    (root / "requirements.txt").write_text("bundletoy==1.0\n")
    (root / "install.sh").write_text(bundle.INSTALL_SH)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    (root / "SHA256SUMS").write_text("".join(f"{bundle.sha256(p)}  {p.relative_to(root)}\n" for p in files))


def install(root: Path, venv: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env.update(VENV=str(venv), PYTHON=sys.executable, PIP_NO_INDEX="1")
    return subprocess.run(["bash", str(root / "install.sh")], env=env, capture_output=True, text=True, timeout=240)


def test_install_sh_joins_parts_checks_them_and_installs_with_no_index(tmp_path: Path) -> None:
    root = tmp_path / "bundle"
    payload = os.urandom(3 * bundle.MIB + 17)
    lay_out(root, payload)
    assert bundle.split_large_files(root, bundle.MIB) == [root / "data" / "large.bin"]
    parts = sorted(p.name for p in (root / "data").iterdir())
    assert parts == [f"large.bin.part00{i}" for i in range(4)]
    assert (root / "data" / "large.bin.part000").stat().st_size == bundle.MIB

    done = install(root, tmp_path / "venv")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (root / "data" / "large.bin").read_bytes() == payload
    assert not list((root / "data").glob("*.part*"))
    python = str(tmp_path / "venv" / "bin" / "python")
    answer = subprocess.run([python, "-c", "import bundletoy; print(bundletoy.ANSWER)"], capture_output=True,
                            text=True, timeout=60)
    assert answer.stdout.strip() == "42"


def test_install_sh_refuses_a_damaged_part(tmp_path: Path) -> None:
    root = tmp_path / "bundle"
    lay_out(root, os.urandom(2 * bundle.MIB + 5))
    bundle.split_large_files(root, bundle.MIB)
    part = root / "data" / "large.bin.part001"
    data = part.read_bytes()
    part.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    done = install(root, tmp_path / "venv")
    assert done.returncode == 1 and "missing or damaged" in done.stderr
    assert not (tmp_path / "venv").exists()


def test_a_version_with_no_wheel_for_the_target_gives_way_to_the_newest_that_has_one(tmp_path: Path) -> None:
    # what PyPI holds for the target, as pip download would find it: numpy 2.4 dropped Python 3.10
    available = {"numpy": {"2.2.6"}, "msgspec": {"0.19.0"}}
    asked: list[list[str]] = []

    def fetch(requirements: list[str]) -> bool:
        asked.append(requirements)
        for req in requirements:
            name, _, version = req.partition("==")
            if name not in available or (version and version not in available[name]):
                return False
        return True

    pins = [Pin("msgspec", "0.19.0"), Pin("numpy", "2.4.6")]
    assert bundle.download(pins, "3.10", "linux-aarch64", tmp_path, fetch=fetch) == ["numpy"]
    assert asked[-1] == ["numpy"]
    with pytest.raises(BundleError, match="no wheel for Python 3.10 on linux-aarch64: absent==1.0"):
        bundle.download([*pins, Pin("absent", "1.0")], "3.10", "linux-aarch64", tmp_path, fetch=fetch)


def test_write_bundle_lays_out_wheels_engine_dir_sums_and_parts(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tmp_path / "tiny-engine"
    engine.mkdir()
    (engine / "trtserver.json").write_text("{}")
    weights = os.urandom(2 * bundle.MIB + 3)
    (engine / "model.safetensors").write_bytes(weights)
    fetched: list[list[str]] = []

    def no_network(pins: list[Pin], python_version: str, platform: str, dest: Path) -> list[str]:
        fetched.append([str(p) for p in pins])  # PyPI stands outside the test: what would be asked for
        return ["numpy"]

    monkeypatch.setattr(bundle, "download", no_network)
    out = tmp_path / "bundle"
    info = bundle.write_bundle(out, python_version="3.10", platform="linux-aarch64", plugins=[], engine_dir=engine,
                               part_size=bundle.MIB)
    assert [w.name.split("-")[0] for w in (out / "wheels").glob("*.whl")] == ["trtserver"]
    assert any(p.startswith("msgspec==") for p in fetched[0]) and "numpy" in info.packages
    requirements = (out / "requirements.txt").read_text().split()
    assert "numpy" in requirements and requirements[-1] == "trtserver"
    assert info.split == ["engines/tiny-engine/model.safetensors"] and info.bytes > len(weights)
    assert sorted(p.name for p in (out / "engines" / "tiny-engine").iterdir()) == [
        "model.safetensors.part000", "model.safetensors.part001", "model.safetensors.part002", "trtserver.json"]
    sums = (out / "SHA256SUMS").read_text()
    assert f"{hashlib.sha256(weights).hexdigest()}  engines/tiny-engine/model.safetensors" in sums
    assert "  install.sh" in sums and "  wheels/trtserver-" in sums
    assert not (tmp_path / "bundle.partial").exists() and not (ROOT / "build").exists()
