"""LowerOffGraphKVPass: the neutral KV op becomes an explicit store and attention.

For every ``kvcache::update_and_attend(q, k, v, position, layer, scale, out_dtype)`` (ExecuTorch's op):

    slots   = (position % rows) * columns + seq_cols        sequence layouts (solo: seq_cols = 0)
            = cell_ids                                      cell layout
    K_l     = index_copy_(K_l, 0, slots, k)                 store: mutable buffer [rows*columns, Hkv, D]
    V_l     = index_copy_(V_l, 0, slots, v)
    (kv.dtype=int8: K_l, V_l hold k, v rounded per token and KV head (kv/quantize.py), and
     K_scale_l, V_scale_l [rows*columns, Hkv] their scales; the attention is sdpa_gather_q8)
    out     = sdpa_varlen(q, K_l, V_l, position, seq_cols, seq_info_<kind>, columns, scale, causal, window)
            = sdpa_cells(q, K_l, V_l, position, q_seq_bits, cell_pos, cell_owners, scale, causal, window)

The step buffers (``KVLayout.step_buffers``) become trailing inputs of the
method, filled by the runtime each step; nothing derived from them is a
constant. The rewritten graph is exported again so the stores are lifted as
mutable buffers. A node that cannot be rewritten fails the build.
"""

from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.export import ExportedProgram

from pipeline.kernels import reference  # noqa: F401  (registers kvcache::sdpa_varlen / sdpa_cells)
from pipeline.kv.layouts import AttentionKernel, KVLayout
from pipeline.kv.op import NEUTRAL_OP
from pipeline.kv.quantize import quantize

STORE_MODULE = "kv_store"  # the default stores' module: buffers kv_store.k_<layer>, kv_store.v_<layer>

aten = torch.ops.aten


class LoweringError(RuntimeError):
    pass


@dataclass
class MethodInputs:
    """What re-exporting a method needs: example args and their dynamic shapes."""

    args: tuple
    dynamic_shapes: tuple
    token_dim: object  # the torch.export.Dim of the step's token axis (Dim.STATIC when it can only be 1)
    # the module holding the stores of the model whose KV the method reads and writes (its role's:
    # ``kv_store``, ``draft_kv_store``): the program shares mutable buffers between methods by name,
    # so each model's layers need names of their own
    store: str | None = STORE_MODULE
    positions_arg: int = 1  # which argument is the step's positions [T]


def unlifted(ep: ExportedProgram) -> fx.GraphModule:
    """``ep`` as a module to export again, without its export-time input guards (the export's token
    bounds): the new export sets its own. (torch < 2.9 puts no guards in the module and has no flag.)"""
    try:
        return ep.module(check_guards=False)
    except TypeError:
        return ep.module()


def count_neutral(ep: ExportedProgram) -> int:
    return sum(1 for n in ep.graph.nodes if n.op == "call_function" and n.target == NEUTRAL_OP)


def _example_size(layout: KVLayout, dim, n_tokens: int) -> int:
    if isinstance(dim, int):
        return dim
    return n_tokens if dim == "n_tokens" else layout.dim_bound(dim)


def _example_step_buffers(layout: KVLayout, n_tokens: int) -> tuple[torch.Tensor, ...]:
    return tuple(
        torch.zeros([_example_size(layout, d, n_tokens) for d in buf.shape], dtype=torch.int64)
        for buf in layout.step_buffers()
    )


def _step_buffer_dims(layout: KVLayout, token_dim) -> tuple:
    """Dynamic shapes of the step buffers: each named axis the token axis, or a length from 1 to
    ``layout.dim_bound(name)`` (one ``Dim`` per name, shared by the buffers that name it)."""
    dims = {"n_tokens": token_dim}

    def dim(name):
        if name not in dims:
            bound = layout.dim_bound(name)
            dims[name] = torch.export.Dim(name, min=1, max=bound) if bound > 1 else torch.export.Dim.STATIC
        return dims[name]

    return tuple({axis: dim(d) for axis, d in enumerate(buf.shape) if isinstance(d, str)} or None
                 for buf in layout.step_buffers())


def lower_offgraph_kv(ep: ExportedProgram, layout: KVLayout, inputs: MethodInputs,
                      kernel: AttentionKernel | None = None) -> ExportedProgram:
    """Rewrite every neutral KV node of ``ep``; ``kernel`` (``Backend.attention_kernel()``) picks the
    attention: the ATen ``kvcache::sdpa_gather`` (``gather``, the default), or the planned form
    (``plan``: ``kvcache::sdpa_varlen_plan``, ``attend``: ``kvcache::sdpa_varlen_attend``):
    one plan per layer kind, shared by its layers. The store index math and the attention call are the
    layout's (``KVLayout.write_slots`` / ``attend``)."""
    kernel = kernel or AttentionKernel(gather=torch.ops.kvcache.sdpa_gather.default,
                                       gather_q8=torch.ops.kvcache.sdpa_gather_q8.default)
    if layout.quantized and (kernel.planned or kernel.gather_q8 is None):
        raise LoweringError(f"kv.dtype={layout.dtype}: this backend's attention reads float stores only")
    if kernel.planned != layout.planned:
        raise LoweringError(f"the {'planned' if kernel.planned else 'gathered'} attention kernel cannot lower a layout "
                            f"whose step buffers are for the {'planned' if layout.planned else 'gathered'} one")
    if count_neutral(ep) == 0:
        raise LoweringError("no kvcache::update_and_attend node to lower: was the model exported with the neutral op?")
    module = unlifted(ep)
    graph = fx.Graph()
    env = graph.graph_copy(module.graph, {})  # plain positional code, no pytree input guard
    graph.output(env[0] if isinstance(env, (tuple, list)) and len(env) == 1 else env)  # a single output stays single
    gm = fx.GraphModule(module, graph)
    stores = nn.Module()
    prefix = inputs.store
    gm.add_module(prefix, stores)

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        step = {buf.name: graph.placeholder(buf.name) for buf in reversed(layout.step_buffers())}

    targets = [n for n in graph.nodes if n.op == "call_function" and n.target == NEUTRAL_OP]
    slots_by_kind: dict[str, fx.Node] = {}
    plans_by_kind: dict[str, fx.Node] = {}
    for node in targets:
        q, k, v, position, layer_id, scale, out_dtype = node.args
        if not isinstance(layer_id, int) or not 0 <= layer_id < len(layout.layers):
            raise LoweringError(f"{node.name}: layer_id={layer_id!r} is not a layer of the model (0..{len(layout.layers) - 1})")
        layer = layout.layers[layer_id]
        for name, ref in (("q", q), ("k", k), ("v", v)):
            val = ref.meta.get("val")
            if val is None or val.dim() != 4 or val.shape[0] != 1:
                raise LoweringError(f"{node.name}: {name} must be [1, H, T, D] with a known shape, got {getattr(val, 'shape', None)}")
        if k.meta["val"].shape[1] != layout.n_kv_heads or k.meta["val"].shape[-1] != layout.head_dim:
            raise LoweringError(
                f"{node.name}: k has {k.meta['val'].shape[1]} heads of dim {k.meta['val'].shape[-1]}, "
                f"the layout stores {layout.n_kv_heads} of dim {layout.head_dim}"
            )
        shape = layout.store_shape(layer)
        stores.register_buffer(f"k_{layer_id}", torch.zeros(shape, dtype=layout.torch_dtype))
        stores.register_buffer(f"v_{layer_id}", torch.zeros(shape, dtype=layout.torch_dtype))
        if layout.quantized:  # a scale per slot and KV head beside the 8-bit K and V
            stores.register_buffer(f"k_scale_{layer_id}", torch.zeros(layout.scale_shape(layer)))
            stores.register_buffer(f"v_scale_{layer_id}", torch.zeros(layout.scale_shape(layer)))

        with graph.inserting_before(node):
            call = graph.call_function
            pos = call(aten.view.default, (position, [-1]))  # [T]
            if layer.kind not in slots_by_kind:
                slots_by_kind[layer.kind] = layout.write_slots(call, pos, layer, step)
            slots = slots_by_kind[layer.kind]

            def tokens_first(x):  # [1, H, T, D] -> [T, H, D]; a view, not select: XNNPACK takes views
                # (with one dynamic size) into the partition around it, a select would split it
                heads, dim = x.meta["val"].shape[1], x.meta["val"].shape[3]
                return call(aten.view.default, (call(aten.permute.default, (x, [0, 2, 1, 3])), [-1, heads, dim]))

            def to_store(x, like):
                store_dtype = layout.torch_dtype
                return x if like.meta["val"].dtype == store_dtype else call(aten._to_copy.default, (x,), {"dtype": store_dtype})

            def store(name, x, like):  # the step's rows written into the store (and their scales); the store
                if not layout.quantized:
                    return call(aten.index_copy_.default, (graph.get_attr(f"{prefix}.{name}_{layer_id}"), 0, slots,
                                                           to_store(tokens_first(x), like))), None
                rows = tokens_first(x)
                if like.meta["val"].dtype != torch.float32:
                    rows = call(aten._to_copy.default, (rows,), {"dtype": torch.float32})
                ints, scales = quantize(call, rows)  # [T, Hkv, D] int8, [T, Hkv, 1]
                scales = call(aten.view.default, (scales, [-1, layout.n_kv_heads]))
                scales = call(aten.index_copy_.default, (graph.get_attr(f"{prefix}.{name}_scale_{layer_id}"), 0, slots, scales))
                return call(aten.index_copy_.default, (graph.get_attr(f"{prefix}.{name}_{layer_id}"), 0, slots, ints)), scales

            k_store, k_scales = store("k", k, k)
            v_store, v_scales = store("v", v, v)
            out = layout.attend(call, tokens_first(q), k_store, v_store, pos, layer, step, scale, kernel,
                                plans_by_kind, q.meta["val"], v.meta["val"],
                                (k_scales, v_scales) if layout.quantized else None)
            n_heads, dv = q.meta["val"].shape[1], v.meta["val"].shape[3]
            out = call(aten.view.default, (call(aten.permute.default, (out, [1, 0, 2])), [1, n_heads, -1, dv]))  # [1, Hq, T, Dv]
            if out_dtype != q.meta["val"].dtype:  # the attention ops return q's dtype
                out = call(aten._to_copy.default, (out,), {"dtype": out_dtype})
        node.replace_all_uses_with(out)
        graph.erase_node(node)

    graph.eliminate_dead_code()
    gm.recompile()
    if any(n.op == "call_function" and n.target == NEUTRAL_OP for n in gm.graph.nodes):
        raise LoweringError("kvcache::update_and_attend nodes remain after lowering")

    n_tokens = inputs.args[inputs.positions_arg].shape[0]  # the example's step width
    args = inputs.args + _example_step_buffers(layout, n_tokens)
    dyn = inputs.dynamic_shapes + _step_buffer_dims(layout, inputs.token_dim)
    with torch.no_grad():
        lowered = torch.export.export(gm, args, dynamic_shapes=dyn, strict=False)
    if count_neutral(lowered):
        raise LoweringError("kvcache::update_and_attend nodes remain after re-export")
    return lowered
