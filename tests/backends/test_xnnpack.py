"""compile's shortcuts on the XNNPACK path give ExecuTorch's program: the one-retrace lowering
(pipeline/passes/edge.py) and the per-partition passes skipped where they cannot act
(pipeline/backends/xnnpack.py)."""

import pytest
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


def _random_graph(rng, n_nodes: int):
    """A random DAG of supported (add) and unsupported (mul) nodes, and disjoint random groups of
    supported nodes that span wide ranges (as shared dynamic-quantization nodes make them)."""
    import operator

    graph = torch.fx.Graph()
    nodes = [graph.placeholder(f"x{i}") for i in range(3)]
    for _ in range(n_nodes):
        a, b = rng.choice(nodes, 2)
        nodes.append(graph.call_function(operator.add if rng.random() < 0.7 else operator.mul, (a, b)))
    graph.output(tuple(n for n in nodes[3:] if not n.users))
    supported = [n for n in nodes if n.target is operator.add]
    rng.shuffle(supported)
    groups, at = [], 0
    while at < len(supported) // 2:
        size = int(rng.integers(2, 5))
        groups.append(supported[at:at + size])
        at += size
    return torch.fx.GraphModule(torch.nn.Module(), graph), groups


class _AddsOnly(torch.fx.passes.operator_support.OperatorSupportBase):
    def is_node_supported(self, submodules, node) -> bool:
        import operator

        return node.op == "call_function" and node.target is operator.add


def _proposed(gm, groups) -> list:
    from executorch.exir.backend.canonical_partitioners.group_partitioner import GroupBasedPartitioner

    parts = GroupBasedPartitioner(gm, _AddsOnly(), node_groups=groups, allows_single_node_partition=True).propose_partitions()
    return sorted(sorted(n.name for n in p.nodes) for p in parts)


def test_group_merge_check_gives_executorchs_partitions():
    """``merge_check_by_set_ops`` (pipeline/passes/group_merge.py) answers every pair of candidate
    partitions as ExecuTorch's check does, so the partitions proposed are the same, on random graphs
    whose groups interleave (merges that would make cycles among them)."""
    import numpy as np
    from executorch.exir.backend.canonical_partitioners.group_partitioner import GroupBasedPartitioner

    from pipeline.passes.group_merge import can_merge_partitions, merge_check_by_set_ops

    rng = np.random.default_rng(0)
    refused = 0
    for trial in range(30):
        gm, groups = _random_graph(rng, int(rng.integers(20, 60)))
        theirs = _proposed(gm, groups)
        with merge_check_by_set_ops():
            assert GroupBasedPartitioner._can_merge_partitions is can_merge_partitions
            ours = _proposed(gm, groups)
        assert ours == theirs, f"trial {trial}"
        # pair by pair, on the candidates before any merge
        p = GroupBasedPartitioner(gm, _AddsOnly(), node_groups=groups, allows_single_node_partition=True)
        import collections
        import itertools

        by_id, args = {}, ({}, {}, {}, {}, collections.defaultdict(set))
        p._process_all_nodes(itertools.count(), by_id, *args)
        for a, b in itertools.combinations(list(by_id), 2):
            want = p._can_merge_partitions(a, b, by_id)
            assert can_merge_partitions(p, a, b, by_id) == want
            refused += not want
    assert GroupBasedPartitioner._can_merge_partitions is not can_merge_partitions  # restored
    assert refused > 100  # the graphs do exercise the refusal


def _names(nodes) -> list:
    return [n.name for n in nodes]


def test_legalize_in_place_gives_legalize_graphs_graph():
    """``legalize_in_place`` (pipeline/passes/edge.py) leaves the graph as torch.fx's
    ``legalize_graph`` copies it: the same order, the same inputs and users in the same order, the
    same lookup table, and the next node created gets the same name. The graphs hold prioritized ops
    (operator.add, mul) and others (relu), so the sort's queue order is exercised, and names erased
    before the sort, which a copy forgets."""
    import copy

    import numpy as np
    from torch.fx.passes.tools_common import legalize_graph

    from pipeline.passes.edge import legalize_in_place

    rng = np.random.default_rng(1)
    reordered = 0
    for trial in range(20):
        gm, _ = _random_graph(rng, int(rng.integers(20, 80)))
        for node in list(gm.graph.nodes):  # some unprioritized nodes, and some erased, as partitions leave them
            if node.op == "call_function" and rng.random() < 0.2:
                with gm.graph.inserting_after(node):
                    relu = gm.graph.call_function(torch.relu, (node,))
                node.replace_all_uses_with(relu, delete_user_cb=lambda u, r=relu: u is not r)
        copies = copy.deepcopy(gm), copy.deepcopy(gm)  # (a deep copy's namespace is new)
        for g in (c.graph for c in copies):  # a name used, then erased (as fused nodes are)
            with g.inserting_after(next(iter(g.nodes))):
                g.erase_node(g.call_function(torch.relu, (next(iter(g.nodes)),)))
        theirs, ours = legalize_graph(copies[0]), legalize_in_place(copies[1])
        t, o = list(theirs.graph.nodes), list(ours.graph.nodes)
        assert _names(o) == _names(t), f"trial {trial}"
        reordered += _names(o) != _names(gm.graph.nodes)
        for a, b in zip(o, t, strict=True):
            assert _names(a.all_input_nodes) == _names(b.all_input_nodes)
            assert _names(a.users) == _names(b.users)
        ours.graph.lint()
        found = [_names(g.find_nodes(op="call_function", target=torch.relu, sort=False)) for g in (ours.graph, theirs.graph)]
        assert found[0] == found[1]
        new = [g.call_function(torch.relu, (next(iter(g.nodes)),)).name for g in (ours.graph, theirs.graph)]
        assert new[0] == new[1]
    assert reordered > 10  # the sort is not the identity on these graphs


def _tagged_graph(tags: dict):
    """x -> a1 = x + 1 -> b1 = a1 * 2;  x -> b2 = x - 1 -> a2 = b2 * 3;  out = a2 + b1, with the
    delegation tags ``tags`` ({node name: tag}) as a partitioner would set them."""
    import torch.fx

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a1 = graph.call_function(torch.add, (x, 1), name="a1")
    b1 = graph.call_function(torch.mul, (a1, 2), name="b1")
    b2 = graph.call_function(torch.sub, (x, 1), name="b2")
    a2 = graph.call_function(torch.mul, (b2, 3), name="a2")
    graph.output(graph.call_function(torch.add, (a2, b1), name="out"))
    for node in graph.nodes:
        if node.name in tags:
            node.meta["delegation_tag"] = tags[node.name]
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _fuse_in_turn(gm) -> None:
    """Each tagged partition fused into one call in turn, as ExecuTorch's to_backend does."""
    from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

    by_tag = {}
    for node in gm.graph.nodes:
        if "delegation_tag" in node.meta:
            by_tag.setdefault(node.meta["delegation_tag"], {})[node] = None
    fuse_by_partitions(gm, list(by_tag.values()))


def test_partitions_that_need_each_other_are_split_into_their_pieces():
    """Two partitions, each without a path out and back (valid alone), A = {a1, a2} and B = {b1, b2}:
    A feeds B (a1 -> b1) and B feeds A (b2 -> a2), so fusing one makes the other cyclic, the failure
    a quantized DFlash draft met. Split into connected pieces, every partition fuses."""
    from pipeline.backends.xnnpack import split_cyclic_partitions

    tags = {"a1": "tag0", "a2": "tag0", "b1": "tag1", "b2": "tag1"}
    with pytest.raises(AssertionError, match="dependency cycles"):
        _fuse_in_turn(_tagged_graph(tags))
    gm = _tagged_graph(tags)
    partition_tags = {"tag0": "spec", "tag1": "spec"}
    assert sorted(split_cyclic_partitions(gm.graph, partition_tags)) == ["tag0", "tag1"]
    assert partition_tags == {"tag0": "spec", "tag1": "spec", "tag0_1": "spec", "tag1_1": "spec"}
    _fuse_in_turn(gm)
    assert gm(torch.tensor(5.0)) == (5 - 1) * 3 + (5 + 1) * 2


def test_partitions_without_a_cycle_are_left_as_they_are():
    from pipeline.backends.xnnpack import split_cyclic_partitions

    tags = {"a1": "tag0", "b1": "tag0", "b2": "tag1", "a2": "tag1"}  # each a connected chain
    gm = _tagged_graph(tags)
    partition_tags = {"tag0": "spec", "tag1": "spec"}
    assert split_cyclic_partitions(gm.graph, partition_tags) == []
    assert partition_tags == {"tag0": "spec", "tag1": "spec"}
    assert {n.name: n.meta["delegation_tag"] for n in gm.graph.nodes if "delegation_tag" in n.meta} == tags
