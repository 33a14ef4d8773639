"""The session's prefix cache: the rows released sequences left behind, what they hold, and which one a
new sequence may start from.

A released sequence becomes a ``Retained`` entry: the tokens whose K/V its rows hold (positions 0 to
its length - 1), the keys of its images, and per model of the session (the target, a draft) its last
state and its pool's receipt (``Pool.retain``). A new sequence whose first tokens equal an entry's may
adopt that entry's rows for the longest such prefix the rows still hold (``usable``: the session asks
every model's pool and layout) and prefill only the rest. An entry is used once: adopting it takes
its rows (a column, or the cells of the prefix; the rest of its cells are freed).

An image is part of the key: a prefix may hold the placeholder tokens of an image only when the image
is the same (``image_key``) in both; it stops before the first placeholder of the first image that
differs.

The cache keeps its entries in release order and decides, over the session's models (their pools and
layouts), which entry a new sequence adopts and which free slot an empty one takes: a column no
retained rows are in, else the least recently released one's (sequence layouts; a cell layout's slots
are owner bits, its rows cells, which its pool gives up least recently released first). Its choices
(``find``, ``slot_for``) change nothing; ``take`` and ``retain`` do.
"""

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipeline.build.roles import TARGET
from pipeline.kv.layouts import SeqState


@dataclass(eq=False)
class Retained:
    """What a released sequence's rows hold, and each model's state and receipt for them."""

    tokens: tuple[int, ...]  # the tokens whose K/V its rows hold, from position 0
    images: tuple[str, ...]  # its images' keys (``runtime.images.image_key``), in order
    states: dict = field(default_factory=dict)  # model name -> its SeqState as released
    receipts: dict = field(default_factory=dict)  # model name -> its pool's receipt (``Pool.retain``)
    features: object = None  # a draft's target features not yet given to it (positions its length .. len(tokens))
    stamp: int = 0  # release order: lower is older


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def image_safe_length(length: int, tokens: Sequence[int], held_images: Sequence[str], images: Sequence[str],
                      placeholder: int | None, per_image: int) -> int:
    """The longest prefix, at most ``length`` of ``tokens``, whose image placeholders all belong to images
    both sequences have alike: image k takes placeholders k * per_image .. (k + 1) * per_image - 1 in
    order, so the prefix ends before the first placeholder of the first image that differs (or that one
    of them lacks). ``placeholder`` None: an artifact without images, every length is safe."""
    if placeholder is None:
        return length
    same = common_length(held_images, images)
    seen = 0
    for i, token in enumerate(tokens[:length]):
        if token == placeholder:
            if seen == same * per_image:
                return i
            seen += 1
    return length


class PrefixCache:
    """The retained entries, oldest first, over the session's ``models`` (name -> ``ModelState``)."""

    def __init__(self, models: dict | None = None):
        self.models = models or {}
        self.entries: list[Retained] = []
        self._stamps = itertools.count()

    def put(self, entry: Retained) -> None:
        entry.stamp = next(self._stamps)
        self.entries.append(entry)

    def remove(self, entry: Retained) -> None:
        self.entries.remove(entry)

    def best(self, tokens: Sequence[int], images: Sequence[str], placeholder: int | None, per_image: int,
             usable: Callable[[Retained, int], int]) -> tuple[Retained | None, int]:
        """The entry whose rows give the longest prefix of ``tokens`` (with ``images``), and its length;
        (None, 0) when none gives one. ``usable(entry, n)`` is the prefix of at most ``n`` tokens that
        entry's rows still hold (0: none). Equal lengths: the most recently released entry."""
        best, best_length = None, 0
        for entry in reversed(self.entries):
            n = common_length(entry.tokens, tokens)
            n = image_safe_length(n, tokens, entry.images, images, placeholder, per_image)
            n = usable(entry, n) if n > 0 else 0
            if n > best_length:
                best, best_length = entry, n
        return best, best_length

    # --- over the session's models ---

    def retain(self, tokens: Sequence[int], images: Sequence[str], states: dict, features=None) -> None:
        """A released sequence's rows, kept: each model's pool keeps them and gives a receipt."""
        receipts = {name: self.models[name].pool.retain(state) for name, state in states.items()}
        self.put(Retained(tuple(tokens), tuple(images), states, receipts, features))

    def held(self, entry: Retained, length: int, free: list[int]) -> int:
        """``length`` if ``entry``'s rows hold a prefix of that many tokens in every model (the target all of
        it; a draft, whose context may lag, the part it had reached), else 0."""
        for name, model in self.models.items():
            state = entry.states.get(name)
            if state is None or not model.pool.holds(state, entry.receipts.get(name)):
                return 0
            if model.layout.rows_in_column and state.slot not in free:
                return 0
            if not model.layout.holds_prefix(length if name == TARGET else min(length, state.length), state):
                return 0
        return length

    def find(self, tokens: Sequence[int], images: Sequence[str], placeholder: int | None, per_image: int,
             free: list[int]) -> tuple[Retained | None, int]:
        """The entry a new sequence starting with ``tokens`` (and ``images``) adopts, and how many tokens."""
        return self.best(tokens, images, placeholder, per_image, lambda entry, n: self.held(entry, n, free))

    def slot_for(self, entry: Retained | None, free: list[int]) -> int:
        """The slot a new sequence takes: ``entry``'s column when it adopts one (sequence layouts), else a
        free column no retained rows are in, lowest first, else the least recently released one's."""
        bound = {}  # column -> the release order of the rows kept in it
        for e in self.entries:
            for name, state in e.states.items():
                if self.models[name].layout.rows_in_column:
                    bound.setdefault(state.slot, e.stamp)
        if entry is not None:
            columns = {state.slot for name, state in entry.states.items() if self.models[name].layout.rows_in_column}
            return columns.pop() if columns else free[0]
        empty = [slot for slot in free if slot not in bound]
        return empty[0] if empty else min(free, key=bound.__getitem__)

    def take(self, slot: int, entry: Retained | None, length: int) -> dict:
        """Each model's state of a new sequence in ``slot``: empty, or holding ``entry``'s first ``length``
        positions (a draft: those its context had reached); the entry is used up."""
        if entry is not None:
            self.remove(entry)
        states = {}
        for name, model in self.models.items():
            model.pool.take(slot)
            states[name] = seq = SeqState(slot=slot)
            if entry is not None:
                old = entry.states[name]
                seq.length, seq.written = min(length, old.length), old.written
                model.pool.adopt(old, entry.receipts[name], seq, seq.length)
        self.prune()  # a column taken from a released sequence: its rows are given up
        return states

    def prune(self) -> None:
        """Forget the entries whose rows some model no longer holds, giving up the rest of their rows."""
        for entry in list(self.entries):
            if not all(self.models[name].pool.holds(state, entry.receipts[name]) for name, state in entry.states.items()):
                self.evict(entry)

    def evict(self, entry: Retained) -> None:
        """Give up a released sequence's rows: the entry is forgotten, its cells are free."""
        self.remove(entry)
        for name, state in entry.states.items():
            self.models[name].pool.evict(state, entry.receipts[name])
