"""Weight quantization of the target (and, with ``quant.draft``, of a draft's own linears) at build
time: the ``quant`` config group.

- ``int8``: 8-bit weights with one scale per output channel, ``int4``: 4-bit weights in groups of
  ``quant.group_size`` input columns; both with 8-bit activations quantized per token at run time.
  That is ExecuTorch's own LLM recipe (``8da8w`` / ``8da4w``): torchao's
  ``Int8DynamicActivationIntxWeightConfig`` on every linear (the output head included), which
  XNNPACK's quantized kernels (qc8w, qb4w) run. The token embedding (``quant.embedding``) becomes
  8-bit rows or 4-bit groups read by ExecuTorch's quantized embedding ops (``embedding.py``).
- ``from_checkpoint``: a GGUF's own Q4_0 / Q4_1 / Q8_0 blocks, mapped without a float round trip
  where the formats allow (``gguf.py``).

The quantized eager model is the artifact's oracle (it computes what the ``.pte`` computes, up to
rounding): XNNPACK stores a 4-bit weight's scales as bfloat16 (ExecuTorch's XNNPACK serialiser casts
them), so the oracle's 4-bit scales are rounded to bfloat16 too (``apply.round_scales_as_xnnpack``); with
float32 scales a single 4-bit linear differs from its ``.pte`` by 1e-3 of the output range, with
bfloat16 ones by 2e-7. The unquantized model measures the scheme. ``report`` records, per tensor, how far the
quantized weight is from the float one. A tied head is untied first: the embedding and the head are
quantized for different kernels (as ExecuTorch's export does without a shared-embedding kernel).

A DFlash draft embeds with the target's table and projects with the target's head, so those are
quantized with the target; its own linears (``fc`` and its layers') stay in float unless
``quant.draft`` is true, which quantizes them in the target's scheme (int8 / int4; not
``from_checkpoint``: the GGUF holds no draft). Either way the output is the target's greedy output:
the draft only decides how many tokens a round keeps.
"""

from pipeline.errors import ConfigError
from pipeline.quant.formats import FLOAT, KEPT, weights_2d

XNNPACK_GROUP = 32  # XNNPACK's 4-bit groups are multiples of this


class Scheme:
    """``quant=none``: the weights in ``model.dtype``, nothing quantized. A scheme is a row of
    ``SCHEMES``: its refusals from the config (``check``), what it is in words (``describe``), the
    group size and reference its report records, and what it does to the model's weights (``apply``)."""

    name = "none"
    quantized = False
    reference = "the float weights"

    def check(self, quant_cfg, args, model_cfg, backend, quantizing: list[str], draft_name: str | None, validate_cfg) -> None:
        """Refuse what this build cannot make (``backend``: the Backend, ``quantizing``: the backends with
        quantized kernels; ``draft_name``: the draft's preset, None without one)."""
        if quant_cfg.draft:
            raise ConfigError(f"quant.draft=true with quant.scheme={quant_cfg.scheme}: there is no scheme to quantize the "
                              "draft with; choose quant=int8 or quant=int4, or drop quant.draft")

    def check_draft(self, quant_cfg, draft_args, draft_cfg) -> None:
        """Refuse a draft's quantization (``quant.draft``) this build cannot make."""

    def describe(self, quant_cfg) -> str:
        return "none"

    def group_size(self, quant_cfg) -> int:
        return quant_cfg.group_size

    def apply(self, model, quant_cfg, model_cfg) -> dict[str, str]:
        """Quantize ``model``'s weights in place; {module name: its format}."""
        return {}


class _Quantized(Scheme):
    quantized = True
    bits = 0

    def check(self, quant_cfg, args, model_cfg, backend, quantizing, draft_name, validate_cfg):
        scheme = quant_cfg.scheme
        for name in ("quant_tolerance", "max_mean_kld", "max_p99_kld", "max_ppl_ratio", "noise_margin"):
            if not validate_cfg[name] > 0:
                raise ConfigError(f"validate.{name}={validate_cfg[name]} must be positive")
        for name in ("noise_copies", "quality_tokens"):
            if not validate_cfg[name] >= (1 if name == "noise_copies" else 2):
                raise ConfigError(f"validate.{name}={validate_cfg[name]} must be at least {1 if name == 'noise_copies' else 2}")
        if not 0 <= validate_cfg.min_top1_agreement <= 1:
            raise ConfigError(f"validate.min_top1_agreement={validate_cfg.min_top1_agreement} must be a fraction in [0, 1]")
        if not backend.quantized_kernels:
            raise ConfigError(f"quant.scheme={scheme} needs backend={' or backend='.join(quantizing)} (its quantized "
                              f"kernels run the weights); backend={backend.name} runs quant=none only")
        if quant_cfg.draft and draft_name is None:
            raise ConfigError("quant.draft=true with draft=none: there is no draft to quantize; choose a draft "
                              "(draft=dflash) or drop quant.draft")
        if quant_cfg.head_bits not in (4, 8):
            raise ConfigError(f"quant.head_bits={quant_cfg.head_bits}: the head is 8-bit per channel (8) or in the "
                              "4-bit groups (4)")
        if scheme != "int4" and (quant_cfg.head_bits != 8 or quant_cfg.scales != "no_clipping"):
            keeps = "keeps the GGUF's blocks" if scheme == "from_checkpoint" else "is 8-bit per channel"
            raise ConfigError(f"quant.scales={quant_cfg.scales} / quant.head_bits={quant_cfg.head_bits} with "
                              f"quant={scheme}: they choose int4's group scales and head, and {scheme} {keeps}; leave "
                              "them at no_clipping / 8")
        if model_cfg.dtype != "float32":
            raise ConfigError(f"quant.scheme={scheme} with model.dtype={model_cfg.dtype}: the quantized kernels compute "
                              "in float32; use model.dtype=float32")
        self.check_groups(quant_cfg, args, model_cfg)

    def check_groups(self, quant_cfg, args, model_cfg) -> None:
        widths = linear_widths(args) | ({"tok_embeddings (its rows)": args.dim} if quant_cfg.embedding else {})
        self.check_widths(quant_cfg, widths, f"model {model_cfg.name}")

    def check_draft(self, quant_cfg, draft_args, draft_cfg):
        if not quant_cfg.draft:
            return
        try:
            self.check_widths(quant_cfg, draft_linear_widths(draft_args), f"draft {draft_cfg.name}")
        except ConfigError as e:
            raise ConfigError(f"{e}; or drop quant.draft (the draft's linears stay in float)") from None

    def check_widths(self, quant_cfg, widths: dict[str, int], owner: str) -> None:
        """4-bit weights: XNNPACK's groups are a multiple of 32 columns dividing every linear's input
        width; one scale per channel is a group of the whole width, so that width must be such a multiple.
        ``widths``: each kind of weight of ``owner`` (the model, or the draft) -> its input width."""
        group, scheme = self.group_size(quant_cfg), quant_cfg.scheme
        if group < 0 or group % XNNPACK_GROUP:
            raise ConfigError(f"quant.group_size={group} is not a multiple of {XNNPACK_GROUP} (XNNPACK's 4-bit groups) "
                              "nor 0 (one scale per output channel)")
        all_widths = sorted(set(widths.values()))
        if not group:
            bad = {name: w for name, w in widths.items() if w % XNNPACK_GROUP}
            if bad:
                name, width = next(iter(bad.items()))
                raise ConfigError(f"quant.scheme={scheme}: the input width {width} of {name} ({owner}) is not "
                                  f"a multiple of {XNNPACK_GROUP}, which XNNPACK's 4-bit kernels need; use quant=int8 or "
                                  "a model whose widths are multiples of 32")
            return
        bad = {name: w for name, w in widths.items() if w % group}
        if bad:
            name, width = next(iter(bad.items()))
            fits = [g for g in range(XNNPACK_GROUP, min(all_widths) + 1, XNNPACK_GROUP) if all(w % g == 0 for w in all_widths)]
            hint = (f"choose one that divides {', '.join(map(str, all_widths))} ({', '.join(map(str, fits))})"
                    if fits else f"no multiple of {XNNPACK_GROUP} divides all of {', '.join(map(str, all_widths))}: use quant=int8")
            raise ConfigError(f"quant.group_size={group} does not divide the input width {width} of {name} ({owner}); "
                              f"{hint}")

    def describe(self, quant_cfg):
        group = quant_cfg.group_size
        how = f"groups of {group}" if group else "per output channel"
        if self.bits == 4:
            how += f", {quant_cfg.scales} scales"
            head = ", the head int8 per channel" if quant_cfg.head_bits == 8 else ""
            return f"int4 weights ({how}){head}, int8 dynamic activations per token"
        return f"int{self.bits} weights ({how}), int8 dynamic activations per token"

    def apply(self, model, quant_cfg, model_cfg):
        return _quantize_float(model, quant_cfg, self.bits)

    def apply_draft(self, draft, quant_cfg) -> dict[str, str]:
        """Quantize the draft's own linears in place, as the target's; {module name: its format}."""
        return _quantize_linears(draft, quant_cfg, self.bits)


class Int8(_Quantized):
    """8-bit weights per output channel, 8-bit dynamic activations (XNNPACK qc8w)."""

    name, bits = "int8", 8

    def check_groups(self, quant_cfg, args, model_cfg):
        if quant_cfg.group_size != 0:
            raise ConfigError(f"quant.group_size={quant_cfg.group_size} with quant=int8: XNNPACK's 8-bit weights have one "
                              "scale per output channel; use quant.group_size=0 (or quant=int4 for groups)")

    def check_widths(self, quant_cfg, widths, owner):
        pass  # one scale per output channel: any input width


class Int4(_Quantized):
    """4-bit weights in groups of ``quant.group_size``, 8-bit dynamic activations (XNNPACK qb4w)."""

    name, bits = "int4", 4


class FromCheckpoint(_Quantized):
    """A GGUF's Q8_0 / Q4_0 / Q4_1 blocks kept as they are (``gguf.py``)."""

    name = "from_checkpoint"
    reference = "llama.cpp's dequantization of the GGUF"

    def check_groups(self, quant_cfg, args, model_cfg):
        check_checkpoint(model_cfg.checkpoint)
        super().check_groups(quant_cfg, args, model_cfg)

    def check_draft(self, quant_cfg, draft_args, draft_cfg):
        if quant_cfg.draft:
            raise ConfigError(f"quant.draft=true with quant=from_checkpoint: the GGUF holds the target's blocks, none of "
                              f"draft={draft_cfg.name}'s; drop quant.draft (the draft stays in float) or choose quant=int8 "
                              "or quant=int4")

    def group_size(self, quant_cfg):
        return XNNPACK_GROUP  # llama.cpp's blocks: 32 columns

    def describe(self, quant_cfg):
        return "the checkpoint's blocks (Q4_0 / Q4_1 / Q8_0, groups of 32), int8 dynamic activations"

    def apply(self, model, quant_cfg, model_cfg):
        from pipeline.quant.gguf import apply_blocks

        return apply_blocks(model, model_cfg, quant_cfg)


SCHEMES = {s.name: s for s in (Scheme(), Int8(), Int4(), FromCheckpoint())}  # quant.scheme (config.QuantScheme)


def scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        raise ConfigError(f"quant.scheme={name} is not a quantization scheme; choose one of {', '.join(SCHEMES)}")
    return SCHEMES[name]


def check_checkpoint(checkpoint: str | None) -> None:
    """``quant=from_checkpoint`` needs a GGUF whose matrices are Q4_0 / Q4_1 / Q8_0 (or float)."""
    from pathlib import Path

    if not checkpoint or not str(checkpoint).endswith(".gguf"):
        raise ConfigError(f"quant=from_checkpoint keeps a GGUF's quantized blocks, but model.checkpoint={checkpoint or 'null (random weights)'} "
                          "is not a .gguf file; choose quant=int8 or quant=int4 to quantize its weights")
    from pipeline.models.loaders.gguf import _reader

    kinds = {t.name: t.tensor_type.name for t in weights_2d(_reader(Path(checkpoint)))}
    other = {n: k for n, k in kinds.items() if k not in KEPT + FLOAT}
    if other:
        name, kind = next(iter(other.items()))
        raise ConfigError(f"quant=from_checkpoint: model.checkpoint={checkpoint} has tensor {name} in {kind}, which is "
                          f"not kept ({', '.join(KEPT)} are); choose quant=int4 or quant=int8 to requantize its "
                          "dequantized weights")
    if not any(k in KEPT for k in kinds.values()):
        raise ConfigError(f"quant=from_checkpoint: model.checkpoint={checkpoint} is not quantized (its weights are "
                          f"{', '.join(sorted(set(kinds.values())))}); choose quant=int8 or quant=int4 to quantize it")


def linear_widths(args) -> dict[str, int]:
    """Each kind of linear of the target -> its input width (what a group must divide)."""
    widths = {"attention.wq/wk/wv": args.dim, "attention.wo": args.n_heads * args.head_dim,
              "feed_forward.w1/w3": args.dim, "feed_forward.w2": args.hidden_dim, "output": args.dim}
    if args.attn_gate:
        widths["attention.wg"] = args.dim
    return widths


def draft_linear_widths(draft_args) -> dict[str, int]:
    """Each kind of linear of a DFlash draft (``models/dflash.py``) -> its input width."""
    return {"draft fc": draft_args.feature_dim, "draft attention.wq/wk/wv": draft_args.dim,
            "draft attention.wo": draft_args.n_heads * draft_args.head_dim, "draft feed_forward.w1/w3": draft_args.dim,
            "draft feed_forward.w2": draft_args.hidden_dim}


def check(quant_cfg, args, model_cfg, backend, quantizing: list[str], draft_name: str | None, validate_cfg) -> None:
    """Refuse a quantization this build cannot make, from the config alone (``Scheme.check``)."""
    scheme(quant_cfg.scheme).check(quant_cfg, args, model_cfg, backend, quantizing, draft_name, validate_cfg)


def check_draft(quant_cfg, draft_args, draft_cfg) -> None:
    """Refuse a draft's quantization (``quant.draft``) this build cannot make, from the config alone."""
    scheme(quant_cfg.scheme).check_draft(quant_cfg, draft_args, draft_cfg)


def describe(quant_cfg) -> str:
    return scheme(quant_cfg.scheme).describe(quant_cfg)


def _quantize_linears(model, quant_cfg, bits: int) -> dict[str, str]:
    """Every ``nn.Linear`` of ``model`` to torchao's 8-bit dynamic activations and ``bits``-bit weights
    (4 bits: ``quant.scales`` chooses each group's scale; the head, ``output``, in ``quant.head_bits``)."""
    import torch
    from torch import nn
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerAxis, PerGroup, quantize_

    group = 0 if bits == 8 else quant_cfg.group_size
    head8 = bits == 4 and quant_cfg.head_bits == 8
    quantize_(model, Int8DynamicActivationIntxWeightConfig(
        weight_dtype=getattr(torch, f"int{bits}"), weight_granularity=PerGroup(group) if group else PerAxis(0),
        **(_scales(quant_cfg.scales) if bits == 4 else {})),
        filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and not (head8 and fqn == "output"))
    if head8 and isinstance(getattr(model, "output", None), nn.Linear):
        quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
                  filter_fn=lambda m, fqn: fqn == "output")
    how = f"int{bits} g{group}" if group else f"int{bits} per channel"
    how += f", {quant_cfg.scales} scales as bf16" if bits == 4 else ""
    formats = {name: f"{how} (8da{bits}w)" for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if head8 and "output" in formats:
        formats["output"] = "int8 per channel (8da8w; quant.head_bits=8)"
    return formats


def _scales(choice: str) -> dict:
    """``quant.scales`` as torchao's arguments."""
    from torchao.quantization.quant_primitives import MappingType
    from torchao.quantization.quantize_.workflows.intx.intx_choose_qparams_algorithm import IntxChooseQParamsAlgorithm

    return {"symmetric": {"weight_mapping_type": MappingType.SYMMETRIC},
            "no_clipping": {"weight_mapping_type": MappingType.SYMMETRIC_NO_CLIPPING_ERR},
            "hqq": {"intx_choose_qparams_algorithm": IntxChooseQParamsAlgorithm.HQQ_SCALE_ONLY}}[str(choice)]


def _quantize_float(model, quant_cfg, bits: int) -> dict[str, str]:
    from pipeline.quant.embedding import QuantEmbedding

    group = 0 if bits == 8 else quant_cfg.group_size
    formats = _quantize_linears(model, quant_cfg, bits)
    if quant_cfg.embedding:
        dim = model.args.dim
        model.tok_embeddings = QuantEmbedding.quantize(model.tok_embeddings.weight, bits, group or dim)
        formats["tok_embeddings"] = f"int{bits} {'g' + str(group) if group else 'per row'} (embedding_{'byte' if bits == 8 else '4bit'})"
    return formats
