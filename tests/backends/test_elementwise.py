"""Each elementwise op the model families use, lowered to each CPU backend the way compile lowers a
method (the backend's decompositions, its partitioners, ExecuTorch's runtime), against eager torch in
fp32 on fresh random inputs: the backend must compute what torch computes, to fp32 rounding.

A backend that swaps an op's definition shows here first: ExecuTorch 1.5.1's XNNPACK takes every
``gelu`` and computes the erf form, so a tanh-GELU delegated whole is 4.7e-4 away (Gemma 3 failed
validation); ``Xnnpack.inlined`` writes it as its formula (``test_the_tanh_gelu_delegated_whole_is_not_exact``
shows the defect that this check catches)."""

import pytest
import torch
from torch.nn import functional as F

from pipeline.backends import backend
from pipeline.models.transformer import RMSNorm

CPU_BACKENDS = ["xnnpack", "portable"]
# fp32 rounding: XNNPACK's tanh, sigmoid and exp are within a few ulp of torch's; relative to the output's
# largest magnitude (an absolute error where it is near 0)
BOUND = 2e-6


class Op(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _norm(x):
    norm = RMSNorm(x.shape[-1], 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, x.shape[-1]))
    return norm(x)


# name -> (function, input scale): the families' activations, gates, norms and soft caps
OPS = {
    "silu": (F.silu, 4.0),  # SwiGLU (Llama, Qwen, Phi, SmolLM, Mistral)
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), 4.0),  # GeGLU (Gemma 3), SmolVLM's vision MLP
    "gelu": (F.gelu, 4.0),  # the exact (erf) form
    "sigmoid_gate": (lambda x: torch.sigmoid(x) * x, 4.0),  # an attention output gate
    "rms_norm": (lambda x: _norm(x.view(1, *x.shape)).view(x.shape), 3.0),  # mean of squares, rsqrt, scale
    "rms_norm_unit_offset": (lambda x: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * (1 + torch.linspace(-0.5, 0.5, x.shape[-1])), 3.0),
    "softcap": (lambda x: 30.0 * torch.tanh(x / 30.0), 60.0),  # logit soft-capping (Gemma 2's)
    "softmax": (lambda x: torch.softmax(x, -1), 8.0),
}


def lower_and_run(backend_name: str, fn, x: torch.Tensor) -> torch.Tensor:
    """``fn`` exported over a dynamic first axis, lowered as compile lowers a method on ``backend_name``
    (its decompositions and partitioners, ExecuTorch's edge and runtime), run on ``x``."""
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.runtime import Runtime

    chosen = backend(backend_name)
    rows = torch.export.Dim("rows", min=2, max=256)
    ep = torch.export.export(Op(fn), (x[:4],), dynamic_shapes=({0: rows},))
    programs = chosen.programs({"forward": ep})
    partitioners = chosen.partitioners(["forward"])
    edge = to_edge_transform_and_lower(programs, partitioner=partitioners,
                                       compile_config=EdgeCompileConfig(_check_ir_validity=chosen.edge_ir_check))
    buffer = edge.to_executorch().buffer  # held: the program reads it while it lives
    program = Runtime.get().load_program(buffer)
    return program.load_method("forward").execute([x])[0].clone()


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1.0))


@pytest.mark.parametrize("backend_name", CPU_BACKENDS)
@pytest.mark.parametrize("name", list(OPS))
def test_each_elementwise_op_lowers_to_what_torch_computes(backend_name, name):
    fn, scale = OPS[name]
    x = torch.randn(64, 96) * scale  # fresh each run: the bound is fp32 rounding, not a calibration
    with torch.no_grad():
        want = fn(x)
    got = lower_and_run(backend_name, fn, x)
    assert got.shape == want.shape
    assert error(got, want) <= BOUND, f"{name} on {backend_name}: {error(got, want):.2e} from eager torch"


def test_the_tanh_gelu_delegated_whole_is_not_exact(monkeypatch):
    """Without the decomposition (XNNPACK's own GELU), the check above fails: the erf form's values."""
    from pipeline.backends import Backend
    from pipeline.backends.xnnpack import Xnnpack

    monkeypatch.setattr(Xnnpack, "inlined", Backend.inlined)
    x = torch.randn(64, 96) * 4.0
    got = lower_and_run("xnnpack", OPS["gelu_tanh"][0], x)
    with torch.no_grad():
        assert error(got, F.gelu(x, approximate="tanh")) > 10 * BOUND  # ~4e-5 of the largest value, 5e-4 absolute
        assert error(got, F.gelu(x)) <= BOUND  # what XNNPACK computed: the exact GELU


def _kv_quantized(x):
    from pipeline.kv.quantize import EAGER, quantize

    q, scale = quantize(EAGER, x)
    return torch.cat([q.to(torch.float32), scale], -1)


@pytest.mark.parametrize("backend_name", CPU_BACKENDS)
def test_kv_quantizer_lowers_to_what_the_oracle_computes(backend_name):
    """The 8-bit KV store's rounding (kv/quantize.py), as lower_kv writes it into the program, gives the
    eager oracle's integers and scales exactly: a rounding that differed would make the oracle's cache
    another cache. Rows of every magnitude, an all-zero one, and values on a rounding tie."""
    x = torch.randn(64, 96) * torch.logspace(-3, 3, 64)[:, None]
    x[5] = 0
    x[7, :2] = torch.tensor([127.0, 63.5])  # scale 1: 63.5 rounds half to even (64)
    with torch.no_grad():
        want = _kv_quantized(x)
    got = lower_and_run(backend_name, _kv_quantized, x)
    assert torch.equal(got, want), f"{(got != want).sum()} of {got.numel()} values differ"
    assert want[7, 1] == 64 and not want[5, :96].any()
