"""A request as the engine holds it (its prompt, sampling, stop strings, the state of its generation)
and what the engine tells its client (``Event``s of ``Token``s). Its text is made by a
``detokenize.Detokenizer`` as tokens arrive."""

import itertools
import time
from dataclasses import dataclass, field

from pipeline.runtime.sampling import SamplingParams
from pipeline.serve.detokenize import Detokenizer


@dataclass
class Token:
    """One generated token, with its log-probability and the most likely alternatives when asked."""

    id: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Event:
    """What the engine tells a request's client: ``tokens`` (text so far), then ``done`` (finish_reason,
    usage) or ``error`` (status, message, code)."""

    kind: str  # tokens | done | error
    tokens: list[Token] = field(default_factory=list)
    text: str = ""  # the new text these tokens give (after stop-string holding)
    finish_reason: str | None = None
    usage: dict | None = None
    status: int = 500
    message: str = ""
    code: str | None = None


@dataclass
class Request:
    """One generation: its prompt as token ids, its images, how it samples and when it stops."""

    prompt: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: none; k >= 0: each token's logprob and the k most likely
    images: list = field(default_factory=list)  # PIL images, spliced over the prompt's placeholder tokens in order
    emit: object = None  # callable(Event), called from the engine thread
    deadline: float | None = None  # time.monotonic() past which the request ends with a timeout
    ignore_eos: bool = False  # EOS neither ends it nor is left out of its text: it runs to max_tokens
    id: int = field(default_factory=itertools.count().__next__)
    # engine-side state
    cancelled: bool = False
    finished: bool = False
    generated: list[int] = field(default_factory=list)
    detokenizer: Detokenizer | None = None  # its text so far, made at its first tokens
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    proposed: int = 0  # speculative proposals the target verified for this request
    accepted: int = 0  # ... and kept
    rounds: int = 0
    chooser: object = None
    cached: int = 0  # prompt tokens a released sequence's rows held (the prefix cache): not prefilled

    def cancel(self) -> None:
        """The client went away: the engine releases the sequence at its next iteration (thread-safe: a flag)."""
        self.cancelled = True

    def detokenize(self, tokenizer, tokens: list[int], finish: str | None) -> tuple[str, str | None]:
        """The text to send now for the new ``tokens`` (no end-of-sequence token), given how they ended
        (``finish``: None while going on): its ``Detokenizer`` cuts at a stop string (then finish is ``stop``)
        and holds back an end that may still become one, or an unfinished UTF-8 character."""
        if self.detokenizer is None:
            self.detokenizer = Detokenizer(tokenizer, self.stop)
        return self.detokenizer.add(tokens, finish)

    def usage(self) -> dict:
        usage = {"prompt_tokens": len(self.prompt), "completion_tokens": len(self.generated),
                 "total_tokens": len(self.prompt) + len(self.generated),
                 "prompt_tokens_details": {"cached_tokens": self.cached}}
        if self.rounds:
            usage["speculative"] = {"rounds": self.rounds, "proposed": self.proposed, "accepted": self.accepted,
                                    "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                                    "tokens_per_round": len(self.generated) / self.rounds}
        return usage

