"""Speculative decoding with a DFlash draft, eagerly, on reference caches: the oracle of the
speculative session to come, and the loop ``dflash_generate(temperature=0)`` runs.

One sequence. Each round the draft proposes ``block_size - 1`` tokens after the last accepted one
(the block: that token, then ``mask_token_id``s), from the target's tapped features of the tokens
accepted since the last round; the target runs the whole block once; the proposals that equal the
target's greedy tokens are accepted, plus the target's token after them (the bonus). Both histories
are rolled back to the accepted tokens, so nothing past them is read again. The output is the
target's greedy continuation whatever the draft proposes; the draft decides only how many target
steps it takes.
"""

from dataclasses import dataclass, field

import torch

from pipeline.kv.op import ReferenceCache, reference_cache
from pipeline.runtime.sampling import accepted_length


@dataclass
class SpeculativeResult:
    tokens: list[int]  # the new tokens, at most max_new_tokens
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens produced per target step


def speculative_generate(target, draft, prompt: list[int], max_new_tokens: int,
                         propose=None) -> SpeculativeResult:
    """Greedy speculative decoding of ``prompt``. ``propose(start, proposals) -> proposals`` may
    replace the draft's proposals (tests: a corrupted or an oracle draft)."""
    a = draft.args
    taps = tuple(a.target_layer_ids)
    t_cache = ReferenceCache(target.args.layer_kv())
    d_cache = ReferenceCache(draft.layer_kv(), causal=False)
    n = len(prompt)
    max_length = n + max_new_tokens
    with torch.no_grad():
        with reference_cache(t_cache):
            hidden, features = target.hidden_and_taps(target.embed(torch.tensor(prompt)), torch.arange(n), taps)
        out = [*prompt, int(target.logits(hidden[-1:]).argmax(-1))]
        result, start = SpeculativeResult([]), n
        while start + 1 < max_length:
            verify = min(a.block_size, max_length - start)
            block = [out[start]] + [a.mask_token_id] * (verify - 1)
            if verify > 1:
                with reference_cache(d_cache):
                    ctx = torch.arange(start - features.shape[0], start)
                    h = draft(features[None], target.embed(torch.tensor(block)), ctx, torch.arange(start, start + verify))
                d_cache.truncate(start)  # the block's rows were scratch
                proposals = target.logits(h[0, 1:]).argmax(-1).tolist()
                block[1:] = propose(start, proposals) if propose is not None else proposals
            with reference_cache(t_cache):
                hidden, features = target.hidden_and_taps(target.embed(torch.tensor(block)), torch.arange(start, start + verify), taps)
            greedy = target.logits(hidden).argmax(-1).tolist()
            accepted = accepted_length(block, greedy)
            produced = min(accepted + 1, max_length - start - 1)
            out[start + 1:] = block[1: accepted + 1] + [greedy[accepted]]
            out = out[: start + produced + 1]
            start += produced
            t_cache.truncate(start)  # rejected proposals' rows
            features = features[:produced]
            result.acceptance_lengths.append(produced)
    result.tokens = out[n:max_length]
    return result


def greedy_generate(target, prompt: list[int], max_new_tokens: int, embeddings=None) -> list[int]:
    """Plain greedy decoding on a reference cache, one target step per token; ``embeddings``: the
    prompt's, when they are not its tokens' (an image's features spliced in)."""
    cache = ReferenceCache(target.args.layer_kv())
    out, step, start = [], list(prompt), 0
    with torch.no_grad(), reference_cache(cache):
        for _ in range(max_new_tokens):
            emb = embeddings if start == 0 and embeddings is not None else target.embed(torch.tensor(step))
            hidden = target.hidden(emb, torch.arange(start, start + len(step)))
            start += len(step)
            step = [int(target.logits(hidden[-1:]).argmax(-1))]
            out.append(step[0])
    return out
