"""The import graph of the project's packages is a DAG with the layers of
docs/architecture.md: the contract at the bottom, the `kvsidecar` CLI at the
top, product code never importing `bench`, and a control plane that does no
I/O. Every import counts, also one inside a function or under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONTROL = "sidecar.control"
# What each part may import of the project (itself always). `sidecar` is the
# daemon without its control plane, which is a part of its own.
ALLOWED = {
    "contract": set(),
    "shm": set(),
    "sideenv": set(),
    CONTROL: {"contract"},
    "cuda_ext": {"shm"},
    "sidecar": {"contract", "shm", CONTROL},
    "engine_shim": {"contract", "shm", "cuda_ext"},
    "cachesim": {"contract", CONTROL, "sideenv"},
    "router": {"contract", CONTROL},
    "bench": {
        "contract", "shm", CONTROL, "cuda_ext", "sidecar", "engine_shim", "cachesim", "router",
        "sideenv",
    },
    "kvsidecar": {
        "contract", "shm", CONTROL, "cuda_ext", "sidecar", "engine_shim", "cachesim", "router",
        "sideenv", "bench",
    },
}  # fmt: skip
PRODUCT = set(ALLOWED) - {"bench", "kvsidecar", "sideenv"}
# The control plane is pure: numpy and these parts of the standard library.
CONTROL_STDLIB = {
    "__future__", "abc", "bisect", "collections", "dataclasses", "enum", "functools", "heapq",
    "itertools", "math", "time", "typing",
}  # fmt: skip


def part_of(module: str) -> str | None:
    if module == CONTROL or module.startswith(CONTROL + "."):
        return CONTROL
    top = module.split(".")[0]
    return top if top in ALLOWED else None


def modules() -> Iterator[tuple[str, Path]]:
    for top in {name.split(".")[0] for name in ALLOWED}:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def imports_of(module: str, path: Path) -> Iterator[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            yield source
            # `from pkg import module` imports pkg.module
            yield from (f"{source}.{alias.name}" for alias in node.names)


def project_edges() -> dict[str, set[tuple[str, str]]]:
    """part -> {(importing module, imported module)} across parts."""
    edges: dict[str, set[tuple[str, str]]] = {part: set() for part in ALLOWED}
    for module, path in modules():
        source = part_of(module)
        assert source is not None
        for imported in imports_of(module, path):
            target = part_of(imported)
            if target is not None and target != source:
                edges[source].add((module, imported))
    return edges


def test_every_part_imports_only_the_parts_below_it():
    wrong = [
        f"{module} imports {imported}"
        for part, pairs in project_edges().items()
        for module, imported in sorted(pairs)
        if part_of(imported) not in ALLOWED[part]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_allowed_imports_form_a_dag():
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(part: str, path: tuple[str, ...]) -> None:
        if state.get(part) == "done":
            return
        assert state.get(part) != "open", f"import cycle: {' -> '.join((*path, part))}"
        state[part] = "open"
        for below in sorted(ALLOWED[part]):
            visit(below, (*path, part))
        state[part] = "done"
        order.append(part)

    for part in sorted(ALLOWED):
        visit(part, ())
    assert order[-1] == "kvsidecar" or "kvsidecar" not in {
        p for deps in ALLOWED.values() for p in deps
    }


def test_no_product_module_imports_bench_or_the_cli():
    for part in PRODUCT:
        assert "bench" not in ALLOWED[part] and "kvsidecar" not in ALLOWED[part], part
    assert all("kvsidecar" not in deps for part, deps in ALLOWED.items() if part != "kvsidecar")


def test_the_control_plane_does_no_io():
    """It imports numpy, a few pure parts of the standard library, the C heap
    and the contract's ids; nothing that reaches a file, socket or thread."""
    wrong = []
    for module, path in modules():
        if part_of(module) != CONTROL:
            continue
        for imported in imports_of(module, path):
            pure = (
                imported.split(".")[0] in (*CONTROL_STDLIB, "numpy")
                or part_of(imported) == CONTROL
                or imported == "contract"
                or imported.startswith(("contract.ids", "contract.ops"))
            )
            if not pure:
                wrong.append(f"{module} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_violation(tmp_path):
    """The walk over a file finds lazy and relative imports, so the tests above
    cannot pass by not looking."""
    path = tmp_path / "mod.py"
    path.write_text("def f():\n    from bench import report\n    from . import other\n")
    found = set(imports_of("sidecar.server.mod", path))
    assert {"bench", "bench.report", "sidecar.server", "sidecar.server.other"} <= found
