"""The layers, kept by their imports: aiohttp only in ``http/`` (and ``testing.py``), torch only in
``engine/torch/`` at module level, neither in the wire protocol, the text layer or ``serving/``; the
torch engine's model blind to what runs it faster; and no import circles: none at run time, and none
at module level even counting the imports under ``if TYPE_CHECKING:`` (types belong to the module
that owns them, which imports neither way back)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "trtserver"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, *, module_level: bool, type_only: bool = False) -> set[str]:
    """Modules ``path`` imports at run time (``module_level``: only those run when it is imported;
    ``type_only``: those under ``if TYPE_CHECKING:`` too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            skip_body = _is_type_checking(node) and not type_only
            for child in node.orelse if skip_body else [*node.body, *node.orelse]:
                self.visit(child)

        def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
            if not module_level:
                self.generic_visit(node)

        visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

        def visit_Import(self, node: ast.Import) -> None:
            found.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)

    Visitor().visit(ast.parse(path.read_text()))
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def _inside(path: Path, *folders: str) -> bool:
    rel = path.relative_to(PACKAGE).as_posix()
    return any(rel == folder or rel.startswith(folder.rstrip("/") + "/") for folder in folders)


def _uses(found: set[str], top: str) -> bool:
    return any(name == top or name.startswith(top + ".") for name in found)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_aiohttp_only_in_the_http_package(path: Path) -> None:
    if _inside(path, "http/", "testing.py"):
        return
    assert not _uses(imports(path, module_level=False), "aiohttp"), "aiohttp is imported outside trtserver/http/"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_torch_at_module_level_only_in_the_torch_engine(path: Path) -> None:
    if _inside(path, "engine/torch/"):
        return
    assert not _uses(imports(path, module_level=True), "torch"), "torch is imported at module level"


@pytest.mark.parametrize("path", [p for p in SOURCES if _inside(p, "protocol.py", "text.py", "serving/")],
                         ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_protocol_text_and_serving_import_neither(path: Path) -> None:
    found = imports(path, module_level=False)
    for top in ("torch", "aiohttp", "tensorrt_llm"):
        assert not _uses(found, top), f"{top} is imported"


def test_the_torch_model_imports_none_of_its_accelerations() -> None:
    """``model.py`` is the one eager definition: the model runner, the CPU package, CUDA graphs and LoRA
    wrap it from outside."""
    found = imports(PACKAGE / "engine" / "torch" / "model.py", module_level=False)
    for name in ("model_runner", "core", "cpu", "graphs", "lora", "attention"):
        assert not _uses(found, f"trtserver.engine.torch.{name}"), f"model.py imports engine/torch/{name}"


def import_graph(*, module_level: bool, type_only: bool = False) -> dict[str, set[str]]:
    names = {module_name(p): p for p in SOURCES}
    # a module's own parent packages run before it whatever it imports: those edges are not circles
    return {name: {dep for dep in imports(path, module_level=module_level, type_only=type_only)
                   if dep in names and dep != name and not name.startswith(dep + ".")}
            for name, path in names.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components: any component of two or more modules is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                connect(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_no_import_circles() -> None:
    assert not circles(import_graph(module_level=False))


def test_no_module_level_circles_counting_type_only_imports() -> None:
    """Not even types go round in a circle at module level."""
    assert not circles(import_graph(module_level=True, type_only=True))


def test_circles_are_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
