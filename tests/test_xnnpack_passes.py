"""compile's shortcuts on the XNNPACK path give ExecuTorch's program: the one-retrace lowering
(pipeline/passes/edge.py) and the per-partition passes skipped where they cannot act
(pipeline/backends/xnnpack.py)."""

import torch
from torch.export import Dim

from pipeline.backends import backend
from pipeline.backends.xnnpack import ALL_OF, TRIGGERS


def _ops(gm) -> set:
    return {getattr(n.target, "__name__", None) for n in gm.graph.nodes if n.op == "call_function"}


def test_skipped_passes_are_xnnpacks_and_their_patterns_need_the_trigger_ops():
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa

    names = {p.__name__ for p in XNNPACKPassManager(None).passes}
    assert set(TRIGGERS) | set(ALL_OF) <= names
    assert all(TRIGGERS["ConvertToUpsampleBilinear2d"] & _ops(gm) for gm in bilinear_2d.get_graphs_dict())
    assert all(ALL_OF["ConvertToSDPAPass"] <= _ops(gm) for gm in sdpa.get_graphs())


class Block(torch.nn.Module):
    """Linears, an RMS norm, relu (fused by a skipped pass), cat (decomposed by one), over a dynamic axis."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x, idx):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        h = torch.relu(self.a(h))
        g = self.b(h)[idx]  # index: not delegated, so the graph splits into partitions
        return torch.cat([g, torch.softmax(g, -1)], dim=-1) + 1.0


def test_one_retrace_and_skipped_passes_give_executorchs_program():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    from pipeline.passes import edge

    n = Dim("n", min=2, max=8)
    args = (torch.randn(4, 16), torch.tensor([3, 0, 1, 2]))
    ep = torch.export.export(Block().eval(), args, dynamic_shapes=({0: n}, {0: n}), strict=False)
    xnnpack = backend("xnnpack")
    theirs = to_edge_transform_and_lower(xnnpack.programs({"forward": ep}), partitioner=[XnnpackPartitioner()])
    with xnnpack.lowering():
        ours = edge.to_edge_transform_and_lower(xnnpack, {"forward": ep}, {"forward": [XnnpackPartitioner()]},
                                                None, EdgeCompileConfig())
    delegates = [node for node in ours.exported_program("forward").graph.nodes if "call_delegate" in str(node.target)]
    assert len(delegates) >= 2
    assert ours.to_executorch().buffer == theirs.to_executorch().buffer


def test_edge_dialect_checked_once_per_method(monkeypatch):
    """With the config's IR check on, the one-retrace lowering runs ExecuTorch's Edge-dialect
    checks on each method's final graph, once, and not on each intermediate program (each
    partition's, after each XNNPACK pass); a refusal of the check fails the compile."""
    import pytest
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig
    from executorch.exir.verification import verifier

    from pipeline.passes import edge

    ep = torch.export.export(Block().eval(), (torch.randn(4, 16), torch.tensor([3, 0, 1, 2])), strict=False)
    real, checked = verifier._check_tensor_args_matching_op_allowed_dtype, []

    def counted(gm):
        checked.append(gm)
        return real(gm)

    def lower():
        with xnnpack.lowering():
            return edge.to_edge_transform_and_lower(xnnpack, {"forward": ep}, {"forward": [XnnpackPartitioner()]},
                                                    None, EdgeCompileConfig())

    xnnpack = backend("xnnpack")
    monkeypatch.setattr(verifier, "_check_tensor_args_matching_op_allowed_dtype", counted)
    program = lower().exported_program("forward")
    assert len(checked) == 1 and checked[0] is program.graph_module

    def refusing(gm):
        raise verifier.SpecViolationError("refused")

    monkeypatch.setattr(verifier, "_check_tensor_args_matching_op_allowed_dtype", refusing)
    with pytest.raises(verifier.SpecViolationError, match="refused"):
        lower()
