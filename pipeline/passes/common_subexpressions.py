"""Merge identical pure nodes: node(target, args) == earlier node(target, args) -> earlier.

After the attention ops are inlined as ATen, every layer recomputes the same
visibility mask and gather slots from the step buffers; one copy per layer
kind is enough. Runs on a functional (decomposed) graph, where every
call_function is pure; ops with random results are never merged.
"""

import torch
from torch import fx

_NEVER_MERGE = {torch.ops.aten.rand.default, torch.ops.aten.randn.default, torch.ops.aten.randint.low}


def _key(value):
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, fx.Node):
        return ("node", value.name)
    return ("const", repr(value))


def merge_common_subexpressions(gm: fx.GraphModule) -> int:
    """Returns the number of nodes removed."""
    seen: dict = {}
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target in _NEVER_MERGE:
            continue
        key = (node.target, _key(node.args), _key(node.kwargs))
        if key in seen:
            node.replace_all_uses_with(seen[key])
            gm.graph.erase_node(node)
            removed += 1
        else:
            seen[key] = node
    if removed:
        gm.recompile()
    return removed
