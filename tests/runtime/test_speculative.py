"""Greedy speculative decoding (pipeline/runtime/speculative.py) against dflash's own loop,
``dflash_generate(temperature=0)``, on a tiny random transformers Qwen3 target: the same tokens and
the same acceptance lengths; and the same tokens as the target's plain greedy decoding."""

import time

import pytest
import torch

from conftest import compose_config
from pipeline.build.plan import resolve_model
from pipeline.models.args import model_args
from pipeline.models.families import family
from pipeline.models.loaders import load_into
from pipeline.models.transformer import build_model
from pipeline.runtime.speculative import greedy_generate, speculative_generate
from test_dflash import reference_and_ours

dflash = pytest.importorskip("dflash.model")
transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 3, 9], [1, 2, 3, 4, 5, 6, 7], [30, 12], [8, 8, 21, 0, 14, 27, 2, 19, 11]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A transformers Qwen3 target (8 layers, the draft taps 1 and 5) saved and loaded by us; the
    draft of test_dflash (its reference and ours), sharing the target's embeddings and head."""
    path = tmp_path_factory.mktemp("qwen3")
    config = transformers.Qwen3Config(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(5)
    hf = transformers.Qwen3ForCausalLM(config).eval()
    # weights chosen so that the test means something: unit embeddings and head with small layers give
    # continuations that vary (9 to 17 distinct tokens of 24), and a draft whose layers are nearly the
    # identity (below) then proposes the target's next token now and then (acceptance lengths of 2)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) if "embed" in name or "lm_head" in name else 0.04 * torch.randn_like(p))
    hf.save_pretrained(path)
    cfg = resolve_model(compose_config(f"+model.checkpoint={path}"), [])
    target = build_model(model_args(cfg.model), 0)
    load_into(target, str(path), family(cfg.model.family))
    ref_draft, draft = reference_and_ours(vocab_size=32)
    with torch.no_grad():
        for model in (ref_draft, draft):  # the same scaling of both copies
            for name, p in model.named_parameters():
                if name.startswith("layers.") and "norm" not in name:
                    p.mul_(0.005 / 0.08)
    return hf, target, ref_draft, draft


def dflash_reference(hf, ref_draft, prompt, n, monkeypatch):
    monkeypatch.setattr(dflash, "_cuda_time", time.perf_counter)  # its timer synchronises CUDA
    stats = dflash.dflash_generate(ref_draft, hf, torch.tensor([prompt]), n, None, temperature=0.0, return_stats=True)
    return stats.output_ids[0, len(prompt):].tolist(), stats.acceptance_lengths


def test_speculative_equals_dflash_generate_and_greedy(pair, monkeypatch):
    hf, target, ref_draft, draft = pair
    accepted = []
    for prompt in PROMPTS:
        want_tokens, want_accept = dflash_reference(hf, ref_draft, prompt, 24, monkeypatch)
        got = speculative_generate(target, draft, prompt, 24)
        assert got.tokens == want_tokens, prompt
        assert got.acceptance_lengths == want_accept, prompt
        assert got.tokens == greedy_generate(target, prompt, 24), prompt
        assert len(set(got.tokens)) > 4, "a continuation that repeats a token proves little"
        accepted += got.acceptance_lengths
    assert max(accepted) > 1, "some proposals accepted: the acceptance bookkeeping is exercised"


def test_acceptance_varies_with_the_proposals(pair):
    """An oracle draft (the target's own greedy continuation) is accepted whole, block after block;
    a corrupted one less; the tokens never change."""
    _, target, _, draft = pair
    prompt, n = PROMPTS[0], 25
    greedy = greedy_generate(target, prompt, n)
    full = prompt + greedy

    def oracle(start, proposals):
        return full[start + 1: start + 1 + len(proposals)]

    def corrupted(start, proposals):
        return [t if (start + i) % 3 else (t + 1) % 32 for i, t in enumerate(oracle(start, proposals))]

    best = speculative_generate(target, draft, prompt, n, propose=oracle)
    assert best.tokens == greedy and best.acceptance_lengths[:-1] == [draft.args.block_size] * (len(best.acceptance_lengths) - 1)
    worse = speculative_generate(target, draft, prompt, n, propose=corrupted)
    assert worse.tokens == greedy and len(worse.acceptance_lengths) > len(best.acceptance_lengths)
