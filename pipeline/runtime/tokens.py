"""A request's token ids, checked before a session takes them (``Session.check_tokens``)."""

import numbers

import torch

from pipeline.errors import SessionError


def token_ids(seq_id, toks, vocab_size: int) -> list[int]:
    """``toks`` as Python ints in [0, vocab_size); anything else is refused, naming the sequence."""
    if isinstance(toks, torch.Tensor):
        if toks.dtype.is_floating_point or toks.dtype.is_complex or toks.dtype == torch.bool or toks.dim() != 1:
            raise SessionError(f"sequence {seq_id!r}: tokens must be a 1-d integer tensor, got {toks.dtype} "
                               f"of shape {tuple(toks.shape)}")
        toks = toks.tolist()
    if isinstance(toks, (str, bytes)) or not hasattr(toks, "__iter__"):
        raise SessionError(f"sequence {seq_id!r}: tokens must be a list of token ids, got {type(toks).__name__}")
    toks = list(toks)
    if not toks:
        raise SessionError(f"sequence {seq_id!r} is fed no tokens")
    for i, t in enumerate(toks):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise SessionError(f"sequence {seq_id!r}: token {i} is {t!r} ({type(t).__name__}), not an integer id")
        if not 0 <= t < vocab_size:
            raise SessionError(f"sequence {seq_id!r}: token {i} is {t}, outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in toks]
