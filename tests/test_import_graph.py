"""The package's import graph: no two modules import each other.

Every import counts, at any depth (a lazy import inside a function too), except those under
``if TYPE_CHECKING:``, which never run. A package's ``__init__`` importing its own
submodules (to re-export them) is not a cycle with them. What stays is type-only:
``mcore.recompute`` and ``validation`` annotate with `LoRAContext` and `JobConfig` from modules
that import them.
"""

import ast
from pathlib import Path

import megatron_lorafusion

PACKAGE = Path(megatron_lorafusion.__file__).parent


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module name imported in ``tree`` (``from m import x``: ``m.x`` and ``m``)."""
    names: set[str] = set()
    pending = list(ast.iter_child_nodes(tree))
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                anchor = module.split(".")[: None if is_package else -1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        pending.extend(ast.iter_child_nodes(node))
    return names


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (its own submodules left out for a package)."""
    files = _module_files()
    graph = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        names = _imported_names(ast.parse(path.read_text(encoding="utf-8")), module, is_package)
        graph[module] = {
            n
            for n in names
            if n in files and n != module and not (is_package and n.startswith(module + "."))
        }
    return graph


def test_import_graph_sees_lazy_imports_and_skips_type_checking():
    """The scan reads function-level imports and leaves ``if TYPE_CHECKING:`` blocks out."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from megatron_lorafusion.a import X\n"
        "def f():\n    from . import b\n    import megatron_lorafusion.c\n"
    )
    names = _imported_names(tree, "megatron_lorafusion.pkg.m", is_package=False)
    assert {"megatron_lorafusion.pkg.b", "megatron_lorafusion.c"} <= names
    assert "megatron_lorafusion.a" not in names


def test_no_two_modules_import_each_other():
    """Each dependency between two modules of the package goes one way."""
    graph = _import_graph()
    mutual = sorted(
        f"{a} <-> {b}" for a, targets in graph.items() for b in targets if a < b and a in graph[b]
    )
    assert not mutual, "modules that import each other:\n" + "\n".join(mutual)
