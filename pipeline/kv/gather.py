"""The gathered CPU attention (``kvcache::sdpa_gather``) as a layout uses it: the step buffers it declares
(``gather_buffers``), its call in the lowered graph (``gather_call``), and the host's values of those
buffers, from the store slots each sequence of a step holds (``gather_values``; docs/design.md, "Step
buffers")."""

from pipeline.kv.layouts import AttentionKernel, KVLayout, SeqState, StepBuffer


def gather_buffers(layout: KVLayout) -> list[StepBuffer]:
    """The step buffers of the gathered attention (``kvcache::sdpa_gather``'s host-listed keys).
    Each named size is the size of one buffer alone (a size several inputs share is taken from
    any of them, and the program read back by ``torch.export.load`` took it from another one than
    the program in memory: the stage cache's compile was not the same program)."""
    buffers = [StepBuffer("block_q", ("block_tokens",)), StepBuffer("out_rows", ("n_tokens",))]
    for kind in layout.key_kinds():
        buffers += [StepBuffer(f"one_{kind}", (f"one_tokens_{kind}", 3, f"one_keys_{kind}")),
                    StepBuffer(f"block_{kind}", (2, f"block_keys_{kind}"))]
    return buffers


def gather_call(layout: KVLayout, call, kernel: AttentionKernel, q, k_store, v_store, pos, step: dict, kind: str,
                scale: float, window: int, scales: tuple | None = None):
    """Graph nodes: ``kvcache::sdpa_gather`` over the key set ``kind``'s host-listed slots (an 8-bit
    store's, with its ``scales`` (K's, V's): ``kvcache::sdpa_gather_q8``)."""
    listed = (pos, step[f"one_{kind}"], step["block_q"], step[f"block_{kind}"], step["out_rows"], scale, layout.causal,
              window)
    if scales is None:
        return call(kernel.gather, (q, k_store, v_store, *listed))
    if kernel.gather_q8 is None:
        raise NotImplementedError("this backend's attention has no 8-bit KV form (kv.dtype=int8)")
    return call(kernel.gather_q8, (q, k_store, scales[0], v_store, scales[1], *listed))


def gather_values(order: list[tuple[SeqState, int]], keys_of) -> dict:
    """The gathered attention's step buffers (``gather_buffers``) for a step of ``order``
    (sequence, new tokens), its tokens in that order. ``keys_of(seq, n)`` -> {key set: (slots, positions)}:
    the store slots the sequence holds after the step's writes, in position order, and their positions.

    The widest multi-token entry (a prefill chunk, a verified block) is the block: its keys are
    listed once and its tokens share them. Every other token attends alone over its own sequence's
    list, padded to the longest (slot 0, position -1). An empty group holds one entry that sees nothing."""
    import torch

    widest = max(range(len(order)), key=lambda i: order[i][1], default=None)
    block = widest if widest is not None and order[widest][1] > 1 else None
    one_q, block_q, one_lists, block_keys = [], [], [], {}
    start = 0
    for i, (seq, n) in enumerate(order):
        keys = keys_of(seq, n)
        tokens = list(range(start, start + n))
        if i == block:
            block_q, block_keys = tokens, keys
        else:
            one_q += tokens
            one_lists += [keys] * n
        start += n
    n_one = max(len(one_q), 1)
    out_rows = torch.empty(start, dtype=torch.int64)
    out_rows[one_q] = torch.arange(len(one_q))
    if block is not None:
        out_rows[block_q] = n_one + torch.arange(len(block_q))
    values = {"block_q": torch.tensor(block_q or [0], dtype=torch.int64), "out_rows": out_rows}
    kinds = list(block_keys) if block is not None else list(one_lists[0]) if one_lists else []
    for kind in kinds:
        lists = [keys[kind] for keys in one_lists]
        width = max([len(slots) for slots, _ in lists] + [1])
        one = torch.zeros(n_one, 3, width, dtype=torch.int64)  # per token: its slots, their positions, the token
        one[:, 1] = -1
        for row, (s, p) in enumerate(lists):
            one[row, 0, : len(s)], one[row, 1, : len(p)], one[row, 2] = s, p, one_q[row]
        values[f"one_{kind}"] = one
        values[f"block_{kind}"] = (torch.stack(block_keys[kind]) if block is not None
                                   else torch.tensor([[0], [-1]], dtype=torch.int64))
    return values
