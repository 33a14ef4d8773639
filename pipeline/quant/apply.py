"""A model quantized in place by its scheme (``quant.scheme``; the draft's own linears with
``quant.draft``), and the report the manifest and build.json record: each quantized tensor's format
and its error against the float weight. The 4-bit scales are rounded to bfloat16 as XNNPACK holds
them, so the eager model computes with the weights the ``.pte`` computes with."""

from pipeline.quant import scheme


def quantize(model, quant_cfg, model_cfg) -> dict:
    """Quantize ``model`` (the target, float32) in place as ``quant_cfg`` says; the report for the
    manifest and build.json: the scheme, the group size and every quantized tensor's error."""
    from torch import nn

    chosen = scheme(quant_cfg.scheme)
    if not chosen.quantized:
        return {"scheme": chosen.name}
    # every weight a scheme may quantize, as it was: the report's reference
    floats = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    if model.output is None:  # untie: the head becomes a linear of its own, quantized as the others
        model.output = nn.Linear(model.args.dim, model.args.vocab_size, bias=False)
        model.output.weight = nn.Parameter(floats["tok_embeddings"].clone(), requires_grad=False)
        floats["output"] = floats["tok_embeddings"]
    tensors = _apply(model, lambda: chosen.apply(model, quant_cfg, model_cfg), floats)
    return {"scheme": chosen.name, "group_size": chosen.group_size(quant_cfg),
            "embedding": bool(quant_cfg.embedding), "describe": chosen.describe(quant_cfg), "reference": chosen.reference,
            "tensors": tensors, "max_relative_rms_error": max(t["relative_rms_error"] for t in tensors.values())}


def quantize_draft(draft, quant_cfg) -> dict:
    """``quant.draft``: quantize a draft's own linears (float32) in place in the target's scheme; the
    report's ``draft`` entry: what they became and every quantized tensor's error against its float weight."""
    from torch import nn

    chosen = scheme(quant_cfg.scheme)
    floats = {name: m.weight.detach().clone() for name, m in draft.named_modules() if isinstance(m, nn.Linear)}
    tensors = _apply(draft, lambda: chosen.apply_draft(draft, quant_cfg), floats)
    return {"describe": f"the draft's own linears: {chosen.describe(quant_cfg)}", "tensors": tensors,
            "max_relative_rms_error": max(t["relative_rms_error"] for t in tensors.values())}


def _apply(model, apply, floats: dict) -> dict:
    """Run ``apply`` (the scheme's quantization of ``model``, -> {module name: format}), round the
    4-bit scales as XNNPACK does, and report each quantized tensor against ``floats``."""
    import torch

    with torch.no_grad():
        formats = apply()
        round_scales_as_xnnpack(model)
    _drop_instance_reprs(model)
    return {name: {"format": formats[name], **error_stats(dequantized(model, name), floats[name])} for name in formats}


def round_scales_as_xnnpack(model) -> int:
    """Round the scales of every 4-bit linear weight to bfloat16, in place, as XNNPACK's qb4w / qc4w
    kernels hold them (the integers are kept as they are); the oracle then computes with the weights
    the ``.pte`` computes with. 8-bit weights keep float32 scales (qc8w). Returns the count rounded."""
    import torch
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import IntxUnpackedToInt8Tensor

    rounded = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, IntxUnpackedToInt8Tensor) and weight.target_dtype == torch.int4:
            weight.scale.copy_(weight.scale.to(torch.bfloat16).float())
            rounded += 1
    return rounded


def dequantized(model, name: str):
    """The weight of module ``name`` as the quantized model computes with it, in float."""
    module = model.get_submodule(name)
    if hasattr(module, "dequantize"):  # QuantEmbedding, gguf.OffsetLinear
        return module.dequantize()
    weight = module.weight
    return weight.dequantize() if hasattr(weight, "dequantize") else weight.detach()


def error_stats(got, want) -> dict:
    """A quantized weight against its float reference."""
    got, want = got.float(), want.float()
    diff = got - want
    rms = float(diff.pow(2).mean().sqrt())
    return {"max_abs_error": float(diff.abs().max()), "rms_error": rms,
            "relative_rms_error": rms / max(float(want.pow(2).mean().sqrt()), 1e-30), "bit_exact": bool(diff.abs().max() == 0)}


def _drop_instance_reprs(model) -> None:
    # torchao sets a bound extra_repr on each module it quantizes; the bound partial cannot be pickled
    # (the stage cache saves the eager model with torch.save), and it only prints
    for module in model.modules():
        module.__dict__.pop("extra_repr", None)
