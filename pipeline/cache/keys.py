"""Stage keys: what decides a stage's result, hashed (no torch import; see ``pipeline.cache``)."""

import ast
import hashlib
import json
from functools import cache
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

SRC = Path(__file__).resolve().parent.parent  # the pipeline package
FORMAT = 2  # of entries; a change of how entries are written changes every key
TOOLS = ("torch", "executorch", "triton")


# --- keys ---

def _module_file(module: str) -> Path | None:
    rel = Path(*module.split("."))
    for candidate in (SRC.parent / rel.with_suffix(".py"), SRC.parent / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def _imports(path: Path) -> tuple[set[str], bool]:
    """The ``pipeline`` modules ``path`` imports anywhere (function bodies too), and whether it
    loads modules by name (``importlib.import_module``)."""
    tree = ast.parse(path.read_text(), str(path))
    found, dynamic = set(), False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "pipeline"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pipeline" and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # a submodule, when it is one
        elif isinstance(node, ast.Attribute) and node.attr == "import_module":
            dynamic = True
    return found, dynamic


def code_files(module: str, names: frozenset[str] = frozenset()) -> dict[str, str]:
    """sha256 of every file of the package ``module`` runs: its imports followed transitively, each
    module's parent packages (whose own imports are followed too), and for a module that loads others
    by name (a registry: ``backend(cfg.backend.name)``, ``layout_<cfg.kv.layout>``) the modules beside
    it that ``names`` (the string values of the stage's config) name, or all of them when it names
    none. A package reached only as a parent does not count its by-name loads: the stage never calls them."""
    todo: list[tuple[str, bool]] = [(module, True)]
    files: dict[str, Path] = {}
    expanded: set[str] = set()
    while todo:
        name, explicit = todo.pop()
        path = _module_file(name)
        if path is None or (name in files and (not explicit or name in expanded)):
            continue
        found, dynamic = _imports(path)
        if name not in files:
            files[name] = path
            parts = name.split(".")
            todo += [(".".join(parts[:i]), False) for i in range(1, len(parts))]
            todo += [(m, True) for m in sorted(found)]
        if explicit:
            expanded.add(name)
            if dynamic:
                package = ".".join(path.parent.relative_to(SRC.parent).parts)
                siblings = [p.stem for p in sorted(path.parent.glob("*.py")) if p.stem != "__init__"]
                named = [m for m in siblings if m in names or any(m.endswith(f"_{n}") for n in names)]
                todo += [(f"{package}.{m}", True) for m in named or siblings]
    return {p.relative_to(SRC.parent).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()[:16]
            for p in sorted(set(files.values()))}


@cache
def tool_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in TOOLS:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


@cache
def _content_hash(path: str, stamp: tuple) -> str:
    from pipeline.models.loaders import content_hash

    return content_hash(path)


def _checkpoints(section: dict, name: str) -> dict:
    """Content hashes of the checkpoint a config section names (its ``checkpoint``), hashed once per
    process for the same files, sizes and modification times."""
    if not section.get("checkpoint"):
        return {}
    path = Path(section["checkpoint"]).resolve()
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())
    return {f"{name}.checkpoint": _content_hash(str(path), stamp)}


def digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def stage_keys(cfg: DictConfig, plan: list) -> dict[str, dict]:
    """Each planned stage's key parts and ``digest`` (see the module's doc), in plan order."""
    producers: dict[str, str] = {}
    keys: dict[str, dict] = {}
    for stage in plan:
        sections = {s: OmegaConf.to_container(cfg[s], resolve=True) for s in stage.sections}
        files = {}
        for name, section in sections.items():
            files |= _checkpoints(section, name)
        upstream = sorted({producers[a] for a in (*stage.needs, *stage.optional) if a in producers})
        parts = {"stage": stage.name, "format": FORMAT, "config": sections,
                 "inputs": {s: keys[s]["digest"] for s in upstream}, "files": files,
                 "tools": tool_versions(), "code": code_files(f"pipeline.stages.{stage.name}", _strings(sections))}
        keys[stage.name] = {"digest": digest(parts), "parts": parts}
        producers |= {a: stage.name for a in stage.gives}
    return keys


def _strings(sections: dict) -> frozenset[str]:
    return frozenset(v for v in _flatten(sections).values() if isinstance(v, str))


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out |= _flatten(v, f"{prefix}{k}.")
        return out
    return {prefix.rstrip("."): value}


def changes(old: dict, new: dict) -> list[str]:
    """What differs between two stages' key parts, in words: ``kv.max_seqs 1 -> 8``, ``the result
    of export``, ``code pipeline/kv/op.py``, ``torch 2.11.0 -> 2.13.0``, ``model.checkpoint's content``."""
    said = []
    a, b = _flatten(old.get("config", {})), _flatten(new.get("config", {}))
    said += [f"{k} {a.get(k, '(unset)')} -> {b.get(k, '(unset)')}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    said += [f"the result of {s}" for s in sorted(new["inputs"]) if old.get("inputs", {}).get(s) != new["inputs"][s]]
    said += [f"{k}'s content" for k in sorted(new["files"]) if old.get("files", {}).get(k) != new["files"][k]]
    said += [f"{t} {old.get('tools', {}).get(t)} -> {v}" for t, v in new["tools"].items() if old.get("tools", {}).get(t) != v]
    code_old, code_new = old.get("code", {}), new["code"]
    said += [f"code {f}" for f in sorted(code_old.keys() | code_new.keys()) if code_old.get(f) != code_new.get(f)]
    if old.get("format") != new["format"]:
        said.append(f"the cache format {old.get('format')} -> {new['format']}")
    return said
