"""XNNPACK (CPU): ExecuTorch's XnnpackPartitioner delegates what XNNPACK runs (the linears, norms,
attention matmuls and softmax); the KV store's index ops and the mask math stay portable kernels."""

from pipeline.backends import Backend


class Xnnpack(Backend):
    name = "xnnpack"

    def partitioners(self, methods: list[str]):
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return [XnnpackPartitioner()]


BACKEND = Xnnpack()
