"""The prefix cache's bookkeeping, no artifact: matching lengths, images as part of the key, the choice
among entries; and the pools' side (retain, holds, adopt, evict, give up what a step writes)."""

import pytest
import torch

from pipeline.kv.layout_cell import CellPool
from pipeline.kv.layout_sequence import ColumnPool
from pipeline.kv.layouts import SeqState
from pipeline.runtime.prefix_cache import PrefixCache, Retained, common_length, image_safe_length

IMG = 9  # a placeholder token id


def test_common_length():
    assert common_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_length([1, 2], [1, 2, 3]) == 2
    assert common_length([], [1]) == 0 and common_length([5], [6]) == 0


def test_an_image_is_part_of_the_key():
    """Two images of two placeholders each: the prefix stops before the first placeholder of the first
    image that differs, and may hold part of an image that is the same."""
    tokens = [1, IMG, IMG, 2, IMG, IMG, 3]
    assert image_safe_length(7, tokens, ("x", "y"), ("x", "y"), IMG, 2) == 7
    assert image_safe_length(7, tokens, ("x", "y"), ("x", "z"), IMG, 2) == 4  # before the second image
    assert image_safe_length(7, tokens, ("x", "y"), ("w", "y"), IMG, 2) == 1  # before the first
    assert image_safe_length(7, tokens, ("x",), ("x", "y"), IMG, 2) == 4  # one of them lacks the second
    assert image_safe_length(2, tokens, ("x",), ("x",), IMG, 2) == 2  # half of a same image
    assert image_safe_length(1, tokens, (), ("q",), IMG, 2) == 1  # no placeholder in the prefix
    assert image_safe_length(7, tokens, (), (), None, 1) == 7  # an artifact without images


def entry(tokens, images=()):
    return Retained(tuple(tokens), tuple(images))


def test_the_longest_held_prefix_wins_and_equal_ones_go_to_the_most_recent():
    cache = PrefixCache()
    old, short, held_less = entry([1, 2, 3, 4, 5]), entry([1, 2, 9]), entry([1, 2, 3, 4, 5, 6])
    for e in (old, short, held_less):
        cache.put(e)
    usable = {id(old): lambda n: n, id(short): lambda n: n, id(held_less): lambda n: min(n, 3)}
    best = cache.best([1, 2, 3, 4, 5, 6, 7], (), None, 1, lambda e, n: usable[id(e)](n))
    assert best == (old, 5), "held_less matches 6 but its rows hold 3"
    twin = entry([1, 2, 3, 4, 5, 8])
    cache.put(twin)
    usable[id(twin)] = lambda n: n
    assert cache.best([1, 2, 3, 4, 5, 7], (), None, 1, lambda e, n: usable[id(e)](n)) == (twin, 5)
    assert cache.best([7, 7], (), None, 1, lambda e, n: n) == (None, 0)
    cache.remove(twin)
    assert twin not in cache.entries and [e.stamp for e in cache.entries] == [0, 1, 2]


def test_a_column_holds_its_rows_until_a_sequence_takes_it():
    pool = ColumnPool(3)
    pool.take(1)
    seq = SeqState(slot=1, length=10, written=10)
    receipt = pool.retain(seq)
    assert pool.holds(seq, receipt)
    pool.take(2)
    assert pool.holds(seq, receipt), "another column taken"
    pool.take(1)
    assert not pool.holds(seq, receipt), "its column was taken: a planted receipt is seen to be stale"
    with pytest.raises(ValueError, match="in that column"):
        pool.adopt(seq, receipt, SeqState(slot=0), 5)


def _filled(pool: CellPool, seq: SeqState, n: int) -> None:
    cells = pool.choose(n)
    pool.writing(cells)
    pool.commit([(seq, n)], cells)
    seq.length += n


def test_released_cells_are_kept_taken_last_oldest_first_and_a_written_group_is_given_up():
    pool = CellPool(12)
    a, b = SeqState(slot=0), SeqState(slot=1)
    _filled(pool, a, 4)  # cells 0..3
    _filled(pool, b, 4)  # cells 4..7
    ra, rb = pool.retain(a), pool.retain(b)
    assert pool.free_cells == [8, 9, 10, 11] and pool.holds(a, ra) and pool.holds(b, rb)
    assert int(pool.cell_owners[:8].abs().sum()) == 0, "kept cells are owned by nobody: no query sees them"
    assert pool.choose(4) == [8, 9, 10, 11], "free cells first"
    assert pool.choose(6) == [8, 9, 10, 11, 0, 1], "then the least recently released"
    before = pool.snapshot()
    pool.choose(6)  # choosing changes nothing
    assert [torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(before, pool.snapshot(), strict=True)] == [True] * 5
    c = SeqState(slot=2)
    _filled(pool, c, 6)  # writes 8..11 and a's 0, 1: a's group is given up, its 2, 3 free again
    assert not pool.holds(a, ra) and pool.holds(b, rb)
    assert c.cells == [8, 9, 10, 11, 0, 1] and pool.free_cells == [2, 3]
    assert pool.group_of == dict.fromkeys([4, 5, 6, 7], rb[0])
    with pytest.raises(Exception, match="the cell pool is full: the step needs 7 cells, 2 of 12 are free and 4 hold"):
        pool.choose(7)


def test_a_new_sequence_adopts_the_cells_of_the_prefix_and_the_rest_are_free():
    pool = CellPool(8)
    a = SeqState(slot=0)
    _filled(pool, a, 3)
    _filled(pool, a, 2)  # positions 0..4 in cells 0..4
    receipt = pool.retain(a)
    new = SeqState(slot=3, length=3)
    pool.adopt(a, receipt, new, 3)
    assert new.cells == [0, 1, 2] and pool.cell_owners[:3].tolist() == [8, 8, 8]
    assert pool.free_cells == [3, 4, 5, 6, 7] and not pool.holds(a, receipt)
    pool.evict(a, receipt)  # a used receipt: nothing to give up
    assert pool.free_cells == [3, 4, 5, 6, 7]
    b = SeqState(slot=1)
    _filled(pool, b, 2)
    rb = pool.retain(b)
    pool.evict(b, rb)
    assert pool.free_cells == [3, 4, 5, 6, 7] and not pool.holds(b, rb)


def _columns(n: int) -> dict:
    """A session's models as the cache sees them: one target over ``n`` columns whose rows hold every prefix."""
    from types import SimpleNamespace

    layout = SimpleNamespace(rows_in_column=True, holds_prefix=lambda length, seq: length <= seq.length)
    return {"target": SimpleNamespace(pool=ColumnPool(n), layout=layout)}


def test_an_empty_sequence_takes_an_empty_column_else_the_least_recently_released():
    models = _columns(4)
    cache = PrefixCache(models)
    states = {}
    for slot in range(4):
        models["target"].pool.take(slot)
        states[slot] = SeqState(slot=slot, length=5, written=5)
    for slot in (2, 0, 3):  # released in this order; column 1 stays live
        cache.retain([slot] * 5, (), {"target": states[slot]})
    assert cache.slot_for(None, [0, 2, 3]) == 2, "every free column holds rows: the least recently released"
    cache.take(2, None, 0)
    assert [e.states["target"].slot for e in cache.entries] == [0, 3], "column 2's rows are given up"
    assert cache.slot_for(None, [0, 3]) == 0
    assert cache.slot_for(None, [0, 1, 3]) == 1, "a column no released rows are in comes first"
    entry, length = cache.find([3, 3, 3, 3, 3, 9], (), None, 1, [0, 3])
    assert (entry.states["target"].slot, length) == (3, 5) and cache.slot_for(entry, [0, 3]) == 3
    assert cache.find([3, 3, 9], (), None, 1, [0]) == (None, 0), "its column is not free"
    taken = cache.take(3, entry, 2)
    assert taken["target"] == SeqState(slot=3, length=2, written=5) and entry not in cache.entries
