"""The context each sequence of an artifact gets: ``kv.capacity`` and ``kv.max_step_tokens`` where the
config leaves them null (``conf/kv/*.yaml``), derived here and said by the build's summary and the dry run.

The rule (docs/design.md, "Context per sequence"), for a model with a context of its own
(``model.context_length``: a checkpoint's HF ``max_position_embeddings`` or GGUF ``{arch}.context_length``;
at most ``rope_scaling.original_context`` for ``dynamic`` / ``longrope`` RoPE, which a static artifact
cannot take further):

- ``kv.max_step_tokens``: ``SERVING_STEP_TOKENS``, at most the capacity set or the model's context;
- ``kv.capacity``: that context, or, where it does not fit, the largest multiple of ``QUANTUM`` below it
  that does: the build's estimated peak within the memory budget (``memory_budget_gb``, null: this
  machine's memory), and the KV stores of every model within ``SERVING_KV_BYTES`` and the widest step's
  attention scratch within ``SERVING_SCRATCH_BYTES`` (these two serving caps never take it below
  ``QUANTUM`` tokens, nor below the step or a sliding window the layout must hold). A budget that holds
  not even that floor is refused. For the cell layout the capacity is the pool, shared by the sequences.

A model without a context of its own (random weights) keeps the fixed defaults it always had
(``FIXED_CAPACITY``, ``FIXED_STEP_TOKENS``), so its artifacts are unchanged. Free of torch.
"""

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.build.feasibility import GB, largest
from pipeline.errors import ConfigError

QUANTUM = 256  # a derived capacity below the model's context is a multiple of this many tokens
SERVING_KV_BYTES = 1 * GB  # the KV stores of every model, all sequences
SERVING_SCRATCH_BYTES = 0.25 * GB  # the CPU attention's scratch for the widest step (KVLayout.attention_scratch_bytes)
SERVING_STEP_TOKENS = 64  # a prompt's prefill chunk (the server may take fewer per step: --prefill-chunk)
FIXED_CAPACITY = {"sequence": 128, "cell": 512}  # a model without a context of its own (random weights)
FIXED_STEP_TOKENS = 16
SET = "set"


@dataclass(frozen=True)
class Context:
    """``kv.capacity`` and ``kv.max_step_tokens`` as the build takes them, and where each came from."""

    capacity: int
    max_step_tokens: int
    capacity_from: str = SET  # SET, or the derivation in words
    step_from: str = SET

    def lines(self, layout) -> list[str]:
        """What each sequence gets (``layout``: the target's), then, where a value was derived, why, and the
        KV cache's bytes."""
        seqs = f"kv.max_seqs={layout.max_seqs}"
        if layout.max_seq_len is None:  # ring layers only: a sequence keeps its last window, without end
            window = max(layer.window for layer in layout.layers)
            held = f"no bound per sequence (sliding-window layers only: each keeps its last {window} tokens) x {seqs}"
        elif layout.session_length_limit is None:  # one pool bounds the sequences together
            held = (f"a pool of {layout.capacity} tokens shared by {seqs} sequences "
                    f"(one sequence up to {layout.max_seq_len})")
        else:
            held = f"{layout.max_seq_len} tokens per sequence x {seqs}"
        out = [f"context: {held}; prompts in steps of up to {self.max_step_tokens} tokens"]
        for name, value, source in (("kv.capacity", self.capacity, self.capacity_from),
                                    ("kv.max_step_tokens", self.max_step_tokens, self.step_from)):
            if source != SET:
                out.append(f"  {name}={value} (null in the config): {source}")
        return out + [kv_line(layout)]


def kv_line(layout) -> str:
    """The KV stores' bytes: in all, per sequence, per token (every layer's K and V, a quantized store's
    scales included)."""
    total = sum(layout.kv_bytes_per_layer())
    per_token = layout.bytes_per_token() * len(layout.layers)
    kind = (f"{layout.dtype}, a float32 scale per token and KV head" if layout.quantized else layout.dtype)
    return f"KV cache ({kind}): {_size(total)}, {_size(total / layout.max_seqs)} a sequence, {_size(per_token)} a token"


def _size(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"


def model_context(model_cfg) -> int:
    """Positions the model itself takes, as far as a static artifact can take them (0: none of its own)."""
    context = int(model_cfg.context_length)
    scaling = model_cfg.rope_scaling
    if context and scaling.type in ("dynamic", "longrope") and scaling.original_context > 0:
        context = min(context, int(scaling.original_context))
    return context


def step_tokens(kv_cfg, context: int) -> tuple[int, str]:
    """``kv.max_step_tokens`` and where it came from."""
    if kv_cfg.max_step_tokens is not None:
        return int(kv_cfg.max_step_tokens), SET
    if not context:
        return FIXED_STEP_TOKENS, "the default for a model without a context of its own (model.context_length=0)"
    bound = kv_cfg.capacity if kv_cfg.capacity is not None else context
    return min(SERVING_STEP_TOKENS, bound), "the serving default for a model with a context of its own (at most its context)"


def derive_capacity(layout, context: int, least: int, measure: Callable[[int], dict], budget: float,
                    where: str) -> tuple[int, str]:
    """``kv.capacity`` for ``kv.capacity: null`` and the reason in words. ``layout``: the ``kv`` config;
    ``measure(capacity)``: the estimate at that capacity (``kv``, ``scratch``, ``peak`` bytes); ``least``: the
    smallest capacity the layout can be built with (the step, a sliding window); ``budget``: bytes (``where``:
    its source)."""
    if not context:
        return (FIXED_CAPACITY[layout.layout],
                "the layout's default for a model without a context of its own (model.context_length=0)")
    floor = max(QUANTUM, least)

    def over(capacity: int) -> str | None:
        """What the capacity exceeds, in words; None: nothing."""
        m = measure(capacity)
        if m["peak"] > budget:
            return (f"the build would need an estimated {m['peak'] / GB:.1f} GB, over the budget of {budget / GB:.1f} GB "
                    f"({where})")
        if capacity > floor and m["kv"] > SERVING_KV_BYTES:
            return f"the KV stores would take {m['kv'] / GB:.3g} GB, over the serving cap of {SERVING_KV_BYTES / GB:g} GB"
        if capacity > floor and m["scratch"] > SERVING_SCRATCH_BYTES:
            return (f"the widest step's attention scratch would take {m['scratch'] / GB:.3g} GB, over the serving cap "
                    f"of {SERVING_SCRATCH_BYTES / GB:g} GB")
        return None

    if over(context) is None:
        return context, f"the model's context (model.context_length={context})"
    candidates = sorted({c for c in range(QUANTUM, context, QUANTUM) if c >= least} | ({least} if least < context else set()))
    chosen = largest(candidates, lambda c: over(c) is None)
    if chosen is None:  # the serving caps never refuse the floor: the budget does
        first = candidates[0] if candidates else context
        raise ConfigError(
            f"kv.capacity=null derives the context from the model's {context} tokens, but at kv.max_seqs={layout.max_seqs} "
            f"not even kv.capacity={first} fits: {over(first)}; lower kv.max_seqs or raise memory_budget_gb")
    above = next((c for c in candidates if c > chosen), context)
    return chosen, f"the model's context of {context} tokens, capped: at {above} tokens {over(above)}"
