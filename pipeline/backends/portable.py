"""ExecuTorch's portable kernels: no delegate; every op, the inlined attention included, runs as
a portable kernel. The reference CPU backend (and the quickest to compile)."""

from pipeline.backends import Backend


class Portable(Backend):
    name = "portable"


BACKEND = Portable()
