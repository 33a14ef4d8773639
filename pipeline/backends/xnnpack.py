"""XNNPACK (CPU): ExecuTorch's XnnpackPartitioner delegates what XNNPACK runs (the linears, norms,
attention matmuls and softmax); the KV store's index ops and the mask math stay portable kernels."""

import contextlib

from pipeline.backends import Backend

# XNNPACK's per-partition passes that act only on nodes of these ops (edge op names; "q/dq": its
# quantize / dequantize nodes) and otherwise retrace the partition unchanged
TRIGGERS = {
    "FuseBatchNormPass": {"aten.native_batch_norm.default", "aten._native_batch_norm_legit_no_training.default"},
    "DecomposeBatchNorm": {"aten.native_batch_norm.default", "aten._native_batch_norm_legit_no_training.default"},
    "Conv1dUnsqueezePass": {"aten.convolution.default"},
    "PReLUReshapePass": {"aten._prelu_kernel.default"},
    "FuseActivationPass": {"aten.relu.default", "aten.hardtanh.default"},
    "DecomposeConcatenate": {"aten.cat.default"},
    "RemoveGetItemPass": {"aten.max_pool2d_with_indices.default", "aten.max.dim"},
    "PropagateCustomMetaPass": {"q/dq"},
}


def _acts_on(pass_, graph) -> bool:
    """Whether ``pass_`` (a class of XNNPACK's pass list) can change ``graph``: false only for a pass
    of TRIGGERS and a graph without its ops."""
    from executorch.backends.xnnpack.utils.quant_utils import is_dequant, is_quant

    ops = TRIGGERS.get(pass_.__name__)
    if ops is None:
        return True
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if getattr(node.target, "__name__", None) in ops or ("q/dq" in ops and (is_quant(node) or is_dequant(node))):
            return True
    return False


class Xnnpack(Backend):
    name = "xnnpack"

    def partitioners(self, methods: list[str]):
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return [XnnpackPartitioner()]

    @contextlib.contextmanager
    def lowering(self):
        """XNNPACK's preprocess runs its 17 passes on every partition, each an ExportPass that
        retraces the partition with fake tensors (the step method's symbolic sizes make that ~20 ms
        per pass and partition of the default build); the passes of TRIGGERS are skipped on a
        partition without the ops they act on, where they would retrace it unchanged. The rest run
        as XNNPACK orders them."""
        from executorch.backends.xnnpack import _passes, xnnpack_preprocess

        full = _passes.XNNPACKPassManager

        class Skipping(full):
            def transform(self):  # XNNPACKPassManager.transform, asking before each pass
                from executorch.backends.xnnpack._passes.xnnpack_pass import XNNPACKPass
                from executorch.exir.program._program import _transform

                ep = self.exported_program
                for pass_ in self.passes:
                    if _acts_on(pass_, ep.graph):
                        ep = _transform(ep, pass_(ep) if issubclass(pass_, XNNPACKPass) else pass_())
                return ep

        xnnpack_preprocess.XNNPACKPassManager = Skipping
        try:
            yield
        finally:
            xnnpack_preprocess.XNNPACKPassManager = full


BACKEND = Xnnpack()
