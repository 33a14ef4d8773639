"""Layout index math and the checks of the kv config."""

import dataclasses

import pytest

from conftest import compose_config
from pipeline.kv.layout_sequence import prefix_rows_held, sequence_segments
from pipeline.kv.layouts import KVConfigError, SeqState, build_layout
from pipeline.models.args import model_args


def layout(*overrides):
    cfg = compose_config(*overrides)
    # null kv settings: the defaults of a model without a context of its own (build/context.py derives them)
    if cfg.kv.capacity is None:
        cfg.kv.capacity = 512 if cfg.kv.layout == "cell" else 128
    if cfg.kv.max_step_tokens is None:
        cfg.kv.max_step_tokens = 16
    return build_layout(cfg.kv, model_args(cfg.model))


def test_segments_flat_and_wrapped():
    assert sequence_segments(0, 10, 2) == []
    assert sequence_segments(7, 10, 2) == [(2, 0, 7, 0)]
    assert sequence_segments(10, 10, 0) == [(0, 0, 10, 0)]
    # positions 3..12 live in rows 3..9 then 0..2
    assert sequence_segments(13, 10, 1) == [(1, 3, 7, 3), (1, 0, 3, 10)]
    assert sequence_segments(20, 10, 0) == [(0, 0, 10, 10)]


def test_layouts_from_config():
    solo = layout()
    assert solo.layout == "sequence" and solo.columns == 1 and solo.max_segments == 2
    assert [(x.kind, x.rows) for x in solo.layers] == [("ring", 31), ("flat", 128)] * 2
    batched = layout("kv.max_seqs=8")
    assert batched.layout == "batched-sequence" and batched.columns == 8 and batched.max_segments == 16
    assert batched.store_shape(batched.layers[1]) == (128 * 8, 2, 16)
    gathered = ["block_q", "out_rows"]
    assert [b.name for b in batched.step_buffers()] == ["seq_cols", *gathered, "one_flat", "block_flat", "one_ring",
                                                        "block_ring"]
    # each named size in one buffer alone (the program read back from the stage cache sizes it the same)
    assert [b.shape for b in batched.step_buffers()][3:5] == [("one_tokens_flat", 3, "one_keys_flat"), (2, "block_keys_flat")]
    assert (batched.dim_bound("one_keys_ring"), batched.dim_bound("block_keys_flat")) == (31, 128)
    assert batched.dim_bound("one_tokens_ring") == batched.dim_bound("block_tokens") == batched.step_width
    planned = dataclasses.replace(batched, planned=True)  # the GPU's: planned from seq_info
    assert [b.name for b in planned.step_buffers()] == ["seq_cols", "seq_info_flat", "seq_info_ring"]
    cell = layout("kv=cell")
    assert cell.layout == "cell" and cell.store_shape(cell.layers[0]) == (512, 2, 16)
    assert [b.name for b in cell.step_buffers()] == [
        "cell_ids", *gathered, "one_cells", "block_cells"]
    assert cell.dim_bound("one_keys_cells") == 512
    with pytest.raises(ValueError, match="one_keys_flat"):
        cell.dim_bound("one_keys_flat")
    planned_cell = dataclasses.replace(cell, planned=True)
    assert [b.name for b in planned_cell.step_buffers()] == ["cell_ids", "q_seq_bits", "cell_pos", "cell_owners"]
    assert [b.shape for b in planned_cell.step_buffers()][2:] == [("cells",), ("cells",)]
    assert planned_cell.dim_bound("cells") == 512
    # K and V, 4 layers: 2 * rows * columns * Hkv * D * 4 bytes
    assert batched.kv_bytes_per_layer() == [2 * r * 8 * 2 * 16 * 4 for r in (31, 128, 31, 128)]


def test_ring_rows_hold_a_window_and_a_step():
    """A step writes max_step_tokens rows while its first query still reads the window behind it."""
    ring_only = layout("model.layer_pattern=R", "kv.capacity=20")
    assert [x.rows for x in ring_only.layers] == [16 + 16 - 1] * 4, "not capped by a capacity nothing enforces"
    assert ring_only.max_seq_len is None
    bounded = layout("kv.capacity=20")  # flat layers stop every sequence at 20 tokens: the ring never wraps
    assert [(x.kind, x.rows) for x in bounded.layers] == [("ring", 20), ("flat", 20)] * 2 and bounded.max_seq_len == 20
    assert layout("kv.max_step_tokens=4").layers[0].rows == 16 + 4 - 1


def _column_holds(length: int, written: int, rows: int, window: int) -> bool:
    """By simulation: write positions 0..written-1 in order into a column of ``rows`` rows, then check the
    rows a sequence resuming at ``length`` reads (its first query's window; a flat layer: all of [0, length))."""
    column = [None] * rows
    for q in range(written):
        column[q % rows] = q
    first = 0 if window == 0 else max(0, length - window + 1)
    return all(column[q % rows] == q for q in range(first, length))


def test_a_ring_holds_a_prefix_only_where_no_later_position_overwrote_its_window():
    """The prefix cache's ring rule (``prefix_rows_held``) against a simulated column, and its edge on the
    tiny model's ring (window 16, 16-token steps: 31 rows): 60 positions written, position q is held iff
    q >= 60 - 31 = 29, so a resumed query at 44 (reading 29..43) may adopt, one at 43 (reading 28,
    which position 59 overwrote) may not."""
    rows, window = 16 + 16 - 1, 16
    assert prefix_rows_held(44, 60, rows, window) and not prefix_rows_held(43, 60, rows, window)
    assert prefix_rows_held(60, 60, rows, window)
    # rows written past the kept tokens (a rejected block, a failed step) count: 62 written, from 46 on
    assert prefix_rows_held(46, 62, rows, window) and not prefix_rows_held(45, 62, rows, window)
    for written in range(0, 3 * rows):
        for length in range(0, written + 1):
            for r, w in ((rows, window), (128, 0), (20, 5)):  # the tiny ring, a flat layer, another ring
                assert prefix_rows_held(length, written, r, w) == _column_holds(length, written, r, w), (length, written, r, w)
    tiny = layout("kv=sequence", "kv.max_seqs=4")  # ring and flat layers: the ring's rule decides
    assert tiny.holds_prefix(44, SeqState(slot=0, length=60, written=60))
    assert not tiny.holds_prefix(43, SeqState(slot=0, length=60, written=60))
    assert not tiny.holds_prefix(61, SeqState(slot=0, length=60, written=60)), "past what the rows hold"
    assert tiny.holds_prefix(30, SeqState(slot=0, length=31, written=31)), "a ring that never wrapped holds all"
    cell = layout("kv=cell", "kv.max_seqs=3")
    assert cell.holds_prefix(43, SeqState(slot=0, length=60, written=60)), "a cell per position: nothing overwritten"


@pytest.mark.parametrize("overrides,needle", [
    (("kv.max_seqs=0",), "kv.max_seqs=0"),
    (("kv.capacity=-1",), "kv.capacity=-1"),
    (("kv.max_step_tokens=0",), "kv.max_step_tokens=0"),
    (("kv=cell", "kv.max_seqs=64"), "limit of 63"),
    (("kv=cell", "kv.max_seqs=33"), "cell pool allows"),
    (("kv.capacity=12", "kv.max_step_tokens=4"), "sliding_window=16"),
])
def test_bad_kv_config(overrides, needle):
    with pytest.raises(KVConfigError, match=needle):
        layout(*overrides)


def test_parameter_counts_from_the_config_equal_the_modules():
    """The plan (dry_run) counts weights from the config alone: the same numbers as the built modules."""
    from conftest import compose_config
    from pipeline.models.args import draft_args, model_args, vision_args
    from pipeline.models.dflash import build_draft
    from pipeline.models.transformer import build_model
    from pipeline.models.vision import build_vision

    for overrides in (("draft=dflash", "vision=smolvlm_tiny"),
                      ("model=muse_glimmer_tiny", "draft=dflash_muse_glimmer_tiny", "vision=muse_glimmer_tiny")):
        cfg = compose_config(*overrides)
        target = model_args(cfg.model)
        draft, vision = draft_args(cfg.draft, target), vision_args(cfg.vision, target)
        for args, module in ((target, build_model(target, 0)), (draft, build_draft(draft, 0)), (vision, build_vision(vision, 0))):
            assert args.n_parameters() == sum(p.numel() for p in module.parameters()), type(args).__name__
