"""Prove that a refactor keeps the artifacts byte-identical: build a fixed set of configs with two
revisions side by side and compare what they wrote.

    python bench/byte_identity.py --base e06a1ce [--head WORKTREE_OR_REV] [--only NAME ...] [--out DIR]
                                  [--reuse] [--self-test] [--docs PATH]

The base (a git revision) is exported with ``git archive REV | tar -x`` into ``<out>/base-<sha>/src``;
the head is this working tree by default (uncommitted changes included), a directory holding a
checkout (``pipeline/`` and ``conf/``), or a git revision (exported like the base). Each config is
built in each checkout with ``python -m pipeline <overrides> stages=[export_vision,export,lower_kv,compile]``
(compile writes model.pte, any .ptd and manifest.json; validate only adds validation.json), cwd and
PYTHONPATH set to the checkout, so that its own ``pipeline`` package and ``conf/`` are used and not
the editable install; every build prints where ``pipeline`` was imported from and the script stops if
that is not the checkout. Every build starts from an empty stage cache of its own
(``<out>/<side>/cache/<config>``), so no stage result crosses revisions or configs.

Compared per config: the sha256 of model.pte and of every .ptd, manifest.json as parsed JSON (key
order ignored; the differing paths are listed), and the other files of the version (the vision
encoder's image_processor/); build.json, validation.json and .hydra/ are records of the build
(timings, paths, git revision) and are not compared. The table goes to stdout and to
docs/byte_identity.md; the exit status is 1 if anything differs or a build failed.

--reuse keeps a side's existing outputs for a config when they were built from the same source
(a revision's sha, or a hash of a directory's pipeline/, conf/ and pyproject.toml), so the base is built
once and the head rebuilt many times. --self-test checks the check: it compares the base's outputs
with a perturbed copy of them (a manifest value changed, a key added and one removed; one byte of a
model.pte flipped; one config's outputs replaced by another config's) and exits 0 only if exactly
the perturbed configs are reported as different (it writes <out>/self_test.md, not the docs).
"""

import argparse
import datetime
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from _identity import artifact_files, compare, diffs_text, perturb, table

REPO = Path(__file__).resolve().parent.parent
STAGES = "stages=[export_vision,export,lower_kv,compile]"
CONFIGS = {
    "default": [],
    "seq8": ["kv=sequence", "kv.max_seqs=8"],
    "cell4": ["kv=cell", "kv.max_seqs=4"],
    "draft_vision": ["draft=dflash", "vision=smolvlm_tiny", "kv.max_seqs=4"],
    "muse": ["model=muse_glimmer_tiny", "draft=dflash_muse_glimmer_tiny", "vision=muse_glimmer_tiny", "kv.max_seqs=4"],
    "int8": ["model=tiny", "quant=int8"],
}
# Files of a version that record the build rather than make the artifact.
MARK = "byte_identity:"
# Runs `python -m pipeline` (runpy, as -m does) after saying where `pipeline` comes from; at exit, it
# names any pipeline module that was loaded from somewhere else.
LAUNCHER = f"""
import atexit, os, runpy, sys
import pipeline
home = os.path.dirname(os.path.abspath(pipeline.__file__))
print({MARK!r}, "pipeline imported from", pipeline.__file__, flush=True)
def _where():
    foreign = sorted(n for n, m in list(sys.modules.items()) if (n == "pipeline" or n.startswith("pipeline."))
                     and getattr(m, "__file__", None) and not os.path.abspath(m.__file__).startswith(home + os.sep))
    print({MARK!r}, "foreign pipeline modules:", ",".join(foreign) or "none", flush=True)
atexit.register(_where)
runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
"""


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def source_fingerprint(src: Path) -> str:
    """A hash of what decides a build: the checkout's pipeline/, conf/ and pyproject.toml."""
    digest = hashlib.sha256()
    files = [p for d in ("pipeline", "conf") for p in sorted((src / d).rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    if (src / "pyproject.toml").is_file():
        files.append(src / "pyproject.toml")
    for p in files:
        digest.update(p.relative_to(src).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return digest.hexdigest()


class Side:
    """One revision to build: its checkout and where its outputs, caches and logs go."""

    def __init__(self, role: str, spec: str | None, out: Path):
        self.role = role
        if spec is None or Path(spec).is_dir():
            self.src = (Path(spec) if spec else REPO).resolve()
            if not (self.src / "pipeline" / "__main__.py").is_file() or not (self.src / "conf").is_dir():
                raise SystemExit(f"error: {self.src} is not a checkout of this project (no pipeline/__main__.py or conf/)")
            self.sha = None
            self.label = f"{role}-worktree" if self.src == REPO else f"{role}-dir-{self.src.name}"
            try:
                head = git("rev-parse", "HEAD", cwd=self.src)
                dirty = git("status", "--porcelain", "--", "pipeline", "conf", "pyproject.toml", cwd=self.src).splitlines()
                self.describe = (f"working tree {self.src} (HEAD {head[:12]} {git('log', '-1', '--format=%s', head, cwd=self.src)!r}"
                                 f"{f', plus {len(dirty)} uncommitted change(s) under pipeline/, conf/, pyproject.toml' if dirty else ', clean'})")
            except (OSError, subprocess.CalledProcessError):
                self.describe = f"directory {self.src} (not a git checkout)"
            self.fingerprint = "tree:" + source_fingerprint(self.src)
        else:
            try:
                self.sha = git("rev-parse", "--verify", f"{spec}^{{commit}}")
            except subprocess.CalledProcessError:
                raise SystemExit(f"error: --{role} {spec} is neither a directory nor a git revision of {REPO}") from None
            self.label = f"{role}-{self.sha[:12]}"
            self.src = out / self.label / "src"
            self.describe = f"{self.sha[:12]} {git('log', '-1', '--format=%s', self.sha)!r}"
            self.fingerprint = "commit:" + self.sha
        self.dir = out / self.label

    def prepare(self) -> None:
        """Export the revision (once: a marker file records a complete export)."""
        if self.sha is None:
            return
        marker = self.src / ".byte_identity_export"
        if marker.is_file() and marker.read_text().strip() == self.sha:
            return
        if self.src.exists():
            shutil.rmtree(self.src)
        self.src.mkdir(parents=True)
        print(f"exporting {self.sha[:12]} into {self.src} (git archive | tar -x)", flush=True)
        archive = subprocess.Popen(["git", "-C", str(REPO), "archive", self.sha], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(self.src)], stdin=archive.stdout, check=True)
        archive.stdout.close()
        if archive.wait() != 0:
            raise SystemExit(f"error: git archive {self.sha} failed")
        marker.write_text(self.sha + "\n")


def version_dir(exp: Path) -> Path | None:
    found = sorted(p for p in exp.glob("v[0-9]*") if p.is_dir()) if exp.is_dir() else []
    return found[-1] if found else None


def build(side: Side, name: str, overrides: list[str], reuse: bool, step: str) -> dict:
    """Build one config with one side's code (or reuse its earlier build); the build's record."""
    exp, cache = side.dir / "outputs" / name, side.dir / "cache" / name
    record_path = side.dir / "builds" / f"{name}.json"
    head = f"{step} {side.role} {side.label.split('-', 1)[1]} {name}"
    if reuse and record_path.is_file():
        record = json.loads(record_path.read_text())
        vdir = Path(record.get("version", "/nonexistent"))
        if (record.get("ok") and record.get("fingerprint") == side.fingerprint and record.get("overrides") == overrides
                and (vdir / "model.pte").is_file() and (vdir / "manifest.json").is_file()):
            record["files"] = artifact_files(vdir)
            print(f"{head}: reusing {vdir} (built in {record['seconds']:.1f} s on {record['built']})", flush=True)
            return record | {"reused": True}
        print(f"{head}: not reusable (no complete earlier build from this source), building", flush=True)
    for stale in (exp, cache):
        if stale.exists():
            shutil.rmtree(stale)
    logs = side.dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name}.log"
    args = [*overrides, STAGES, f"output_root={side.dir / 'outputs'}", f"experiment_name={name}", f"cache_dir={cache}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(side.src), *filter(None, [os.environ.get("PYTHONPATH")])])}
    print(f"{head}: building in {side.src}\n    python -m pipeline {shlex.join(args)}", flush=True)
    start = time.perf_counter()
    imported, foreign = None, None
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, *args], cwd=side.src, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1)
        for line in proc.stdout:
            log.write(line)
            if line.startswith(MARK):
                said = line[len(MARK):].strip()
                if said.startswith("pipeline imported from"):
                    imported = Path(said.removeprefix("pipeline imported from").strip())
                    if not imported.resolve().is_relative_to(side.src.resolve()):
                        proc.kill()
                        raise SystemExit(f"error: the {side.role} build imported pipeline from {imported}, not from {side.src}")
                elif said.startswith("foreign pipeline modules:"):
                    foreign = said.removeprefix("foreign pipeline modules:").strip()
            print(f"    | {line.rstrip()}", flush=True)
        rc = proc.wait()
    seconds = time.perf_counter() - start
    if foreign not in (None, "none"):
        raise SystemExit(f"error: the {side.role} build loaded pipeline modules from outside {side.src}: {foreign}")
    vdir = version_dir(exp)
    ok = rc == 0 and vdir is not None and (vdir / "model.pte").is_file() and (vdir / "manifest.json").is_file()
    record = {"config": name, "overrides": overrides, "ok": ok, "returncode": rc, "seconds": round(seconds, 1),
              "built": datetime.datetime.now().isoformat(timespec="seconds"), "version": str(vdir) if vdir else None,
              "pipeline_file": str(imported), "fingerprint": side.fingerprint, "source": side.describe,
              "command": ["python", "-m", "pipeline", *args], "log": str(log_path)}
    record_path.parent.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{head}: {'built' if ok else f'FAILED (exit {rc}; log {log_path})'} in {seconds:.1f} s"
          f"{f' -> {vdir}' if ok else ''} (pipeline from {imported})", flush=True)
    if ok:
        record["files"] = artifact_files(vdir)
    return record


def tools() -> str:
    found = []
    for name in ("torch", "executorch", "torchao", "hydra-core"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} not installed")
    return f"Python {platform.python_version()}, " + ", ".join(found)


def report(rows: list[dict], base: Side, head_desc: str, argv: list[str], title: str) -> str:
    same = all(r["identical"] for r in rows)
    diffs = diffs_text(rows)
    return "\n".join([
        f"# {title}", "",
        "Written by `bench/byte_identity.py` (its docstring says what is built and compared); rerun it to refresh.", "",
        f"- command: `python bench/byte_identity.py {shlex.join(argv)}`",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- base: {base.describe}",
        f"- head: {head_desc}",
        f"- tools: {tools()} (the same interpreter and packages for both sides)",
        f"- builds: `python -m pipeline <overrides> {STAGES}`, each in its checkout (cwd and PYTHONPATH), "
        "each from an empty stage cache of its own",
        f"- result: **{'identical' if same else 'DIFFERENT'}** ({sum(r['identical'] for r in rows)} of {len(rows)} configs identical)", "",
        table(rows), "",
        *(["## Differences", "", "```", diffs, "```", ""] if diffs else []),
    ])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="configs: " + "; ".join(f"{n}: {' '.join(o) or '(none)'}" for n, o in CONFIGS.items()))
    parser.add_argument("--base", required=True, help="git revision of the base (e.g. e06a1ce)")
    parser.add_argument("--head", help="a checkout directory or a git revision (default: this working tree)")
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), metavar="NAME", help="these configs only")
    parser.add_argument("--out", type=Path, default=Path("/tmp/byte_identity"), help="checkouts, outputs, caches, logs")
    parser.add_argument("--reuse", action="store_true", help="keep a side's outputs built earlier from the same source")
    parser.add_argument("--self-test", action="store_true", help="compare the base with a perturbed copy of itself")
    parser.add_argument("--docs", type=Path, default=REPO / "docs" / "byte_identity.md", help="where the report goes")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(CONFIGS)
    base = Side("base", args.base, out)
    head = None if args.self_test else Side("head", args.head, out)
    print(f"base: {base.describe}\n      -> {base.dir}")
    if head:
        print(f"head: {head.describe}\n      -> {head.dir}")
    print(f"configs: {', '.join(names)}; {tools()}", flush=True)
    for side in filter(None, (base, head)):
        side.prepare()
    steps = len(names) * (1 if head is None else 2)
    base_records, head_records, n = {}, {}, 0
    for name in names:  # per config base then head: a failure shows early
        n += 1
        base_records[name] = build(base, name, CONFIGS[name], args.reuse, f"[{n}/{steps}]")
        if head:
            n += 1
            head_records[name] = build(head, name, CONFIGS[name], args.reuse, f"[{n}/{steps}]")
    if args.self_test:
        head_records, done = perturb(base_records, out)
        head_desc = f"the base's own outputs, copied to {out / 'self-test'} and perturbed: " + "; ".join(
            f"{k}: {v}" for k, v in done.items())
    else:
        head_desc = head.describe
    rows = [compare(base_records[n], head_records.get(n, base_records[n] | {"ok": False, "returncode": None, "log": "-"}))
            for n in names]
    status = 0 if all(r["identical"] for r in rows) else 1
    print()
    print(table(rows))
    if diffs := diffs_text(rows):
        print("\ndifferences:\n" + diffs)
    if args.self_test:
        doc = out / "self_test.md"
        doc.write_text(report(rows, base, head_desc, argv, "Byte identity: self-test (perturbed copies)") + "\n")
        caught = {r["config"] for r in rows if not r["identical"]}
        expected = set(done)
        print(f"\nwrote {doc}\nself-test: the comparison's exit status is {status} (expected {1 if expected else 0}); "
              f"configs reported different: {sorted(caught) or 'none'}; perturbed: {sorted(expected) or 'none'}")
        ok = caught == expected and status == (1 if expected else 0)
        print(f"self-test {'PASSED' if ok else 'FAILED'}")
        return 0 if ok else 2
    args.docs.parent.mkdir(parents=True, exist_ok=True)
    args.docs.write_text(report(rows, base, head_desc, argv, "Byte identity of the artifacts across a refactor") + "\n")
    print(f"\nwrote {args.docs}\n{'IDENTICAL' if status == 0 else 'DIFFERENT'}: {sum(r['identical'] for r in rows)} of "
          f"{len(rows)} configs byte-identical")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
