"""The DFlash draft: a few Qwen3-style layers that propose a block of tokens at once.

The published architecture (``dflash==0.1.0``'s ``DFlashDraftModel``; the Muse Glimmer draft of
``executorch.examples.models.muse_glimmer.model.dflash_model`` is the same shape): the target's
hidden states at ``target_layer_ids`` (concatenated) go through ``fc`` and ``hidden_norm`` into a
context; every layer projects keys and values from that context and from the block's own
(input-normed) hidden states, queries from the block only, and attends non-causally over both. The
block is the last accepted token followed by ``mask_token_id``s, embedded with the target's table;
its final hidden states go through the target's output head.

Attention goes through the neutral KV op, as the target's does: a call writes the new context rows
and the block rows at their positions and attends. Context rows carry zero queries, whose outputs
are dropped. The block rows are scratch: the caller rolls the draft's history back to the context
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

    def forward(self, context: Tensor, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> Tensor:
        # context [1, C, dim] (fc + hidden_norm), x [1, B, dim] (input-normed block); positions [C + B]
        a, n_ctx, n_blk = self.a, context.shape[1], x.shape[1]
        rows = torch.cat([context, x], dim=1)
        k = self.k_norm(self.wk(rows).view(1, n_ctx + n_blk, a.n_kv_heads, a.head_dim))
        v = self.wv(rows).view(1, n_ctx + n_blk, a.n_kv_heads, a.head_dim)
        q = self.q_norm(self.wq(x).view(1, n_blk, a.n_heads, a.head_dim))
        k = rope(k, cos, sin, a.rope_interleaved)
        q = rope(q, cos[n_ctx:], sin[n_ctx:], a.rope_interleaved)
        q = torch.cat([q.new_zeros(1, n_ctx, a.n_heads, a.head_dim), q], dim=1)  # context rows ask nothing
        out = torch.ops.kvcache.update_and_attend(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions.view(-1, 1),
            self.layer_id, default_scale(a.head_dim), q.dtype)
        return self.wo(out.transpose(1, 2)[:, n_ctx:].reshape(1, n_blk, -1))


class DraftBlock(nn.Module):
    def __init__(self, a: DraftArgs, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = DraftAttention(a, layer_id)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a)

    def forward(self, context: Tensor, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> Tensor:
        h = x + self.attention(context, self.attention_norm(x), cos, sin, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class DFlashDraft(nn.Module):
    def __init__(self, a: DraftArgs):
        super().__init__()
        if not a.target_layer_ids:
            raise ValueError("draft.target_layer_ids is empty: the draft needs at least one tapped target layer")
        self.args = a
        self.fc = nn.Linear(len(a.target_layer_ids) * a.dim, a.dim, bias=False)
        self.hidden_norm = RMSNorm(a.dim, a.norm_eps)
        self.layers = nn.ModuleList(DraftBlock(a, i) for i in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        inv_freq = 1.0 / a.rope_base ** (torch.arange(0, a.head_dim, 2).float() / a.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def layer_kv(self) -> list[LayerKV]:
        return [LayerKV(window=0) for _ in range(self.args.num_hidden_layers)]

    def forward(self, features: Tensor, block: Tensor, ctx_positions: Tensor, block_positions: Tensor) -> Tensor:
        """features [1, C, taps * dim]: the target's tapped hidden states of the C new context
        positions; block [1, B, dim]: the block's embeddings -> the block's normed hidden [1, B, dim]."""
        context = self.hidden_norm(self.fc(features))
        positions = torch.cat([ctx_positions, block_positions])
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = torch.cos(angles), torch.sin(angles)
        h = block
        for layer in self.layers:
            h = layer(context, h, cos, sin, positions)
        return self.norm(h)


def build_draft(args: DraftArgs, seed: int) -> DFlashDraft:
    return seeded(lambda: DFlashDraft(args), seed)

