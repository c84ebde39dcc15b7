"""The source tree's shape, read with ast (nothing is imported): fast and pure Python.

A function-local import of another agentenv package hides a dependency (and any import loop
it closes) from a reader of the module's head. Each one must say why it is local, in a comment
on the line directly above it or on its own line: `# lazy: ...` (start-up time, e.g. `aenv
--help`), `# optional: ...` (a module a build may lack), `# cycle: ...` (who imports whom).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "agentenv"


def _module_parts(path: Path, root: Path) -> tuple[list[str], list[str]]:
    """(the module's dotted name, the package a relative import starts from), as parts."""
    parts = ["agentenv", *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
        return parts, parts
    return parts, parts[:-1]


def _targets(node: ast.Import | ast.ImportFrom, package: list[str]) -> list[str]:
    """The absolute names an import statement loads (modules, or names of a package)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = package[: len(package) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    if node.module is None or module == "agentenv":  # `from agentenv(.x) import y`: y is a module
        return [f"{module}.{alias.name}" for alias in node.names]
    return [module]


def _function_local_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import | ast.ImportFrom):
                found.append(child)
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(tree, False)
    return found


def hidden_imports(root: Path = SRC) -> list[str]:
    """`file:line: target` of every function-local import of another top-level agentenv
    package or module than the file's own, with no comment on the line above or its own."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        module, package = _module_parts(path, root)
        own = module[1] if len(module) > 1 else None
        text = path.read_text()
        lines = text.splitlines()
        for node in _function_local_imports(ast.parse(text, str(path))):
            others = [t for t in _targets(node, package)
                      if t.startswith("agentenv.") and t.split(".")[1] != own]
            if not others:
                continue
            above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
            if above.startswith("#") or "#" in lines[node.lineno - 1]:
                continue
            problems.append(f"{path.relative_to(root.parents[1])}:{node.lineno}: {others[0]}")
    return problems


def test_function_local_cross_package_imports_say_why() -> None:
    problems = hidden_imports()
    assert not problems, (
        "function-local imports of another agentenv package, without a comment saying why "
        "(move them to the module's head, or comment the line above: `# lazy: ...`, "
        "`# optional: ...`, `# cycle: ...`):\n" + "\n".join(problems))


def test_the_check_sees_what_it_looks_for(tmp_path: Path) -> None:
    """The walker itself: a hidden import is found, a commented or same-package one is not."""
    pkg = tmp_path / "src" / "agentenv" / "blockd"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text(
        "def f():\n"
        "    from agentenv.storage import blob\n"  # line 2: hidden
        "    from agentenv.blockd import y\n"  # own package: fine
        "    from . import z\n"  # own package, relative: fine
        "    # lazy: a reason\n"
        "    from agentenv import fsutil\n"  # commented above: fine
        "    import agentenv.logs  # optional: a reason\n"  # commented on its line: fine
        "    from .. import errors\n"  # line 8: relative, another module: hidden
        "    import agentenv.settings\n"  # line 9: hidden
        "from agentenv import storage\n"  # module level: fine
    )
    assert hidden_imports(tmp_path / "src" / "agentenv") == [
        "src/agentenv/blockd/x.py:2: agentenv.storage",
        "src/agentenv/blockd/x.py:8: agentenv.errors",
        "src/agentenv/blockd/x.py:9: agentenv.settings",
    ]
