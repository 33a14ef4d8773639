"""The package's architecture rules, checked from its source (no import of it):

- no import cycle among ``pipeline``'s modules, counting every import (a function's too, relative ones
  too; a package's ``__init__`` is a module like any other, reached only when named);
- stages never import other stages, backends never import stages;
- role names (``target``, ``draft``, ``vision``) appear as strings only where roles are defined
  (``build/roles/``) and where the manifest is read and written (``build/manifest.py``);
- no presence test of a model against its group's ``none`` option (``cfg.draft.name != "none"``):
  a model is present by being in the plan's table (``Role.present`` is the one place);
- KV layouts are built from the config at one call site (``build_layout`` in ``build/plan.py``).

``python tools/check_architecture.py [PACKAGE_DIR]`` prints every violation and exits 1 if any.
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROLE_NAMES = ("target", "draft", "vision")
ROLE_MODULES = ("pipeline.build.roles", "pipeline.build.manifest")  # the roles package (each role's module) and the manifest
LAYOUT_BUILDER = ("build_layout", "pipeline.build.plan")


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def modules(package_dir: Path) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__``)."""
    base = package_dir.parent
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def imports(known: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its file."""
    graph = {}
    for module, path in known.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, path, node)
                names = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in known:  # ``import a.b.c`` of a non-module attribute: its module
                    name = name.rpartition(".")[0]
                if name and name != module:
                    found.add(name)
        graph[module] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _layer(module: str, package: str) -> str:
    rest = module.removeprefix(package + ".")
    return rest.split(".")[0] if rest != module else ""


def layering(graph: dict[str, set[str]], package: str) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        layer = _layer(module, package)
        for target in sorted(targets):
            if _layer(target, package) == "stages" and target != f"{package}.stages":
                if layer == "stages" and module != f"{package}.stages":
                    found.append(f"{module} imports the stage {target}: stages never import one another")
                elif layer == "backends":
                    found.append(f"{module} imports the stage {target}: backends never import stages")
    return found


def role_literals(known: dict[str, Path]) -> list[str]:
    found = []
    for module, path in known.items():
        if module in ROLE_MODULES or module.startswith(ROLE_MODULES[0] + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in ROLE_NAMES:
                found.append(f"{_where(path)}:{node.lineno}: the role name {node.value!r} outside the role "
                             "table and the manifest (use pipeline.build.roles' constants or the plan's parts)")
    return found


def none_tests(known: dict[str, Path]) -> list[str]:
    """``<x>.name == / != "none"``: a model's presence decided from its config group's option."""
    found = []
    for module, path in known.items():
        if module == ROLE_MODULES[0] or module.startswith(ROLE_MODULES[0] + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "name"
                    and any(isinstance(c, ast.Constant) and c.value == "none" for c in node.comparators)):
                found.append(f"{_where(path)}:{node.lineno}: a presence test against 'none' (a model is "
                             "present by being in the plan's parts)")
    return found


def layout_builders(known: dict[str, Path]) -> list[str]:
    name, home = LAYOUT_BUILDER
    calls = []
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name:
                calls.append((module, f"{_where(path)}:{node.lineno}"))
    return [f"{where}: {name} called outside {home} (layouts are built from the config once, by the plan)"
            for module, where in calls if module != home] + (
        [] if len(calls) == 1 else [f"{name} is called at {len(calls)} sites ({', '.join(w for _, w in calls)}); one is allowed"])


def check(package_dir: Path = ROOT / "pipeline") -> list[str]:
    known = modules(package_dir)
    graph = imports(known)
    found = [f"import cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    found += layering(graph, package_dir.name)
    found += role_literals(known) + none_tests(known) + layout_builders(known)
    return found


def main(argv: list[str]) -> int:
    package = Path(argv[0]).resolve() if argv else ROOT / "pipeline"
    found = check(package)
    for line in found:
        print(line)
    print(f"{package.name}: {len(modules(package))} modules, {len(found)} violation{'s' * (len(found) != 1)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
