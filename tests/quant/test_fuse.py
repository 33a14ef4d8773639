"""models/fuse.py: q/k/v and gate/up as one linear each, in every weight format a target's linears
take, compute what the separate linears computed (a row's dot product does not depend on the rows
beside it); parts that are not alike stay apart."""

import copy

import pytest
import torch
from test_quant import QUANT_MODEL, _gguf_config
from torch import nn

from conftest import compose_config
from pipeline.kv.op import ReferenceCache, reference_cache
from pipeline.models.fuse import Projections, fuse_projections, stacked
from pipeline.models.methods import build_target
from pipeline.quant.apply import quantize


def _logits(model, tokens: list[int]) -> torch.Tensor:
    with reference_cache(ReferenceCache(model.args.layer_kv(), causal=True)), torch.no_grad():
        return model.logits(model.hidden(model.embed(torch.tensor(tokens)), torch.arange(len(tokens))))


@pytest.mark.parametrize("scheme", ["none", "int8", "int4", "from_checkpoint"])
def test_fused_model_computes_what_the_separate_linears_did(tmp_path, scheme):
    if scheme == "from_checkpoint":  # Q4_1 blocks: OffsetLinear
        cfg = _gguf_config(tmp_path, "Q4_1")[0]
    else:
        cfg = compose_config(*QUANT_MODEL, f"quant={scheme}")
    model, _ = build_target(cfg.model, None)
    quantize(model, cfg.quant, cfg.model)
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 2 * model.args.n_layers
    attention, ffn = fused.layers[0].attention, fused.layers[0].feed_forward
    assert isinstance(attention.fused, Projections) and not hasattr(attention, "wq") and not hasattr(ffn, "w1")
    tokens = torch.randint(0, cfg.model.vocab_size, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    want, got = _logits(model, tokens), _logits(fused, tokens)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), scheme


def test_unlike_parts_stay_apart():
    a, b = nn.Linear(8, 4, bias=True), nn.Linear(8, 4, bias=False)
    assert stacked([a, b]) is None  # a bias on one only
    assert stacked([nn.Linear(8, 4), nn.Linear(6, 4)]) is None  # other inputs
    cfg = compose_config(*QUANT_MODEL, "quant=int8")
    model, _ = build_target(cfg.model, None)
    quantize(model, cfg.quant, cfg.model)
    attention = model.layers[0].attention
    assert stacked([attention.wq, nn.Linear(attention.wq.in_features, 4)]) is None  # 8-bit beside float
    one = stacked([attention.wq, attention.wk])
    x = torch.randn(3, attention.wq.in_features)
    with torch.no_grad():
        assert torch.equal(one(x), torch.cat([attention.wq(x), attention.wk(x)], -1))
