"""The one schedule of every loop that batches sequences through a session: the server's engine,
validate's episode, ``Session.generate`` and the throughput measurement all ask ``plan`` what a step
does, and only execute it.

A ``Slot`` is one request as the schedule sees it, in an explicit ``State``: waiting (no sequence
yet), prefilling (its prompt partly fed), decoding (its prompt fed; ``next_token`` chosen and not yet
fed) or done (it ended; its sequence is still held). ``plan(slots, budget)`` reads the slots, in
arrival order, and returns the step as data (``Plan``); it changes nothing. The caller releases,
adds, runs the step and the speculative round, and tells the slots what happened (``Slot.admit``,
``Slot.took``, ``Slot.finish``).

The policy, in order:

1. release: every done slot's sequence, first, so that its sequence and cells serve this plan;
2. admit: waiting slots in arrival order while a sequence is free and (a cell layout) the pool holds
   the cells every live slot reserved plus this one's; the first that does not fit stops admission
   (no later, smaller request overtakes it). With ``prefix_cache``, each admitted slot may start from a
   released sequence's rows for its prompt's first tokens (``Plan.prefixes``: all but the last prompt
   token, whose logits choose the first generated token); the caller adds the sequence with that prefix
   and tells the plan how many tokens the session reused (``Plan.admit``): the slot starts there, and
   its chunk of this step moves past them;
3. decode: every decoding slot is fed its next token, every step; with ``speculative`` they all take
   one speculative round instead (a second program call beside the step);
4. prefill (the chunk policy): the step's width left by the decodes, ``max_step_tokens`` less one
   token per decoding slot and at most ``prefill_chunk`` while any slot decodes, goes to the
   prefilling slots oldest first, each taking the next chunk of its prompt while width is left.
   Alone (nothing decodes), prompts take the whole width. The oldest prefilling slot always takes at
   least one token: where ``max_seqs > max_step_tokens``, ``max_step_tokens`` decoding slots or more
   leave no width, and that slot then takes exactly one, which keeps the step one token per sequence,
   a step the session accepts up to ``max_seqs`` wide. So a prompt is never starved and no stream
   skips a step. (The other way, a prefill-only step every other step, would stall every stream for
   each step of one prompt; this one costs them nothing, and the prompt moves by a token a step only
   while the decodes fill the width.)
"""

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field


class State(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"


@dataclass(eq=False)
class Slot:
    """One request in the schedule: its id (the session's sequence id), its prompt, the cells it
    reserves in a cell pool (prompt, most tokens and a draft block; 0 elsewhere), where it is."""

    id: object
    prompt: list[int]
    cells: int = 0
    state: State = State.WAITING
    fed: int = 0  # prompt tokens fed so far
    next_token: int | None = None  # decoding: the token its next step feeds

    def __post_init__(self):
        if not self.prompt:
            raise ValueError(f"slot {self.id!r} has an empty prompt: a sequence starts with at least one token")

    def admit(self, reused: int = 0) -> None:
        """It has a sequence now, which holds the first ``reused`` prompt tokens already: the rest is next."""
        if self.state is not State.WAITING:
            raise ValueError(f"slot {self.id!r} is {self.state.value}, not waiting: it cannot be admitted")
        if isinstance(reused, bool) or not isinstance(reused, int) or not 0 <= reused < len(self.prompt):
            raise ValueError(f"slot {self.id!r}: reused={reused!r} must be an integer in [0, {len(self.prompt) - 1}] "
                             "(its prompt's last token is always fed: its logits choose the first token)")
        self.fed = reused
        self.state = State.PREFILLING

    def took(self, n: int) -> bool:
        """The step fed it ``n`` tokens; True when the step's logits choose its next token (it was
        decoding, or this chunk ended its prompt: then it decodes, and the caller sets ``next_token``)."""
        if self.state is State.PREFILLING:
            self.fed += n
            if self.fed < len(self.prompt):
                return False
            self.state = State.DECODING
        return True

    def finish(self) -> None:
        """It ended (its tokens, an error, its client gone): the next plan releases its sequence."""
        self.state = State.DONE


@dataclass(frozen=True)
class Budget:
    """What one step may take: ``max_step_tokens`` (a step's width; a step of one token per sequence may
    take up to ``max_seqs``), ``max_seqs`` sequences, ``prefill_chunk`` (prompt tokens of a step while
    others decode; None: the width they leave), ``speculative`` (decoding slots take a speculative round
    instead of a token of the step), ``cells`` (a cell pool's size: admission keeps the live slots'
    reservations within it; None: no pool) and ``prefix_cache`` (admitted slots may start from the rows
    of a released sequence that began alike: ``Plan.prefixes``)."""

    max_step_tokens: int
    max_seqs: int
    prefill_chunk: int | None = None
    speculative: bool = False
    cells: int | None = None
    prefix_cache: bool = False

    def __post_init__(self):
        for name in ("max_step_tokens", "max_seqs", "prefill_chunk"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.cells is not None and self.cells < 0:
            raise ValueError(f"cells={self.cells!r} must be >= 0 (or None: no cell pool)")


@dataclass
class Plan:
    """One step, as data: the slots whose sequences to release, the slots to admit (add their sequences,
    each with its prefix: the prompt tokens it may take from a released sequence's rows), the target
    step's feeds (sequence id -> tokens; empty: no step) and the speculative round's (sequence id ->
    the token it feeds; empty: no round)."""

    released: list[Slot] = field(default_factory=list)
    admitted: list[Slot] = field(default_factory=list)
    feeds: dict[object, list[int]] = field(default_factory=dict)
    speculate: dict[object, int] = field(default_factory=dict)
    prefixes: dict[object, list[int]] = field(default_factory=dict)  # admitted slot id -> prefix it may adopt

    def admit(self, slot: Slot, reused: int = 0) -> None:
        """``slot``'s sequence was added and holds the first ``reused`` tokens of its prompt (at most its
        ``prefixes`` entry): the slot starts past them, and so does its chunk of this step (as many tokens
        as the plan gave it, or fewer where the prompt ends)."""
        if slot not in self.admitted:
            raise ValueError(f"slot {slot.id!r} is not one this plan admits")
        allowed = len(self.prefixes.get(slot.id, ()))
        if isinstance(reused, bool) or not isinstance(reused, int) or not 0 <= reused <= allowed:
            raise ValueError(f"slot {slot.id!r}: reused={reused!r} must be an integer in [0, {allowed}], "
                             "the prefix this plan let it adopt")
        slot.admit(reused)
        if slot.id in self.feeds:
            self.feeds[slot.id] = slot.prompt[reused: reused + len(self.feeds[slot.id])]


def plan(slots: Iterable[Slot], budget: Budget) -> Plan:
    """The next step of ``slots`` (in arrival order) within ``budget``: the module docstring's policy."""
    slots = list(slots)
    live = [s for s in slots if s.state in (State.PREFILLING, State.DECODING)]
    admitted = _admit([s for s in slots if s.state is State.WAITING], live, budget)
    decoding = [s for s in live if s.state is State.DECODING]
    for s in decoding:
        if s.next_token is None:
            raise ValueError(f"slot {s.id!r} is decoding with no next_token: set it from the step that ended its prompt")
    tokens = {s.id: s.next_token for s in decoding}
    feeds = {} if budget.speculative else {sid: [token] for sid, token in tokens.items()}
    room = budget.max_step_tokens - len(feeds)
    if decoding and budget.prefill_chunk is not None:
        room = min(room, budget.prefill_chunk)
    room = max(room, 1)  # progress: the oldest prompt takes a token however many decode
    for s in slots:  # arrival order: the live prefilling slots, then those admitted now
        if room > 0 and (s.state is State.PREFILLING or s in admitted):
            feeds[s.id] = s.prompt[s.fed: s.fed + room]
            room -= len(feeds[s.id])
    prefixes = {s.id: s.prompt[:-1] for s in admitted} if budget.prefix_cache else {}
    return Plan(released=[s for s in slots if s.state is State.DONE], admitted=admitted, feeds=feeds,
                speculate=tokens if budget.speculative else {}, prefixes=prefixes)


def _admit(waiting: list[Slot], live: list[Slot], budget: Budget) -> list[Slot]:
    """The waiting slots that join now: oldest first, while a sequence is free and the pool holds them."""
    admitted, reserved = [], sum(s.cells for s in live)
    for s in waiting:
        if len(live) + len(admitted) >= budget.max_seqs:
            break
        if budget.cells is not None and reserved + s.cells > budget.cells:
            if not live and not admitted:  # an empty pool will never hold it: say so instead of waiting forever
                raise ValueError(f"slot {s.id!r} reserves {s.cells} cells, more than the pool's {budget.cells}")
            break
        admitted.append(s)
        reserved += s.cells
    return admitted
