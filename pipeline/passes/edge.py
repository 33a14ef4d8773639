"""ATen -> Edge and the backend's partitioners, with every decomposition in one retrace per method
(and each method's code regenerated once after partitioning, not once per partition).

ExecuTorch's ``to_edge_transform_and_lower`` retraces each method three times before the Edge passes
(``run_decompositions({})`` to functionalize; the core ATen table less the ops the partitioner keeps;
the whole table again, for the kept ops its ``check_op_support`` refuses), and the backend had
retraced it once before that to inline the custom ops it has no kernel for (``Backend.programs``). A
retrace of the default build's step method (460 nodes, three symbolic sizes) takes 4-5 s on 2 cores.
One ``run_decompositions`` with the union of those tables does the same work: functionalization is
part of every ``run_decompositions``, the inlined ops' bodies are decomposed by the same table as they
are traced, and the third retrace only has work when a kept op is left that the partitioner's check
refused (then it runs, as in ExecuTorch). The rest is ExecuTorch's own code, in its order: the kept
ops hidden from the table by its transformed-op namespace, ``_generate_edge_program``,
``EdgeProgramManager``, ``to_backend`` with each partitioner, the check that no kept op is left
undelegated, the Edge dialect verifier.

Measured on the default build's compile (2 cores, same machine): ExecuTorch's path 44.3 s, this one
29.7 s; the programs differ by two ``scalar_tensor`` constants that the common-subexpression merge now
finds (it runs after the core ATen decompositions instead of before them). Partitioners this module does not handle
(``one_retrace``) take ExecuTorch's path.

``code_regenerated_once`` runs ExecuTorch's per-partition graph sort in place (``legalize_in_place``,
torch.fx's order without its copy of the graph) and defers the code regeneration to the end.
The helpers are ExecuTorch's private ones (``executorch.exir.program._program``, executorch 1.5.1
as pinned in pyproject.toml): a version that changes them fails here, at compile, not in the artifact.
"""

import collections
import contextlib
import dataclasses
import functools


@functools.cache
def _prioritized_ops() -> frozenset:
    """The ops torch.fx's ``legalize_graph`` queues first (the runtime assertions and their symbolic
    arithmetic: its PRIORITIZED_OPS; tests/test_xnnpack_passes.py compares the orders)."""
    import operator

    import torch

    aten = torch.ops.aten
    return frozenset({
        operator.add, operator.mul, operator.sub, operator.floordiv, operator.truediv, operator.mod,
        operator.le, operator.lt, operator.ge, operator.gt, operator.eq, operator.ne,
        aten.sym_constrain_range.default, aten.sym_constrain_range_for_size.default, aten._assert_async.msg,
        aten.scalar_tensor.default, aten._assert_scalar.default,
    })


def legalized_order(graph) -> list:
    """The node order of torch.fx's ``legalize_graph`` (``torch.fx.passes.tools_common``): Kahn's sort,
    the nodes without inputs in graph order first, a node whose inputs are done queued at the back
    (at the front for the prioritized ops)."""
    prioritized = _prioritized_ops()
    nodes = list(graph.nodes)
    pending = dict.fromkeys(nodes, 0)
    for node in nodes:
        for user in node.users:
            pending[user] += 1
    queue = collections.deque(node for node in nodes if pending[node] == 0)
    order = []
    while queue:
        node = queue.popleft()
        order.append(node)
        for user in node.users:
            pending[user] -= 1
            if pending[user] == 0:
                if user.op == "call_function" and user.target in prioritized:
                    queue.appendleft(user)
                else:
                    queue.append(user)
    if len(order) < len(nodes):
        raise RuntimeError(f"Input graph has cycles, unable to add {[n for n, k in pending.items() if k]}")
    return order


def legalize_in_place(gm):
    """torch.fx's ``legalize_graph(gm)`` without copying the graph: the same order, names, users'
    order and lookup table as its copy, on the graph's own nodes (``legalize_graph`` copies every
    node of the method once per partition: 242 partitions x ~3000 nodes in the SmolLM2 int4 compile).
    The nodes keep their meta dicts (the copy's are shallow copies; ExecuTorch finds the nodes it
    needs afterwards in the sorted graph, so nothing holds the old ones). The module's code is not
    regenerated (``code_regenerated_once`` does that)."""
    from torch.fx.graph import _FindNodesLookupTable, _Namespace

    graph = gm.graph
    order = legalized_order(graph)
    position = {node: i for i, node in enumerate(order)}
    names, lookup = _Namespace(), _FindNodesLookupTable()
    for node in order:  # as the copy creates them: at the end, in order
        graph._root.prepend(node)
        name = names.create_name(node.name, None)  # the graph's namespace gave it: unchanged but for
        if name != node.name:  # a name set by hand that a copy would change
            node.name = name
        names.associate_name_with_obj(name, node)
        lookup.insert(node)
        if len(node.users) > 1:  # a copy's users are in creation order
            users = sorted(node.users, key=position.__getitem__)
            node.users.clear()
            node.users.update(dict.fromkeys(users))
    graph._graph_namespace, graph._find_nodes_lookup_table = names, lookup
    return gm


@contextlib.contextmanager
def code_regenerated_once():
    """ExecuTorch's ``to_backend`` fuses each partition into a submodule and then topologically sorts
    the whole owning graph again (``legalize_graph``): a copy of every node of the method, assigned to
    the module, which regenerates the module's Python code. With 242 partitions (SmolLM2 int4) the
    code regeneration was about a quarter of the compile and the copies about a tenth. Here every sort
    runs in ExecuTorch's order and gives its order (``legalize_in_place``: the graph's own nodes
    moved, nothing copied); the code of the modules sorted is regenerated once, after the last
    partition of the call, before anything runs them."""
    from executorch.exir import lowered_backend_module
    from executorch.exir.backend import backend_api

    legalize, create = lowered_backend_module.legalize_graph, backend_api._create_partitions_in_graph_module
    stale = {}

    def legalize_code_later(gm):
        stale[id(gm)] = gm
        return legalize_in_place(gm)

    def create_then_regenerate(*args, **kwargs):
        try:
            return create(*args, **kwargs)
        finally:
            for gm in stale.values():
                gm.recompile()
            stale.clear()

    lowered_backend_module.legalize_graph = legalize_code_later
    backend_api._create_partitions_in_graph_module = create_then_regenerate
    try:
        yield
    finally:
        lowered_backend_module.legalize_graph = legalize
        backend_api._create_partitions_in_graph_module = create


def one_retrace(partitioners: dict) -> bool:
    """Whether this module handles these partitioners ({method: [partitioner, ...]}): at most one per
    method, none with a pre-decomposition transform (ExecuTorch's Arm backend has one)."""
    from executorch.exir.backend.partitioner import Partitioner

    return all(len(p) <= 1 and all(type(q).transform_for_pre_decomposition is Partitioner.transform_for_pre_decomposition
                                   for q in p) for p in partitioners.values())


def decomposition_table(partitioner, ep, config) -> tuple[dict, list, bool]:
    """The core ATen table less what ``partitioner`` keeps (ExecuTorch's choice for it), the ops it
    keeps, and whether it checks each node of those ops (``check_op_support``: ExecuTorch's
    EDGE_DO_NOT_DECOMP path) or keeps them all."""
    from executorch.exir.program._program import (
        _can_skip_using_EDGE_DO_NOT_DECOMP,
        _default_decomposition_table,
        _remove_invalid_ops_for_not_decompose,
    )

    table = _default_decomposition_table()
    if partitioner is None:  # decomposed by default, less the config's preserve_ops
        for op in config.preserve_ops:
            table.pop(op, None)
        return table, [], False
    ops, _ = partitioner.ops_to_not_decompose(ep)
    if _can_skip_using_EDGE_DO_NOT_DECOMP(partitioner, ep):
        return table, [op for op in ops if table.pop(op, None) is not None], False
    ops = _remove_invalid_ops_for_not_decompose(ops)
    for op in ops:
        table.pop(op, None)
    return table, ops, True


def to_edge_transform_and_lower(backend, lowered: dict, partitioners: dict, constant_methods: dict, config,
                                native: bool = False):
    """ExecuTorch's ``to_edge_transform_and_lower(backend.programs(lowered), partitioners, ...)`` in one
    retrace per method; ``partitioners``: {method: [at most one partitioner]}. (The name is
    ExecuTorch's: XNNPACK's partitioner looks for it on the stack, and warns of a deprecated
    ``to_edge() + to_backend()`` workflow without it.)"""
    from executorch.exir.program._program import (
        EdgeProgramManager,
        _default_decomposition_table,
        _generate_edge_program,
        _remove_invalid_ops_for_not_decompose,
        _replace_aten_ops_with_transformed_ops,
        _restore_transformed_ops_to_aten_ops,
        _sanity_check_graph_for_non_decomp_ops,
    )
    from executorch.exir.verification.verifier import EXIREdgeDialectVerifier

    # The Edge-dialect check runs once per method, on its final graph (below).  ExecuTorch's flow with
    # the check on also verifies every intermediate program (each partition's, after each of XNNPACK's
    # passes, ~4000 verifications in an int4 SmolLM2 compile); it runs with the check off, as XNNPACK's
    # own edge config and ExecuTorch's export_llm do.
    verify = config._check_ir_validity
    config = dataclasses.replace(config, _check_ir_validity=False)
    chosen = {name: (partitioners.get(name) or [None])[0] for name in lowered}
    tables, kept, checked = {}, {}, {}
    for name, ep in lowered.items():
        tables[name], kept[name], checked[name] = decomposition_table(chosen[name], ep, config)
    programs = backend.programs(lowered, tables, native)
    edge_programs, preserved = {}, {}
    for name, ep in programs.items():
        preserved[name] = list(kept[name])
        if checked[name]:
            # the kept ops the partitioner takes, hidden from the table; any other is decomposed
            preserved[name] = list(_replace_aten_ops_with_transformed_ops(name, ep, {name: [chosen[name]]}) or ())
            if any(n.op == "call_function" and n.target in kept[name] for n in ep.graph.nodes):
                ep = ep.run_decompositions(_default_decomposition_table())
            _restore_transformed_ops_to_aten_ops(ep)
        edge_programs[name] = _generate_edge_program(config, ep, preserve_ops=preserved[name])
    every = list(set().union(*preserved.values()))
    config._core_aten_ops_exception_list = list(set(config._core_aten_ops_exception_list) | set(every))
    edge = EdgeProgramManager(edge_programs, constant_methods, config, every)
    with_partitioner = {name: p for name, p in chosen.items() if p is not None}
    if with_partitioner:
        with code_regenerated_once():
            edge = edge.to_backend(with_partitioner)
    for name in edge_programs:  # ExecuTorch's closing checks
        program, p = edge.exported_program(name), chosen[name]
        ops = set()
        if p is not None:
            ops, check = p.ops_to_not_decompose(program)
            ops = set(_remove_invalid_ops_for_not_decompose(ops) if checked[name] else ops)
            _sanity_check_graph_for_non_decomp_ops(name, program, ops, check, generate_error=True,
                                                   partitioner_name=type(p).__name__)
        if verify:
            EXIREdgeDialectVerifier(edge_compile_config=dataclasses.replace(config, _check_ir_validity=True),
                                    class_only=True, preserve_ops=config.preserve_ops + list(ops))()(program.graph_module)
    return edge
