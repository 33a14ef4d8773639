"""The 8-bit KV cache (kv.dtype=int8) as a user builds it: both layouts on XNNPACK, the default backend, and on portable,
validated as a lossy artifact (exactness against the oracle whose caches round as the store, quality
against float32 caches); its bytes counted; refused where it cannot run, from the config alone."""

import json

import pytest
import torch

from conftest import compose_config
from pipeline.build.plan import plan_of
from pipeline.errors import ConfigError

LAYOUTS = {  # case: (the manifest's layout, the build's overrides)
    "batched-sequence": ("batched-sequence", ("kv=sequence", "kv.max_seqs=3", "kv.dtype=int8", "validate.decode_steps=16",
                                              "experiment_name=kv8")),
    "cell": ("cell", ("kv=cell", "kv.max_seqs=3", "kv.dtype=int8", "validate.decode_steps=16", "experiment_name=kv8_cell")),
    # portable runs the integers' conversion (quantized_decomposed::dequantize_per_tensor) with ExecuTorch's
    # quantized kernels, which XNNPACK takes into its delegate: the first build failed here, not there
    "portable": ("batched-sequence", ("backend=portable", "kv=sequence", "kv.max_seqs=3", "kv.dtype=int8",
                                      "validate.decode_steps=16", "experiment_name=kv8_portable")),
}


@pytest.mark.parametrize("case", LAYOUTS)
def test_int8_cache_builds_and_validates(build_dir, case):
    layout, overrides = LAYOUTS[case]
    version = build_dir(*overrides)
    report = json.loads((version / "validation.json").read_text())
    assert report["passed"] and report["scenario"]["layout"] == layout
    quant = report["quant"]
    assert quant["scheme"] == "none" and quant["kv_dtype"] == "int8"
    exact = quant["exactness"]["pte_vs_oracle"]
    assert exact["median"] <= 1e-4  # the oracle's caches round as the store does: fp32-sized errors
    assert quant["quality"]["bounds"]["max_mean_kld"] == compose_config("kv.dtype=int8").validate.max_mean_kld
    manifest = json.loads((version / "manifest.json").read_text())["target"]
    assert manifest["dtype"] == "int8"
    # the stores' and scales' bytes (tests/build/test_runner.py holds them to the program's planned buffers)
    assert manifest["kv_bytes_total"] == sum(plan_of(compose_config(*overrides)).target.layout.kv_bytes_per_layer())


def test_int8_cache_bytes_and_refusals():
    """A token's K and V take D + 4 bytes a head (the scale) instead of 4 D; CUDA refuses the cache in one
    line; a draft's stores stay float32."""
    f32 = plan_of(compose_config("kv=sequence", "kv.max_seqs=4")).target.layout
    q8 = plan_of(compose_config("kv=sequence", "kv.max_seqs=4", "kv.dtype=int8")).target.layout
    assert q8.quantized and not f32.quantized
    assert sum(q8.kv_bytes_per_layer()) * 4 * f32.head_dim == sum(f32.kv_bytes_per_layer()) * (f32.head_dim + 4)
    with pytest.raises(ConfigError, match=r"kv.dtype=int8: backend=cuda has no 8-bit KV cache") as err:
        plan_of(compose_config("kv.dtype=int8", "backend=cuda", "stages=[export,lower_kv]"))
    assert "\n" not in str(err.value)
    drafted = plan_of(compose_config("draft=dflash", "kv.max_seqs=2", "kv.dtype=int8"))
    assert drafted.target.layout.dtype == "int8" and drafted.parts["draft"].layout.dtype == "float32"


def test_attention_folds_the_scales_as_dequantizing_would():
    """sdpa_gather_q8 over 8-bit stores equals sdpa_gather over the dequantized stores, on fresh random
    inputs against float64: the scales folded into the scores and the weights change nothing but rounding."""
    from pipeline.kernels.reference import sdpa_gather_q8_reference, sdpa_gather_reference
    from pipeline.kv.quantize import EAGER, dequantize, quantize

    gen = torch.Generator().manual_seed(0)
    slots, n_kv, d, hq = 40, 2, 16, 6
    k, v = torch.randn(slots, n_kv, d, generator=gen) * 3, torch.randn(slots, n_kv, d, generator=gen)
    (kq, ks), (vq, vs) = quantize(EAGER, k), quantize(EAGER, v)
    q = torch.randn(5, hq, d, generator=gen)
    q_pos = torch.tensor([30, 31, 32, 33, 12])
    # tokens 0-3: a block over slots 0..33; token 4 alone over slots 20..32 (positions 0..12)
    block_q, block = torch.tensor([0, 1, 2, 3]), torch.stack([torch.arange(34), torch.arange(34)])
    one = torch.stack([torch.arange(20, 33), torch.arange(13), torch.full((13,), 4)])[None]
    out_rows = torch.tensor([1, 2, 3, 4, 0])
    args = (q_pos, one, block_q, block, out_rows, d ** -0.5, True, 0)
    got = sdpa_gather_q8_reference(q, kq, ks.view(slots, n_kv), vq, vs.view(slots, n_kv), *args)
    want = sdpa_gather_reference(q.double(), dequantize(kq, ks).double(), dequantize(vq, vs).double(), *args)
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    unscaled = sdpa_gather_reference(q.double(), kq.double(), vq.double(), *args)  # the scales forgotten
    assert float((unscaled - want).abs().max()) > 0.1 * float(want.abs().max())
