"""A Llama-family decoder whose attention calls the neutral KV op.

RMSNorm, RoPE, grouped-query attention, SwiGLU, optional tied embeddings and
sliding-window (ring) layers by pattern; the families' options (``models/families.py``): q/k/v
biases (Qwen2), per-head q/k RMSNorm (Qwen3), a head dim of its own, RoPE scaling, partial rotary and
layers without RoPE (``models/rope.py``; Llama 3.x, Phi-3/4, SmolLM3), GeGLU, scaled embeddings and a RoPE
base per layer kind (Gemma 3), sandwich norms (Gemma 3, Muse Glimmer). Tokens of every sequence in a step
share one token axis (B = 1); which sequence a token belongs to is not a model
input: it reaches the KV store through step buffers added by ``lower_kv``.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.kv.op import default_scale
from pipeline.models.args import ModelArgs, RopeScaling
from pipeline.models.rope import frequencies


def _f32(x: Tensor) -> Tensor:
    # skipping a no-op cast keeps it out of the exported graph, where it splits delegate partitions
    return x if x.dtype == torch.float32 else x.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None

    def forward(self, x: Tensor) -> Tensor:
        x32 = _f32(x)
        normed = x32 * torch.rsqrt(_mean_square(x32) + self.eps)
        if self.weight is None:
            return normed.to(x.dtype)
        return normed.to(x.dtype) * self.weight if x.dtype != torch.float32 else normed * self.weight


def _mean_square(x: Tensor) -> Tensor:
    """mean(x^2) over the last dim, keepdim, for x = [1, T, ...] with T the only dynamic size.

    Written as a 4-D global average pool ([1, rows, D, 1] over its last two dims), the one form of
    mean XNNPACK takes; the plain mean stays out of the delegate and splits the layer's partition
    at every norm."""
    pooled = (x * x).view(1, -1, x.shape[-1], 1).mean((2, 3), keepdim=True)
    return pooled.view(1, -1, *x.shape[2:-1], 1)


def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    # x: [1, T, H, D]  cos/sin: [T, R/2] with R <= D rotated dims (the first R; the rest pass: Phi-3's
    # partial rotary); rotate halves (Llama's rotate_half form) or adjacent pairs (2i, 2i+1: llama.cpp's
    # normal mode, Muse Glimmer)
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat([rope(x[..., :rotated], cos, sin, interleaved), x[..., rotated:]], dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    x32 = _f32(x)
    if interleaved:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = x32.chunk(2, dim=-1)
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, args.qk_norm_weight) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, args.qk_norm_weight) if args.qk_norm else None
        self.wg = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False) if args.attn_gate else None
        self.fused = None  # wq, wk, wv as one (models/fuse.py), once quantized
        self.use_rope = args.layer_has_rope(layer_id)
        self.rope_interleaved = args.rope_interleaved
        self.scale = args.attn_scale or default_scale(args.head_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, position: Tensor) -> Tensor:
        _, n_tok, _ = x.shape
        q, k, v = self.fused(x) if self.fused is not None else (self.wq(x), self.wk(x), self.wv(x))
        q = q.reshape(1, n_tok, self.n_heads, self.head_dim)  # [1, T, Hq, D]
        k = k.reshape(1, n_tok, self.n_kv_heads, self.head_dim)
        v = v.reshape(1, n_tok, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:  # per head, before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = rope(q, cos, sin, self.rope_interleaved), rope(k, cos, sin, self.rope_interleaved)
        # q: [1, Hq, T, D]  k, v: [1, Hkv, T, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = torch.ops.kvcache.update_and_attend(
            q, k, v, position.view(-1, 1), self.layer_id, self.scale, q.dtype
        )
        out = out.transpose(1, 2)  # [1, T, Hq, Dv]
        if self.wg is not None:
            out = torch.sigmoid(self.wg(x).view(1, n_tok, self.n_heads, self.head_dim)) * out
        return self.wo(out.reshape(1, n_tok, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.gelu = args.mlp_act == "gelu_tanh"  # GeGLU (Gemma), else SwiGLU
        self.fused = None  # w1, w3 as one (models/fuse.py), once quantized

    def forward(self, x: Tensor) -> Tensor:
        g, u = self.fused(x) if self.fused is not None else (self.w1(x), self.w3(x))
        gate = F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)
        return self.w2(gate * u)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)
        # sandwich norms (Gemma 3, Muse Glimmer): the branch outputs are normalised before the residual adds
        self.local_rope = args.rope_local_base > 0 and args.layer_kv()[layer_id].window > 0
        self.post_attn_norm = RMSNorm(args.dim, args.post_norm_eps) if args.post_norms else nn.Identity()
        self.post_ffn_norm = RMSNorm(args.dim, args.post_norm_eps) if args.post_norms else nn.Identity()

    def forward(self, x: Tensor, rotations: dict, position: Tensor) -> Tensor:
        cos, sin = rotations["local" if self.local_rope else "global"]
        h = x + self.post_attn_norm(self.attention(self.attention_norm(x), cos, sin, position))
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.embed_norm = RMSNorm(args.dim, args.norm_eps, weight=False) if args.embed_norm else None
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # RoPE per layer kind: global (flat layers, and ring layers unless they have a base of their own)
        inv_freq, self.rope_factor = frequencies(args.rope_base, args.rotary_dim, args.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if args.rope_local_base > 0:
            local, _ = frequencies(args.rope_local_base, args.rotary_dim, RopeScaling())
            self.register_buffer("local_inv_freq", local, persistent=False)

    def embed(self, tokens: Tensor) -> Tensor:
        # tokens: [T] -> [1, T, dim]
        x = self.tok_embeddings(tokens)[None]
        if self.args.embed_scale:
            x = x * self.args.dim**0.5
        return self.embed_norm(x) if self.embed_norm is not None else x

    def rotations(self, positions: Tensor) -> dict:
        """{layer kind: (cos, sin) [T, rotary_dim / 2]} at ``positions``: computed once per step for all layers."""
        out = {}
        for kind, inv_freq, factor in (("global", self.inv_freq, self.rope_factor),
                                       ("local", getattr(self, "local_inv_freq", None), 1.0)):
            if inv_freq is not None:
                angles = positions.float()[:, None] * inv_freq[None, :]
                cos, sin = torch.cos(angles), torch.sin(angles)
                out[kind] = (cos * factor, sin * factor) if factor != 1.0 else (cos, sin)
        return out

    def hidden(self, embeddings: Tensor, positions: Tensor) -> Tensor:
        # embeddings: [1, T, dim]  positions: [T] -> normed hidden [T, dim]
        return self.hidden_and_taps(embeddings, positions, ())[0]

    def hidden_and_taps(self, embeddings: Tensor, positions: Tensor, taps) -> tuple[Tensor, Tensor | None]:
        """The normed hidden [T, dim] and the outputs of layers ``taps`` concatenated, [T, len(taps) * dim]
        (a DFlash draft's context features; None without taps)."""
        rotations = self.rotations(positions)
        h, tapped = embeddings, {}
        for i, layer in enumerate(self.layers):
            h = layer(h, rotations, positions)
            if i in taps:
                tapped[i] = h[0]
        return self.norm(h)[0], torch.cat([tapped[i] for i in taps], dim=-1) if taps else None

    def logits(self, hidden: Tensor) -> Tensor:
        # hidden: [R, dim] -> [R, vocab]
        # the head as a module call: a quantized head's module decides how it computes (pipeline/quant)
        logits = _f32(F.linear(hidden, self.tok_embeddings.weight) if self.output is None else self.output(hidden))
        a = self.args
        if a.logit_soft_cap > 0:
            return torch.tanh(logits * a.logit_multiplier / a.logit_soft_cap) * a.logit_soft_cap
        return logits * a.logit_multiplier if a.logit_multiplier != 1.0 else logits


def seeded(make, seed: int) -> nn.Module:
    """``make()`` random-initialised from ``seed`` (the global generator restored after), in eval mode
    without gradients: same seed, same weights, on any machine."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        module = make()
    finally:
        torch.random.set_rng_state(generator_state)
    return module.eval().requires_grad_(False)


def build_model(args: ModelArgs, seed: int) -> Transformer:
    return seeded(lambda: Transformer(args), seed)


# --- the artifact's methods: thin views that torch.export traces one by one ---


class EmbedText(nn.Module):
    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model.embed(tokens)


class TargetForward(nn.Module):
    """A step of any width; logits only for ``logit_rows`` (the tokens a sampler reads) and, for a
    draft, the tapped features of every token of the step ([T, taps * dim])."""

    def __init__(self, model: Transformer, taps: tuple[int, ...] = ()):
        super().__init__()
        self.model, self.taps = model, tuple(taps)

    def forward(self, embeddings: Tensor, positions: Tensor, logit_rows: Tensor):
        hidden, features = self.model.hidden_and_taps(embeddings, positions, self.taps)
        logits = self.model.logits(hidden[logit_rows])
        return logits if not self.taps else (logits, features)
