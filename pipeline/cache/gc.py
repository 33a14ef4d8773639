"""``python -m pipeline.cache gc|list``: the entries no version references, removed (see ``pipeline.cache``)."""

import argparse
import fcntl
import json
import shutil
from pathlib import Path

from pipeline.cache.store import Cache


def referenced(output_roots: list[Path]) -> set[tuple[str, str]]:
    """(stage, key) of every entry a version under ``output_roots`` was built from (its build.json)."""
    refs = set()
    for root in output_roots:
        for record_path in Path(root).rglob("build.json"):
            if ".cache" in record_path.parts or record_path.parent.name.startswith("."):
                continue  # the cache itself, builds in progress and failed ones
            try:
                record = json.loads(record_path.read_text())
            except (OSError, ValueError):
                continue
            refs |= {(stage, info["key"]) for stage, info in record.get("stage_entries", {}).items()}
    return refs


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def gc(cache_dir: Path, output_roots: list[Path], dry_run: bool = False) -> list[Path]:
    """Remove the entries no version under ``output_roots`` references, and debris of dead builds;
    refused while a build holds the cache (it may be about to publish a version of new entries)."""
    cache = Cache(cache_dir)
    if not cache.root.is_dir():
        print(f"{cache.root}: no cache there")
        return []
    with open(cache.root / ".builds.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"error: builds are running with the cache {cache.root}; run gc when they have finished") from None
        keep = referenced(output_roots)
        removed, freed = [], 0
        for entry in cache.entries():
            if (entry.path.parent.name, entry.key) in keep:
                continue
            freed += _bytes(entry.path)
            removed.append(entry.path)
            if not dry_run:
                shutil.rmtree(entry.path)
        for debris in cache.root.glob("*/.tmp-*"):
            removed.append(debris)
            if not dry_run:
                shutil.rmtree(debris, ignore_errors=True)
        kept = len(cache.entries()) if not dry_run else len(cache.entries()) - len(removed)
        verb = "would remove" if dry_run else "removed"
        print(f"{cache.root}: {verb} {len(removed)} entries ({freed / 1e6:.1f} MB) that no version under "
              f"{', '.join(map(str, output_roots))} references; {kept} kept")
        for path in removed:
            print(f"  {path.relative_to(cache.root)}")
    return removed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.cache",
        description="The stage cache of pipeline builds (pipeline/cache.py): list its entries, or remove those no version references.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("gc", "remove the entries no version under OUTPUT_ROOT references"), ("list", "list the entries")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("output_roots", nargs="*", default=["outputs"], metavar="OUTPUT_ROOT",
                       help="where the versions are (a build's output_root; default: outputs)")
        p.add_argument("--cache-dir", help="the cache (default: <first OUTPUT_ROOT>/.cache, a build's default cache_dir)")
        if name == "gc":
            p.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    args = parser.parse_args(argv)
    roots = [Path(r) for r in args.output_roots]
    cache_dir = Path(args.cache_dir) if args.cache_dir else roots[0] / ".cache"
    if args.command == "gc":
        gc(cache_dir, roots, args.dry_run)
        return
    keep = referenced(roots)
    for entry in Cache(cache_dir).entries():
        used = "referenced" if (entry.path.parent.name, entry.key) in keep else "unreferenced"
        print(f"{entry.path.parent.name:<14}{entry.key}  {_bytes(entry.path) / 1e6:9.2f} MB  "
              f"{entry.record.get('created', '?')}  built in {entry.record.get('seconds', 0):.1f} s  {used}")
