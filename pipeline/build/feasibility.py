"""What a config implies, computed from the config alone, before anything is exported.

Every bound the artifact implies is checked here, in one place, so that an infeasible config is
refused in a second instead of after minutes of export and compile: the model's shapes, the
validation episode against the KV capacity, and the build's memory against a budget. Free of
torch (the error path must stay fast).
"""

import os
from collections.abc import Callable, Sequence

from pipeline.errors import ConfigError
from pipeline.kv.layouts import DTYPE_BYTES, KVLayout
from pipeline.models.args import MLP_ACTIVATIONS, ROPE_TYPES, ModelArgs

GB = 1e9

# The build's peak resident memory, fitted on this project's builds (bench/build_memory.py prints
# the estimate next to the measured peak): the KV stores are held by the lowered program, the
# backend's graphs, ExecuTorch's edge and emitted programs and the runtime's planned buffers (fit:
# 3.3-4.0 copies; 6.3-7.1 with two attending methods); the ATen sequence attention copies each
# query token's column of the store (fit: 2.6); the weights:
# SmolLM2-135M fp32 (0.54 GB of weights) peaks at 3.32 GB with one step method and no copy of the
# weights in compile (fit: about 4.3 copies; 10.8 when compile deep-copied three methods).
BASE_BYTES = 0.8 * GB  # python, torch, executorch and the build of the tiny model
KV_COPIES = 5
GATHER_COPIES = 3
WEIGHT_COPIES = 5


def episode_sequences(validate_cfg, max_seqs: int) -> list[tuple[int, int]]:
    """The validate episode's sequences, (prompt tokens, decode steps): max_seqs + 1 of them, one
    more than fits so that one waits for a column; the first finishes first and frees its column."""
    lengths = list(validate_cfg.prompt_lengths)
    steps = validate_cfg.decode_steps
    shape = [(lengths[i % len(lengths)], max(2, steps - 5 * ((max_seqs - i) % (max_seqs + 1)))) for i in range(max_seqs + 1)]
    shape[0] = (shape[0][0], max(2, steps // 4))
    return shape


def memory_estimate(layouts: list[KVLayout], args: ModelArgs, model_dtype: str) -> dict[str, float]:
    """Bytes: the KV stores (every model's; the target's layout first), the target's weights, and the
    build's estimated peak."""
    layout = layouts[0]
    kv = sum(sum(each.kv_bytes_per_layer()) for each in layouts)
    weights = args.n_parameters() * DTYPE_BYTES[model_dtype]
    gather = layout.attention_scratch_bytes()
    return {"kv": kv, "weights": weights,
            "peak": BASE_BYTES + KV_COPIES * kv + WEIGHT_COPIES * weights + GATHER_COPIES * gather}


def machine_memory() -> int:
    """Physical memory of this machine, in bytes (the default budget)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budget_of(budget_gb: float | None) -> tuple[float, str]:
    """(bytes, where the number comes from): ``memory_budget_gb``, or this machine's memory where it is null."""
    if budget_gb is None:
        return machine_memory(), "this machine's memory; set memory_budget_gb to change it"
    return budget_gb * GB, f"memory_budget_gb={budget_gb}"


def largest(candidates: Sequence[int], fits: Callable[[int], bool]) -> int | None:
    """The largest of ``candidates`` (ascending) that ``fits``, where fitting holds up to some point and
    not beyond (the estimates grow with the capacity); None when none fits. Asks ``fits`` log2(n) times."""
    low, high = 0, len(candidates)  # candidates[:low] fit, candidates[high:] do not
    while low < high:
        mid = (low + high) // 2
        if fits(candidates[mid]):
            low = mid + 1
        else:
            high = mid
    return candidates[low - 1] if low else None


def check_model(args: ModelArgs, context: int | None) -> None:
    """The decoder's settings, for an artifact whose sequences reach ``context`` positions (None: not
    known yet; ``plan.resolve`` checks the RoPE against the context it derives)."""
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim"):
        if getattr(args, name) < 1:
            raise ConfigError(f"model.{name}={getattr(args, name)} must be a positive integer")
    if args.head_dim < 0:
        raise ConfigError(f"model.head_dim={args.head_dim} must be positive (0: model.dim / model.n_heads)")
    if args.head_dim == args.dim // args.n_heads and args.dim % args.n_heads:
        raise ConfigError(f"model.dim={args.dim} is not a multiple of model.n_heads={args.n_heads}; "
                          "the head dim is dim / n_heads unless model.head_dim sets it")
    if args.head_dim % 2:
        raise ConfigError(f"model.head_dim={args.head_dim} is odd (model.dim / model.n_heads unless set); "
                          "RoPE rotates pairs, choose an even one")
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.n_heads={args.n_heads} is not a multiple of model.n_kv_heads={args.n_kv_heads}; "
                          "grouped-query attention shares each KV head among n_heads / n_kv_heads query heads")
    if not args.layer_pattern or set(args.layer_pattern) - set("FR"):
        raise ConfigError(f"model.layer_pattern={args.layer_pattern!r} must be letters F (flat) and R (ring), e.g. RF")
    if "R" in (args.layer_pattern * args.n_layers)[: args.n_layers] and args.sliding_window < 1:
        raise ConfigError(f"model.layer_pattern={args.layer_pattern} has ring layers but "
                          f"model.sliding_window={args.sliding_window}; give ring layers a window of at least 1")
    if args.mlp_act not in MLP_ACTIVATIONS:
        raise ConfigError(f"model.mlp_act={args.mlp_act} is not supported; choose one of {', '.join(MLP_ACTIVATIONS)}")
    if set(args.rope_layers) - set("01"):
        raise ConfigError(f"model.rope_layers={args.rope_layers!r} must be digits 1 (RoPE) and 0 (none), e.g. 1110")
    check_rope(args, context)


def check_rope(args: ModelArgs, context: int | None) -> None:
    s = args.rope_scaling
    if s.type not in ROPE_TYPES:
        raise ConfigError(f"model.rope_scaling.type={s.type} is not supported; choose one of {', '.join(ROPE_TYPES)}")
    if args.rotary_dim % 2 or args.rotary_dim > args.head_dim:
        raise ConfigError(f"model.rope_dim={args.rope_dim} must be even and at most model.head_dim={args.head_dim}")
    if s.type in ("llama3", "yarn", "longrope", "dynamic") and s.original_context <= 0:
        raise ConfigError(f"model.rope_scaling.type={s.type} needs model.rope_scaling.original_context (> 0)")
    if s.type == "longrope" and len(s.short_factor or ()) != args.rotary_dim // 2:
        raise ConfigError(f"model.rope_scaling.short_factor has {len(s.short_factor or ())} values; longrope needs one "
                          f"per rotated pair ({args.rotary_dim // 2})")
    if s.type in ("dynamic", "longrope") and context is not None and context > s.original_context:
        raise ConfigError(f"model.rope_scaling.type={s.type} changes its frequencies beyond original_context="
                          f"{s.original_context} positions, which a static artifact cannot; kv.capacity={context} "
                          f"reaches further: lower it to {s.original_context} or less")


def check_draft(draft, target: ModelArgs, draft_cfg) -> None:
    """The draft against the target it serves: shared vocabulary and width are the target's by
    construction; its tapped layers must exist, its mask token be a token, its heads fit."""
    n = target.n_layers
    if bad := [i for i in draft.target_layer_ids if not 0 <= i < n]:
        raise ConfigError(f"draft.target_layer_ids={list(draft.target_layer_ids)} names layer {bad[0]}, but the target "
                          f"has model.n_layers={n} (layers 0..{n - 1}); choose tapped layers the target has")
    if not 0 <= draft.mask_token_id < target.vocab_size:
        raise ConfigError(f"draft.mask_token_id={draft.mask_token_id} is not a token of the target's vocabulary "
                          f"(model.vocab_size={target.vocab_size}: 0..{target.vocab_size - 1})")
    if draft.block_size < 2:
        raise ConfigError(f"draft.block_size={draft.block_size} must be at least 2: the last accepted token and a proposal")
    for name in ("num_hidden_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim"):
        if getattr(draft, name) < 1:
            raise ConfigError(f"draft.{name}={getattr(draft, name)} must be a positive integer")
    if draft.n_heads % draft.n_kv_heads:
        raise ConfigError(f"draft.n_heads={draft.n_heads} is not a multiple of draft.n_kv_heads={draft.n_kv_heads}")
    if draft.head_dim % 2:
        raise ConfigError(f"draft.head_dim={draft.head_dim} is odd; RoPE rotates pairs, choose an even one")


def check_vision(vision_cfg, target: ModelArgs):
    """The encoder against the target: its tokens at the target's width, its placeholder a token of
    the target. Returns its VisionArgs (an image's tokens against a sequence's context: ``roles.Vision``)."""
    from pipeline.models.args import VISION_FAMILIES, vision_args

    if vision_cfg.family not in VISION_FAMILIES:
        raise ConfigError(f"vision.family={vision_cfg.family} is not a vision family; choose {' or '.join(VISION_FAMILIES)}")
    if vision_cfg.out_dim is not None and vision_cfg.out_dim != target.dim:
        raise ConfigError(f"vision.out_dim={vision_cfg.out_dim} differs from the target's width model.dim={target.dim}: "
                          "image tokens replace token embeddings; set vision.out_dim to null or to the target's width")
    for name in ("image_size", "patch_size", "dim", "n_layers", "n_heads", "hidden_dim", "scale_factor", "num_channels"):
        if vision_cfg[name] < 1:
            raise ConfigError(f"vision.{name}={vision_cfg[name]} must be a positive integer")
    step = vision_cfg.patch_size * vision_cfg.scale_factor
    if vision_cfg.image_size % step:
        raise ConfigError(f"vision.image_size={vision_cfg.image_size} must be a multiple of vision.patch_size x "
                          f"vision.scale_factor = {step}")
    if vision_cfg.dim % vision_cfg.n_heads:
        raise ConfigError(f"vision.dim={vision_cfg.dim} is not a multiple of vision.n_heads={vision_cfg.n_heads}")
    if vision_cfg.family == "muse_glimmer" and (vision_cfg.dim // vision_cfg.n_heads) % 4:
        raise ConfigError(f"vision.dim / vision.n_heads = {vision_cfg.dim // vision_cfg.n_heads} must be a multiple of 4: "
                          "Muse Glimmer's 2D RoPE rotates a quarter of each head per axis")
    if not 0 <= vision_cfg.image_token_id < target.vocab_size:
        raise ConfigError(f"vision.image_token_id={vision_cfg.image_token_id} is not a token of the target's vocabulary "
                          f"(model.vocab_size={target.vocab_size})")
    return vision_args(vision_cfg, target)


def check_episode(validate_cfg, layout: KVLayout, spill: int = 0) -> None:
    """The validate stage's episode must fit in the artifact it validates (``spill``: tokens a sequence
    may carry beyond its prompt and decodes: a draft's block, an image's tokens)."""
    lengths = list(validate_cfg.prompt_lengths)
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"validate.prompt_lengths={lengths} must be a non-empty list of positive token counts")
    if validate_cfg.decode_steps < 1:
        raise ConfigError(f"validate.decode_steps={validate_cfg.decode_steps} must be at least 1")
    if not validate_cfg.tolerance > 0:
        raise ConfigError(f"validate.tolerance={validate_cfg.tolerance} must be positive")
    totals = sorted((p + d + spill for p, d in episode_sequences(validate_cfg, layout.max_seqs)), reverse=True)
    if layout.max_seq_len is not None and totals[0] > layout.max_seq_len:
        raise ConfigError(
            f"kv.capacity={layout.capacity} is too small for the validation episode: its longest sequence has "
            f"{totals[0]} tokens (validate.prompt_lengths up to {max(lengths)} + validate.decode_steps); "
            f"raise kv.capacity to at least {totals[0]} or shorten the episode")
    layout.check_episode(totals, "validate.prompt_lengths / validate.decode_steps")


def check_memory(layouts: list[KVLayout], args: ModelArgs, model_dtype: str, budget_gb: float | None,
                 layouts_at: Callable[[int], list[KVLayout]] | None = None, least: int = 1) -> dict[str, float]:
    """The build's estimated peak against ``memory_budget_gb`` (None: this machine's memory; ``layouts``:
    the target's first). Refused naming the settings and, given ``layouts_at`` (the layouts at another
    ``kv.capacity``, from ``least`` up), the largest capacity the budget holds at this ``kv.max_seqs``."""
    layout = layouts[0]
    estimate = memory_estimate(layouts, args, model_dtype)
    budget, where = budget_of(budget_gb)
    if estimate["peak"] > budget:
        advice = "lower kv.max_seqs or kv.capacity"
        if layouts_at is not None:
            most = largest(range(least, layout.capacity),
                           lambda c: memory_estimate(layouts_at(c), args, model_dtype)["peak"] <= budget)
            advice = (f"at kv.max_seqs={layout.max_seqs} the budget holds at most kv.capacity={most}" if most is not None else
                      f"at kv.max_seqs={layout.max_seqs} not even kv.capacity={least} fits: lower kv.max_seqs")
        raise ConfigError(
            f"kv.max_seqs={layout.max_seqs}, kv.capacity={layout.capacity}: the KV stores take "
            f"{estimate['kv'] / GB:.2f} GB and the build needs an estimated {estimate['peak'] / GB:.1f} GB, "
            f"over the budget of {budget / GB:.1f} GB ({where}); {advice}")
    return estimate
