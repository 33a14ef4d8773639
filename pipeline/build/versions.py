"""A build's version directories: ``outputs/<experiment>/vNNNN/``.

A build works in ``<experiment>/.building-<id>/`` and becomes the next version only when every stage
succeeded (``publish``: a rename, never over an existing version), so a failed or interrupted build
never leaves a version that looks complete; a failed one is kept under ``.failed/`` to inspect, and
what a killed one left is removed by the next build (``remove_debris``).
"""

import fcntl
import hashlib
import json
import os
import platform
import shutil
import time
import uuid
from pathlib import Path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def versions(exp_dir: Path) -> list[tuple[Path, dict]]:
    """The versions of ``exp_dir`` with their build records, newest first."""
    found = []
    for version in sorted(exp_dir.glob("v[0-9]*"), reverse=True):
        try:
            found.append((version, json.loads((version / "build.json").read_text())))
        except (OSError, ValueError):
            continue
    return found


def existing(exp_dir: Path, keys: dict) -> Path | None:
    """The newest version built from exactly these stage entries whose files are still as recorded."""
    want = {name: key["digest"] for name, key in keys.items()}
    for version, record in versions(exp_dir):
        if {n: e["key"] for n, e in record.get("stage_entries", {}).items()} != want:
            continue
        damaged = [name for name, info in record["artifacts"].items()
                   if not (version / name).is_file() or sha256_file(version / name) != info["sha256"]]
        if not damaged:
            return version
        print(f"{version} was built from the same entries, but {', '.join(damaged)} no longer match its build.json; "
              "assembling a new version")
    return None


def publish(work: Path, exp_dir: Path) -> Path:
    """Rename the finished work dir to the next free version; never overwrite one."""
    while True:
        numbers = [int(p.name[1:]) for p in exp_dir.glob("v[0-9]*") if p.name[1:].isdigit()]
        target = exp_dir / f"v{max(numbers, default=0) + 1:04d}"
        try:
            os.rename(work, target)  # fails if target exists: another build took the number
            return target
        except OSError:
            if target.exists():
                continue
            raise


BUILDING = ".building-"  # a build in progress: .building-<id>/ and its lock file .building-<id>.lock


class WorkDir:
    """``.building-<id>/`` for one build, owned through an exclusive lock on ``.building-<id>.lock``.

    The kernel drops the lock when the process dies, however it dies (an error, SIGKILL, the
    out-of-memory killer), so a later build can tell a live build's directory from debris. The
    lock file appears already locked (locked under a temporary name, then renamed)."""

    def __init__(self, exp_dir: Path):
        self.id = uuid.uuid4().hex[:8]
        self.path = exp_dir / f"{BUILDING}{self.id}"
        self.lock_path = exp_dir / f"{BUILDING}{self.id}.lock"

    def __enter__(self) -> Path:
        pending = self.lock_path.with_name(f".pending-{self.id}.lock")
        self._lock = open(pending, "x")
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._lock.write(json.dumps({"pid": os.getpid(), "host": platform.node(),
                                     "started": time.strftime("%Y-%m-%d %H:%M:%S")}))
        self._lock.flush()
        os.rename(pending, self.lock_path)
        self.path.mkdir()
        return self.path

    def __exit__(self, *exc) -> None:
        self.lock_path.unlink(missing_ok=True)
        self._lock.close()


def remove_debris(exp_dir: Path) -> list[Path]:
    """Remove what builds that died left in ``exp_dir`` (their lock is free): say what and whose."""
    removed = []
    for lock_path in sorted([*exp_dir.glob(f"{BUILDING}*.lock"), *exp_dir.glob(".pending-*.lock")]):
        with open(lock_path) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live build holds it
            owner = lock.read().strip()
            work = lock_path.with_suffix("")
            if work.exists():
                shutil.rmtree(work)
                removed.append(work)
                print(f"removed {work}: left by a build that died ({owner or 'owner unknown'}); not a version")
            lock_path.unlink(missing_ok=True)
    for work in sorted(exp_dir.glob(f"{BUILDING}*")):
        # a live build creates its lock before its directory: a directory without one is debris
        if work.is_dir() and not work.with_name(work.name + ".lock").exists():
            shutil.rmtree(work)
            removed.append(work)
            print(f"removed {work}: left by a build that died (no lock); not a version")
    return removed


def compare_programs(original: Path, record: dict) -> dict:
    """The programs of this build against those ``original`` recorded: the same bytes (sha256)?"""
    theirs = json.loads((original / "build.json").read_text())["artifacts"]
    programs = [name for name in record["artifacts"] if name.endswith((".pte", ".ptd"))]
    same = {name: "identical" if theirs.get(name, {}).get("sha256") == record["artifacts"][name]["sha256"] else "differs"
            for name in programs}
    return {"of": str(original), "artifacts": same, "identical": bool(same) and all(s == "identical" for s in same.values())}
