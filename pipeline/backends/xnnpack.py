"""XNNPACK (CPU): ExecuTorch's XnnpackPartitioner delegates what XNNPACK runs (the linears, norms,
attention matmuls and softmax); the KV store's index ops and the mask math stay portable kernels."""

import contextlib
import math

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
    # its patterns (partition/graphs/bilinear_2d.py) are the kept op itself
    "ConvertToUpsampleBilinear2d": {"aten.upsample_bilinear2d.vec"},
}
# passes that match subgraph patterns: a pattern matches only where the graph holds all its ops, and
# every pattern of partition/graphs/sdpa.py holds these (tests/test_xnnpack_passes.py checks both sets)
ALL_OF = {
    "ConvertToSDPAPass": {"aten._softmax.default", "aten.bmm.default", "aten.logical_not.default",
                          "aten.eq.Scalar", "aten.any.dim", "aten.where.self"},
}


def _acts_on(pass_, graph) -> bool:
    """Whether ``pass_`` (a class of XNNPACK's pass list) can change ``graph``: false only for a pass
    of TRIGGERS on a graph without any of its ops, or of ALL_OF on a graph without all of them."""
    from executorch.backends.xnnpack.utils.quant_utils import is_dequant, is_quant

    name = pass_.__name__
    if name not in TRIGGERS and name not in ALL_OF:
        return True
    present = set()
    for node in graph.nodes:
        if node.op == "call_function":
            present.add(getattr(node.target, "__name__", None))
            if is_quant(node) or is_dequant(node):
                present.add("q/dq")
    if name in ALL_OF:
        return ALL_OF[name] <= present
    return bool(TRIGGERS[name] & present)


def _partition_graph(graph):
    """The graph with each tagged partition contracted to one vertex (its tag): a networkx DiGraph."""
    import networkx as nx

    group = {node: node.meta.get("delegation_tag") or node for node in graph.nodes}
    quotient = nx.DiGraph()
    quotient.add_nodes_from(set(group.values()))
    quotient.add_edges_from((group[node], group[user]) for node in graph.nodes for user in node.users
                            if group[node] != group[user])
    return quotient


def split_cyclic_partitions(graph, partition_tags: dict) -> list[str]:
    """Partitions that depend on each other in a cycle, each split into its connected pieces; returns
    the tags split.

    ExecuTorch 1.5.1's XnnpackPartitioner proposes partitions with its GroupBasedPartitioner, which
    merges any two partitions whose union has no path leaving it and coming back, connected or not.
    Each partition is valid alone, but two of them can still need each other: A's q projection feeds
    a node of B, and another node of B feeds A's key norm. ``to_backend`` fuses the first into one
    call, and the second then fails with "Invalid partition, found dependency cycles" (a quantized
    DFlash draft did). Here the partitions on a cycle of the contracted graph are split into their
    weakly connected components (a dynamically quantized linear's chain is connected, so it stays
    whole), until no cycle is left. Where none is, nothing changes."""
    import networkx as nx

    split = []
    while True:
        cyclic = {tag for scc in nx.strongly_connected_components(_partition_graph(graph)) if len(scc) > 1
                  for tag in scc if isinstance(tag, str)}
        if not cyclic:
            return split
        progress = False
        for tag in sorted(cyclic):
            members = [node for node in graph.nodes if node.meta.get("delegation_tag") == tag]
            pieces = nx.Graph()
            pieces.add_nodes_from(members)
            pieces.add_edges_from((node, user) for node in members for user in node.users
                                  if user.meta.get("delegation_tag") == tag)
            components = sorted(nx.connected_components(pieces), key=lambda c: min(members.index(n) for n in c))
            for i, component in enumerate(components[1:], 1):
                partition_tags[f"{tag}_{i}"] = partition_tags[tag]
                for node in component:
                    node.meta["delegation_tag"] = f"{tag}_{i}"
            if len(components) > 1:
                split.append(tag)
                progress = True
        if not progress:
            raise RuntimeError(f"XNNPACK's partitions {sorted(cyclic)} depend on each other in a cycle and each is "
                               "connected: no split of them is known to be valid")


# tanh-GELU's constants, as ATen's CPU kernel writes them: sqrt(2 / pi) and the cubic term's factor
GELU_TANH_BETA = math.sqrt(2.0 / math.pi)
GELU_TANH_KAPPA = 0.044715


def gelu_tanh(x, approximate: str = "none"):
    """``aten.gelu(x, approximate="tanh")`` as the ops of its formula, 0.5 x (1 + tanh(sqrt(2/pi) (x +
    0.044715 x^3))), each of which XNNPACK computes as torch does (to fp32 rounding); the exact (erf)
    GELU is left to XNNPACK's own op (NotImplemented: not decomposed).

    ExecuTorch 1.5.1's XNNPACK partitioner takes every ``gelu`` (its GeluConfig ignores ``approximate``)
    and XNNPACK's GELU is the erf form: a tanh-GELU delegated whole differs from torch's by 4.7e-4 (Gemma
    3's MLP failed validation at 2.3e-4). Decomposed, it is exact (tests/backends/test_elementwise.py).
    Measured against keeping the ``gelu`` out of the delegate (portable's kernel; the partition split
    around it): docs/benchmarks.md "gelu_tanh"."""
    import torch

    if approximate != "tanh":
        return NotImplemented
    inner = GELU_TANH_BETA * (x + GELU_TANH_KAPPA * (x * x * x))
    return 0.5 * x * (1 + torch.tanh(inner))


class Xnnpack(Backend):
    name = "xnnpack"
    quantized_kernels = True  # qc8w / qb4w linears; the quantized embedding ops run in ExecuTorch's kernels

    def inlined(self) -> dict:
        """The custom ops' ATen bodies, and tanh-GELU as its formula (``gelu_tanh``)."""
        import torch

        return {**super().inlined(), torch.ops.aten.gelu.default: gelu_tanh}

    def partitioners(self, methods: list[str]):
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        class Acyclic(XnnpackPartitioner):
            def partition(self, exported_program):
                result = super().partition(exported_program)
                split_cyclic_partitions(exported_program.graph_module.graph, result.partition_tags)
                return result

        return [Acyclic()]

    @contextlib.contextmanager
    def lowering(self):
        """XNNPACK's preprocess runs its 17 passes on every partition, each an ExportPass that
        retraces the partition with fake tensors (the step method's symbolic sizes make that ~20 ms
        per pass and partition of the default build); the passes of TRIGGERS are skipped on a
        partition without the ops they act on (those of ALL_OF without the ops their patterns need),
        where they would retrace it unchanged. The rest run as XNNPACK orders them."""
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
