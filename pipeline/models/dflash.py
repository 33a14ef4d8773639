"""The DFlash draft: a few Qwen3-style layers that propose a block of tokens at once.

The published architecture (``dflash==0.1.0``'s ``DFlashDraftModel``; the Muse Glimmer draft of
``executorch.examples.models.muse_glimmer.model.dflash_model`` is the same shape): the target's
hidden states at ``target_layer_ids`` (concatenated) go through ``fc`` and ``hidden_norm`` into a
context; every layer projects keys and values from that context and from the block's own
(input-normed) hidden states, queries from the block only, and attends non-causally over both. The
block is the last accepted token followed by ``mask_token_id``s, embedded with the target's table;
its final hidden states go through the target's output head.

Attention goes through the neutral KV op, as the target's does: a call writes the new context rows
and the block rows at their positions and attends (``rows``: one token axis, as a batched step has
it). Context rows' queries are answered and dropped. The block rows are scratch: the caller rolls the draft's history back to the context
before the next block (``ReferenceCache.truncate``; a session's draft length), and the next
call's context and block overwrite those positions.
"""

import torch
from torch import Tensor, nn

from pipeline.kv.op import default_scale
from pipeline.models.args import DraftArgs, LayerKV
from pipeline.models.transformer import FeedForward, RMSNorm, rope, seeded


class DraftAttention(nn.Module):
    def __init__(self, a: DraftArgs, layer_id: int):
        super().__init__()
        self.layer_id, self.a = layer_id, a
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.norm_eps)

    def forward(self, kv_rows: Tensor, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> Tensor:
        # kv_rows [1, N, dim]: the context (context rows) or the input-normed block (block rows);
        # x [1, N, dim]: the input-normed rows the queries come from; positions [N]
        a, n = self.a, x.shape[1]
        k = rope(self.k_norm(self.wk(kv_rows).view(1, n, a.n_kv_heads, a.head_dim)), cos, sin, a.rope_interleaved)
        v = self.wv(kv_rows).view(1, n, a.n_kv_heads, a.head_dim)
        q = rope(self.q_norm(self.wq(x).view(1, n, a.n_heads, a.head_dim)), cos, sin, a.rope_interleaved)
        out = torch.ops.kvcache.update_and_attend(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions.view(-1, 1),
            self.layer_id, default_scale(a.head_dim), q.dtype)
        return self.wo(out.transpose(1, 2).reshape(1, n, -1))


class DraftBlock(nn.Module):
    def __init__(self, a: DraftArgs, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = DraftAttention(a, layer_id)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a)

    def forward(self, context: Tensor, is_context: Tensor, h: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> Tensor:
        x = self.attention_norm(h)
        kv_rows = is_context * context + (1 - is_context) * x  # exact: is_context is 0 or 1
        h = h + self.attention(kv_rows, x, cos, sin, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class DFlashDraft(nn.Module):
    def __init__(self, a: DraftArgs):
        super().__init__()
        if not a.target_layer_ids:
            raise ValueError("draft.target_layer_ids is empty: the draft needs at least one tapped target layer")
        self.args = a
        self.fc = nn.Linear(a.feature_dim, a.dim, bias=False)
        self.hidden_norm = RMSNorm(a.dim, a.norm_eps)
        self.layers = nn.ModuleList(DraftBlock(a, i) for i in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        inv_freq = 1.0 / a.rope_base ** (torch.arange(0, a.head_dim, 2).float() / a.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def layer_kv(self) -> list[LayerKV]:
        return self.args.layer_kv()

    def rows(self, features: Tensor, embeddings: Tensor, is_context: Tensor, positions: Tensor) -> Tensor:
        """The draft over one token axis of N rows, context and block rows in any order (a batch of
        sequences: each one's context rows, then its block). features [1, N, taps * dim]: the target's
        tapped hidden states (context rows; zeros elsewhere); embeddings [1, N, dim]: the block's
        (block rows; ignored elsewhere); is_context [N] (1.0 / 0.0); positions [N] -> normed hidden
        [1, N, dim], meaningful on block rows only.

        Context rows give keys and values from the context; their queries are answered and dropped (on
        one token axis every row asks, and no block row reads another row's output)."""
        context = self.hidden_norm(self.fc(features))
        is_context = is_context[None, :, None].to(context.dtype)
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = torch.cos(angles), torch.sin(angles)
        h = embeddings
        for layer in self.layers:
            h = layer(context, is_context, h, cos, sin, positions)
        return self.norm(h)

    def forward(self, features: Tensor, block: Tensor, ctx_positions: Tensor, block_positions: Tensor) -> Tensor:
        """One sequence: features [1, C, taps * dim] of its C new context positions, block [1, B, dim] the
        block's embeddings -> the block's normed hidden [1, B, dim]."""
        n_ctx, n_blk = features.shape[1], block.shape[1]
        features = torch.cat([features, features.new_zeros(1, n_blk, features.shape[2])], dim=1)
        embeddings = torch.cat([block.new_zeros(1, n_ctx, block.shape[2]), block], dim=1)
        is_context = torch.cat([torch.ones(n_ctx), torch.zeros(n_blk)])
        return self.rows(features, embeddings, is_context, torch.cat([ctx_positions, block_positions]))[:, n_ctx:]


def build_draft(args: DraftArgs, seed: int) -> DFlashDraft:
    return seeded(lambda: DFlashDraft(args), seed)


class DraftForward(nn.Module):
    """The artifact's ``draft_forward``: the draft over a step of context and block rows
    (``DFlashDraft.rows``), its tokens embedded and its ``logit_rows`` projected by the target's
    table and head (shared weights: the program stores them once)."""

    def __init__(self, target, draft: DFlashDraft):
        super().__init__()
        self.target, self.draft = target, draft

    def forward(self, features: Tensor, tokens: Tensor, is_context: Tensor, positions: Tensor, logit_rows: Tensor) -> Tensor:
        hidden = self.draft.rows(features, self.target.embed(tokens), is_context, positions)
        return self.target.logits(hidden[0][logit_rows])

