"""Entries of the stage cache, their verification and locks, and the build's lazily loaded artifacts
(see ``pipeline.cache``)."""

import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.build.versions import sha256_file


def files_under(root: Path) -> dict[str, Path]:
    """Every file under ``root`` by its relative path."""
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()} if root.is_dir() else {}


def link(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src`` (an entry's files are immutable: nothing is copied); a copy
    where the two are on different file systems."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


class DamagedEntry(Exception):
    pass


@dataclass
class Entry:
    path: Path
    record: dict = field(repr=False)

    @property
    def key(self) -> str:
        return self.path.name

    def verify(self) -> None:
        """Every file the entry recorded, with its size and sha256; ``DamagedEntry`` naming the first that is not."""
        for rel, want in self.record["files"].items():
            path = self.path / rel
            if not path.is_file():
                raise DamagedEntry(f"{rel} is missing")
            if path.stat().st_size != want["bytes"]:
                raise DamagedEntry(f"{rel} is {path.stat().st_size} bytes, recorded {want['bytes']}")
            if sha256_file(path) != want["sha256"]:
                raise DamagedEntry(f"{rel}'s sha256 differs from the recorded one")

    def link_files(self, workdir: Path) -> None:
        """The stage's files into the version being built."""
        for rel, path in files_under(self.path / "files").items():
            link(path, workdir / rel)

    def load_output(self, name: str, workdir: Path):
        """One of the stage's in-memory results (``outputs/<name>.pt``), its exported programs loaded
        with ``torch.export.load`` and its paths pointing into ``workdir``."""
        import torch

        _register_ops()
        encoded = torch.load(self.path / "outputs" / f"{name}.pt", weights_only=False)
        return _decode(encoded, self.path / "outputs", workdir)


def _register_ops() -> None:
    """The custom ops an exported program may call, registered before ``torch.export.load`` reads one."""
    import pipeline.kernels.reference  # noqa: F401  kvcache::sdpa_varlen and its planned form
    import pipeline.kv.op  # noqa: F401  kvcache::update_and_attend


def _encode(value, outdir: Path, workdir: Path, name: str):
    import torch

    if isinstance(value, torch.export.ExportedProgram):
        file = f"{name}.pt2"
        torch.export.save(value, outdir / file)
        return {"__exported_program__": file}
    if isinstance(value, Path) and value.is_relative_to(workdir):
        return {"__path__": value.relative_to(workdir).as_posix()}
    if isinstance(value, dict):
        return {k: _encode(v, outdir, workdir, f"{name}.{k}") for k, v in value.items()}
    return value


def _decode(value, outdir: Path, workdir: Path):
    import torch

    if isinstance(value, dict):
        if set(value) == {"__exported_program__"}:
            return torch.export.load(outdir / value["__exported_program__"])
        if set(value) == {"__path__"}:
            return workdir / value["__path__"]
        return {k: _decode(v, outdir, workdir) for k, v in value.items()}
    return value


class Cache:
    """The entries under ``root``; see the module's doc."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def entry_path(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    @contextlib.contextmanager
    def claim(self, stage: str, key: str) -> Iterator[None]:
        """Hold ``<stage>/<key>.lock``: one build at a time looks up and builds this key. Says so
        when another build holds it."""
        from filelock import FileLock, Timeout

        (self.root / stage).mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.root / stage / f"{key}.lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            print(f"      waiting: another build is building {stage} {key[:12]}", flush=True)
            lock.acquire()
        try:
            for debris in (self.root / stage).glob(f".tmp-{key}-*"):  # left by a build of this key that died
                shutil.rmtree(debris, ignore_errors=True)
            yield
        finally:
            lock.release()

    def _open(self, stage: str, key: str) -> Entry:
        path = self.entry_path(stage, key)
        try:
            return Entry(path, json.loads((path / "entry.json").read_text()))
        except (OSError, ValueError) as err:
            raise DamagedEntry(f"entry.json is unreadable ({type(err).__name__})") from None

    def lookup(self, stage: str, key: str) -> tuple[Entry | None, str | None]:
        """The verified entry, or None and why not (None: there is none; else what is damaged: the
        damaged entry is removed so that it is rebuilt). Call under ``claim``."""
        path = self.entry_path(stage, key)
        if not path.is_dir():
            return None, None
        try:
            entry = self._open(stage, key)
            entry.verify()
            return entry, None
        except (KeyError, DamagedEntry) as err:
            shutil.rmtree(path, ignore_errors=True)
            return None, str(err) if isinstance(err, DamagedEntry) else f"entry.json is incomplete ({err})"

    def peek(self, stage: str, key: str) -> Entry | None:
        """The entry if its record is readable and its files have their recorded sizes: no lock, no
        hashing (the dry run answers in a second; the build verifies the hashes before use)."""
        try:
            entry = self._open(stage, key)
            sizes = {rel: p.stat().st_size for rel, p in files_under(entry.path).items()}
            return entry if all(sizes.get(rel) == f["bytes"] for rel, f in entry.record["files"].items()) else None
        except (KeyError, DamagedEntry):
            return None

    def store(self, stage: str, key: dict, workdir: Path, new_files: list[str], outputs: dict, facts: dict,
              seconds: float) -> Entry:
        """Write the entry of a stage that just ran: its files (linked from ``workdir``), its
        outputs and ``entry.json``, in a temporary directory renamed into place. Call under ``claim``."""
        final = self.entry_path(stage, key["digest"])
        tmp = final.with_name(f".tmp-{key['digest']}-{uuid.uuid4().hex[:8]}")
        try:
            return self._store(stage, key, workdir, new_files, outputs, facts, seconds, final, tmp)
        except BaseException:  # stopped while writing (an error, a SIGTERM from SLURM): no half entry stays
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _store(self, stage, key, workdir, new_files, outputs, facts, seconds, final: Path, tmp: Path) -> Entry:
        import torch

        (tmp / "outputs").mkdir(parents=True)
        for rel in new_files:
            link(workdir / rel, tmp / "files" / rel)
        for name, value in outputs.items():  # one file per artifact: a later stage loads only those it takes
            torch.save(_encode(value, tmp / "outputs", workdir, name), tmp / "outputs" / f"{name}.pt")
        files = {rel: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for rel, p in files_under(tmp).items()}
        record = {"stage": stage, "key": key["parts"], "files": files, "facts": facts, "seconds": round(seconds, 3),
                  "created": time.strftime("%Y-%m-%d %H:%M:%S")}
        (tmp / "entry.json").write_text(json.dumps(record, indent=1) + "\n")
        if final.exists():  # force=true rebuilt an entry that was there: the new one replaces it
            shutil.rmtree(final)
        os.rename(tmp, final)
        return Entry(final, record)

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """A build in progress: a shared lock on ``.builds.lock`` that ``gc`` waits for."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".builds.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            yield

    def entries(self) -> list[Entry]:
        found = []
        for path in sorted(self.root.glob("*/*")):
            if path.is_dir() and not path.name.startswith("."):
                try:
                    found.append(Entry(path, json.loads((path / "entry.json").read_text())))
                except (OSError, ValueError):
                    found.append(Entry(path, {}))
        return found


class LazyArtifacts(Mapping):
    """The artifacts of a build by name: those of stages that ran, and those of cached stages, each
    loaded from its entry the first time a later stage asks for it."""

    def __init__(self):
        self.values: dict = {}
        self.pending: dict[str, object] = {}  # artifact name -> a loader of it

    def add(self, outputs: dict) -> None:
        self.values |= outputs

    def add_lazy(self, names: tuple[str, ...], loader) -> None:
        """``loader(name)`` gives the artifact ``name``."""
        self.pending |= {name: loader for name in names}

    def __getitem__(self, name: str):
        if name not in self.values and name in self.pending:
            self.values[name] = self.pending.pop(name)(name)
        return self.values[name]

    def __iter__(self):
        return iter(self.values.keys() | self.pending.keys())

    def __len__(self) -> int:
        return len(self.values.keys() | self.pending.keys())

    def view(self, names: tuple[str, ...]) -> "LazyArtifacts":
        """The artifacts ``names`` among these, loaded on first use still (once, for every view)."""
        out = LazyArtifacts()
        out.values = {n: v for n, v in self.values.items() if n in names}
        out.pending = {n: self.__getitem__ for n in names if n in self.pending}
        return out
