"""Known library noise kept out of a build's output (``verbose=true`` shows everything).

A build prints its own progress on stdout. On stderr the libraries it drives print lines that say
nothing about the build: ExecuTorch's runtime probing ``/sys`` for an ARM CPU, torch's and
ExecuTorch's deprecation and serialisation warnings. ``filtered_stderr`` runs the build with file
descriptor 2 on a pipe (so C++ prints and child processes are caught too), forwards every other line
as it comes, and counts what it dropped.
"""

import contextlib
import logging
import os
import re
import sys
import threading

# each: a line that starts a piece of noise; the indented lines after it (a warning's source line) go with it
NOISE = tuple(re.compile(p) for p in (
    r"^\[cpuinfo_utils\.cpp:\d+\] ",  # ExecuTorch's runtime looking for ARM's midr files on x86
    r"FutureWarning: `isinstance\(treespec, LeafSpec\)` is deprecated",  # torch's pytree, from ExecuTorch's passes
    r"UserWarning: Mutation on a buffer in the model is detected",  # ExecuTorch's emitter: the KV stores, by design
    r"is an Enum subclass and is now natively supported by torch\.compile",  # torchao registering its enums
    r"^Failed to load .*torchao.*\.so",  # torchao's optional CUDA kernels on a CPU machine
    r"ExperimentalWarning: This API is experimental",  # executorch.runtime
))


def is_noise(line: str) -> bool:
    return any(p.search(line) for p in NOISE)


@contextlib.contextmanager
def filtered_stderr(enabled: bool = True):
    """Within the block, stderr without ``NOISE``; yields a dict whose ``"hidden"`` counts dropped lines."""
    counts = {"hidden": 0}
    if not enabled:
        yield counts
        return

    class Drop(logging.Filter):  # the same noise through logging (torchao logs its "Failed to load" to Hydra's stdout handler)
        def filter(self, record: logging.LogRecord) -> bool:
            if is_noise(record.getMessage()):
                counts["hidden"] += 1
                return False
            return True

    drop = Drop()
    logging.getLogger("torchao").addFilter(drop)
    sys.stderr.flush()
    original = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump() -> None:
        dropping = False
        with os.fdopen(read_end, "r", errors="replace") as pipe:
            for line in pipe:
                if is_noise(line):
                    dropping = True
                elif not (dropping and line[:1].isspace()):
                    dropping = False
                    os.write(original, line.encode())
                    continue
                counts["hidden"] += 1

    thread = threading.Thread(target=pump, name="stderr-filter", daemon=True)
    thread.start()
    try:
        yield counts
    finally:
        sys.stderr.flush()
        os.dup2(original, 2)  # the pipe's last writer goes: the pump reads to its end
        thread.join(timeout=10)
        os.close(original)
        logging.getLogger("torchao").removeFilter(drop)
