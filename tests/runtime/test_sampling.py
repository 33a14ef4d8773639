"""Sampling against the distribution it claims: the tempered, truncated distribution exactly (float64),
draws against it by a chi-square test, and speculative rounds under the rejection rule against the
target's own sequential distribution, over many seeds on a five-token vocabulary; each test also
shows it fails on a planted bias."""

import itertools

import pytest
import torch

from pipeline.errors import SessionError
from pipeline.runtime.sampling import Greedy, Sampler, SamplingParams, accepted_length, policy

V = 5
LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
ALPHA = 1e-3  # a correct sampler fails a test one run in a thousand


def chi_square_p(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    """P(chi-square >= the statistic) for ``counts`` against ``expected_p`` (cells with p > 0)."""
    n = counts.sum()
    keep = expected_p > 0
    assert counts[~keep].sum() == 0, "a draw fell where the distribution is zero"
    expected = expected_p[keep].double() * n
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def test_distribution_is_tempered_and_truncated_exactly():
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.8, seed=0)
    got = Sampler(params).distribution(LOGITS)
    p = torch.softmax(LOGITS.double() / 0.7, -1)
    order = p.argsort(descending=True).tolist()
    kept = order[:4]  # top_k
    p_k = torch.zeros_like(p)
    p_k[kept] = p[kept] / p[kept].sum()
    nucleus, mass = [], 0.0  # the smallest prefix reaching top_p
    for i in order:
        if p_k[i] == 0 or mass >= 0.8:
            break
        nucleus.append(i)
        mass += float(p_k[i])
    want = torch.zeros_like(p)
    want[nucleus] = p_k[nucleus] / p_k[nucleus].sum()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert len(nucleus) == 2  # the case truncates by both rules


def _draws(sampler: Sampler, n: int) -> torch.Tensor:
    return torch.bincount(torch.tensor([sampler.sample(LOGITS) for _ in range(n)]), minlength=V)


def test_draws_follow_the_distribution_and_a_biased_sampler_fails():
    sampler = Sampler(SamplingParams(temperature=1.3, top_k=4, seed=1))
    want = sampler.distribution(LOGITS)
    assert chi_square_p(_draws(sampler, 20000), want) > ALPHA
    biased = Sampler(SamplingParams(temperature=1.3, top_k=4, seed=1))
    biased.distribution = lambda logits: want * torch.tensor([1.1, 1, 1, 1, 1], dtype=torch.float64)  # 10% on token 0
    assert chi_square_p(_draws(biased, 20000), want) < ALPHA


def test_a_seed_alone_decides_the_draws():
    a, b = (Sampler(SamplingParams(seed=7)) for _ in range(2))
    other = Sampler(SamplingParams(seed=8))
    first = [a.sample(LOGITS) for _ in range(50)]
    [other.sample(LOGITS) for _ in range(13)]  # another sequence's draws in between change nothing
    assert first == [b.sample(LOGITS) for _ in range(50)]
    assert first != [other.sample(LOGITS) for _ in range(50)]


def test_bad_parameters_are_refused_naming_them():
    for kwargs, name in (({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
                         ({"temperature": float("nan")}, "temperature")):
        with pytest.raises(SessionError, match=name):
            SamplingParams(**kwargs)
    assert isinstance(policy(SamplingParams(temperature=0)), Greedy)


# --- speculative rounds: a toy target whose next-token distribution depends on the whole prefix, and a
# DFlash-like draft proposing every position of its block at once from fixed distributions ---

def target_logits(prefix: tuple) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(prefix) % (2 ** 31))
    return torch.randn(V, generator=g, dtype=torch.float64) * 1.5


DRAFT_LOGITS = torch.tensor([[1.0, 0.0, 0.5, -0.5, 0.2], [0.0, 1.5, 0.0, 0.3, -1.0], [0.3, 0.3, 1.0, 0.0, 0.0]],
                            dtype=torch.float64)


def speculative_pair(seed: int, params: SamplingParams) -> tuple[int, int]:
    """The first two tokens after the empty prefix, by speculative rounds of blocks of 3 proposals."""
    sampler = Sampler(SamplingParams(params.temperature, params.top_p, params.top_k, seed))
    out: list[int] = []
    while len(out) < 2:
        proposals = sampler.propose(DRAFT_LOGITS)
        block = [-1, *proposals]  # the fed token (unused by the toy target) and the proposals
        logits = torch.stack([target_logits(tuple(out + proposals[:i])) for i in range(len(block))])
        accepted, token = sampler.verify(block, logits, DRAFT_LOGITS)
        out += proposals[:accepted] + [token]
    return out[0], out[1]


def pair_distribution(params: SamplingParams) -> torch.Tensor:
    sampler = Sampler(SamplingParams(params.temperature, params.top_p, params.top_k, 0))
    first = sampler.distribution(target_logits(()))
    return torch.stack([first[a] * sampler.distribution(target_logits((a,))) for a in range(V)]).reshape(-1)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=3)],
                         ids=["t1", "t0.8-top3"])
def test_speculative_rounds_keep_the_target_distribution(params):
    n = 6000
    counts = torch.zeros(V * V, dtype=torch.int64)
    for seed in range(n):
        a, b = speculative_pair(seed, params)
        counts[a * V + b] += 1
    assert chi_square_p(counts, pair_distribution(params)) > ALPHA


def test_speculative_rounds_with_plain_resampling_fail(monkeypatch):
    """Replacing the residual norm(max(0, p - q)) by p itself biases the output toward the draft."""
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(Sampler, "residual", staticmethod(lambda p, q: p))
    counts = torch.zeros(V * V, dtype=torch.int64)
    for seed in range(6000):
        a, b = speculative_pair(seed, params)
        counts[a * V + b] += 1
    assert chi_square_p(counts, pair_distribution(params)) < ALPHA


def test_greedy_verification_is_the_greedy_acceptance():
    for block in itertools.product(range(3), repeat=4):
        logits = torch.stack([target_logits(block[:i]) for i in range(4)])
        greedy = logits.argmax(-1).tolist()
        accepted, token = Greedy().verify(list(block), logits, DRAFT_LOGITS)
        assert accepted == accepted_length(list(block), greedy) and token == greedy[accepted]
