"""jaxcomm's modules import each other without cycles: each layer (op tables, checks,
primitives, op families, dispatch, JaxComm) builds only on the ones below it.
Read from the source, so nothing is imported (importing jaxcomm starts MPI)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "jaxcomm"


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The jaxcomm modules that module `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "jaxcomm":
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxcomm."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("jaxcomm.")}
    return found


def files_of(name: str) -> list[Path]:
    """Module `name`'s source: its file, or every file of the subpackage `name`."""
    folder = PACKAGE / name
    return sorted(folder.glob("*.py")) if folder.is_dir() else [PACKAGE / f"{name}.py"]


def test_no_module_imports_itself_through_others():
    modules = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    modules |= {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    # A subpackage counts as one module: its files' imports of each other are its own.
    graph = {
        name: set().union(*(imports_of(path, modules) for path in files_of(name))) - {name}
        for name in modules
    }
    assert graph["comm"] >= {"_dispatch", "_requests"}  # the scan sees imports
    assert graph["_jax_internals"] >= {"_lockstep"}  # and a subpackage's

    def cycle_from(name: str, path: list[str]) -> list[str] | None:
        for dependency in sorted(graph[name]):
            if dependency in path:
                return [*path[path.index(dependency) :], dependency]
            found = cycle_from(dependency, [*path, dependency])
            if found:
                return found
        return None

    for name in sorted(modules):
        assert cycle_from(name, [name]) is None, " -> ".join(cycle_from(name, [name]))
