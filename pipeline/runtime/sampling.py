"""Choosing tokens from logits, per sequence: greedy, or sampled with temperature, top-k and top-p from
the sequence's own random generator (so a sequence's tokens depend on its seed and its logits alone,
never on which other sequences share its steps); and the speculative rule over a draft's block.

Speculative rounds (``Session.speculate``) take a policy per sequence: ``propose`` turns the draft's
logits into proposals and ``verify`` decides how many the target keeps and the token after them.
``Greedy`` keeps the proposals equal to the target's greedy choice (its output is the target's greedy
output); ``Sampler`` draws the proposals from the draft's distribution q and keeps proposal x with
probability min(1, p(x)/q(x)) under the target's distribution p; on a rejection it draws from the
residual norm(max(0, p - q)), after a whole block it draws the bonus token from p: the standard
rejection rule, whose output has the target's distribution (Leviathan et al., Chen et al. 2023).
"""

import math
from dataclasses import dataclass

import torch

from pipeline.errors import SessionError


@dataclass(frozen=True)
class SamplingParams:
    """How a sequence chooses its tokens. ``temperature == 0``: greedy (top_k, top_p and seed unused)."""

    temperature: float = 1.0
    top_p: float = 1.0  # the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # the k most likely tokens; 0: all
    seed: int | None = None  # None: drawn from the system's entropy

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise SessionError(f"temperature={self.temperature!r} must be a finite number >= 0 (0: greedy)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise SessionError(f"top_p={self.top_p!r} must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SessionError(f"top_k={self.top_k!r} must be an integer >= 0 (0: no limit)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def accepted_length(block: list[int], greedy: list[int]) -> int:
    """How many proposals of ``block`` (its first token fed, then the proposals) the target's greedy
    tokens ``greedy`` (one per block row) agree with, from the first on: the one greedy acceptance rule
    of the session (``Greedy.verify``) and of the eager reference (``runtime/speculative.py``)."""
    accepted = 0
    while accepted < len(block) - 1 and block[accepted + 1] == greedy[accepted]:
        accepted += 1
    return accepted


def policy(params: SamplingParams) -> "Greedy | Sampler":
    """The token policy of ``params``: ``Greedy`` at temperature 0, else a ``Sampler`` seeded once."""
    return Greedy() if params.greedy else Sampler(params)


class Greedy:
    """The most likely token, always: no randomness."""

    def sample(self, logits: torch.Tensor) -> int:
        return int(logits.argmax())

    def propose(self, draft_logits: torch.Tensor) -> list[int]:
        return draft_logits.argmax(-1).tolist()

    def verify(self, block: list[int], logits: torch.Tensor, draft_logits: torch.Tensor) -> tuple[int, int]:
        """(proposals kept, the token after them) for ``block`` (the fed token, then the proposals) and
        the target's ``logits`` for every row of it: the proposals equal to the target's greedy tokens."""
        greedy = logits.argmax(-1).tolist()
        accepted = accepted_length(block, greedy)
        return accepted, greedy[accepted]


class Sampler:
    """Sampling from the tempered, truncated distribution, with the sequence's own generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The probabilities [..., vocab] (float64) the sampler draws from: softmax(logits / temperature),
        restricted to the top_k most likely tokens and then to the smallest set reaching top_p, renormalised."""
        p = torch.softmax(logits.double() / self.params.temperature, dim=-1)
        k = self.params.top_k
        if k and k < p.shape[-1]:
            kth = p.topk(k, dim=-1).values[..., -1:]
            p = torch.where(p >= kth, p, 0.0)
        if self.params.top_p < 1:
            sorted_p, order = p.sort(dim=-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p  # the mass of the more likely tokens
            keep = before < self.params.top_p * sorted_p.sum(-1, keepdim=True)  # the first token is always kept
            p = torch.zeros_like(p).scatter(-1, order, torch.where(keep, sorted_p, 0.0))
        return p / p.sum(-1, keepdim=True)

    def draw(self, p: torch.Tensor) -> int:
        """One token from the probabilities ``p`` [vocab] (one uniform draw: inverse CDF)."""
        u = torch.rand((), generator=self.generator, dtype=torch.float64)
        cdf = p.cumsum(0)
        index = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
        return min(index, int(p.nonzero()[-1]))  # rounding at the top end lands on the last possible token

    def sample(self, logits: torch.Tensor) -> int:
        return self.draw(self.distribution(logits))

    def propose(self, draft_logits: torch.Tensor) -> list[int]:
        return [self.sample(row) for row in draft_logits]

    def verify(self, block: list[int], logits: torch.Tensor, draft_logits: torch.Tensor) -> tuple[int, int]:
        """The rejection rule: proposal i is kept with probability min(1, p_i(x) / q_i(x)); the first one
        rejected is replaced by a draw from norm(max(0, p_i - q_i)); after a block kept whole, the bonus
        token is drawn from the next row's p."""
        for i, x in enumerate(block[1:]):
            p, q = self.distribution(logits[i]), self.distribution(draft_logits[i])
            u = torch.rand((), generator=self.generator, dtype=torch.float64)
            if q[x] > 0 and u * q[x] < p[x]:  # u < p/q, without dividing
                continue
            return i, self.draw(self.residual(p, q))
        n = len(block) - 1
        return n, self.sample(logits[n])


    @staticmethod
    def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """What a rejected proposal is replaced from: max(0, p - q) (``draw`` normalises it); p where
        q covers p everywhere (then no proposal is ever rejected but by rounding)."""
        residual = (p - q).clamp(min=0)
        return residual if residual.sum() > 0 else p


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under the model's distribution (log-softmax of the raw logits:
    before temperature and truncation, as OpenAI's API reports them) and the ``k`` most likely tokens with theirs."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    top = logp.topk(k) if k else None
    return float(logp[token]), ([] if top is None else list(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
