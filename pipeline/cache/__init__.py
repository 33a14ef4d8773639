"""The stage cache: each stage's result stored content-addressed, reused by any build that needs it.

A stage's **key** is the sha256 of what decides its result (``stage_keys``, no torch import):
the config sections the stage reads (resolved), the keys of the upstream stages whose results it
takes, the content hashes of the checkpoint files its sections name, the versions of torch,
executorch and triton, and the hash of every file of this package the stage's module imports,
followed transitively (``code_files``). Two builds with the same key build the same thing.

An **entry** ``<cache_dir>/<stage>/<key>/`` holds ``files/`` (what the stage wrote into the
version directory: ``model.pte``, ``manifest.json``, ``tokenizer/``, ...), ``outputs/`` (its
in-memory results: ``torch.export.save`` archives for exported programs, the rest pickled) and
``entry.json``, written last, with the key's parts and the sha256 of every file. It is built in
``.tmp-<key>-<id>/`` and renamed into place, so a killed build leaves no entry; every use
verifies the hashes first and a damaged entry is reported and rebuilt, never used.

**Concurrency**: a build takes ``<stage>/<key>.lock`` (``filelock``) before it looks up or builds
an entry, so of two builds that need the same key one builds and the other waits, then reuses.
Every build holds a shared ``fcntl`` lock on ``<cache_dir>/.builds.lock``; ``gc`` takes it
exclusively, so it never removes an entry a running build is about to publish. ``flock`` works
across hosts on NFSv4 and Lustre mounts, the shared paths of a SLURM cluster.

``python -m pipeline.cache gc [OUTPUT_ROOT ...]`` removes every entry no version references
(``list`` lists them).

Modules: ``keys`` (the keys, no torch), ``store`` (entries, locks, the lazily loaded artifacts),
``gc`` (the command).
"""

from pipeline.cache.keys import changes, code_files, stage_keys, tool_versions
from pipeline.cache.store import Cache, DamagedEntry, Entry, LazyArtifacts

__all__ = ["Cache", "DamagedEntry", "Entry", "LazyArtifacts", "changes", "code_files", "stage_keys", "tool_versions"]
