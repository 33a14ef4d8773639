"""A SigLIP-style vision encoder and SmolVLM's connector, for one fixed square image size.

Patches (a strided convolution) plus learned position embeddings, pre-norm encoder layers
(LayerNorm, non-causal multi-head attention with biases, a tanh-GELU MLP), a final LayerNorm; the
connector folds each ``scale_factor x scale_factor`` square of patch features into one token
(pixel shuffle) and projects it to the target's width. The image's tokens replace the embeddings of
the prompt's image placeholder tokens. ``transformers``' SmolVLM vision tower and connector are the
reference (``tests/test_vision.py``).

Muse Glimmer's tower (``GlimmerVisionEncoder``) is the other family: host-precomputed inputs,
2D RoPE, per-tile attention on most layers, a 2x2 downsample, an adapter and a scaleless RMSNorm;
ExecuTorch's ``muse_glimmer.model.vision_tower`` is its reference.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.models.args import GlimmerVisionArgs, VisionArgs
from pipeline.models.transformer import rope, seeded


class VisionAttention(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.n_heads, self.head_dim = a.n_heads, a.dim // a.n_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(a.dim, a.dim) for _ in range(3))
        self.out_proj = nn.Linear(a.dim, a.dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape

        def heads(t):
            return t.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, N, D]

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        weights = torch.softmax((q @ k.transpose(-1, -2)).float() * self.head_dim**-0.5, dim=-1).to(q.dtype)
        return self.out_proj((weights @ v).transpose(1, 2).reshape(b, n, -1))


class VisionLayer(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.attention = VisionAttention(a)
        self.layer_norm2 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.fc1, self.fc2 = nn.Linear(a.dim, a.hidden_dim), nn.Linear(a.hidden_dim, a.dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.layer_norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


def pixel_shuffle(x: Tensor, scale: int) -> Tensor:
    """[B, side*side, C] patch features -> [B, side*side / scale^2, C * scale^2]: each scale x scale
    square of patches (row-major within the square: row offset, then column offset) is one token."""
    b, n, c = x.shape
    side = int(n**0.5)
    x = x.view(b, side // scale, scale, side // scale, scale, c)  # [B, row block, row in block, col block, col in block, C]
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, n // scale**2, c * scale**2)


class VisionEncoder(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        if a.image_size % (a.patch_size * a.scale_factor):
            raise ValueError(f"vision.image_size={a.image_size} must be a multiple of patch_size x scale_factor "
                             f"= {a.patch_size * a.scale_factor}")
        self.args = a
        self.patch_embedding = nn.Conv2d(a.num_channels, a.dim, kernel_size=a.patch_size, stride=a.patch_size)
        self.position_embedding = nn.Embedding(a.n_patches, a.dim)
        self.layers = nn.ModuleList(VisionLayer(a) for _ in range(a.n_layers))
        self.post_layernorm = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.projection = nn.Linear(a.dim * a.scale_factor**2, a.out_dim, bias=False)

    def forward(self, pixels: Tensor) -> Tensor:
        """pixels [B, C, image_size, image_size] (the image processor's output) -> image tokens
        [B, n_image_tokens, out_dim]."""
        a = self.args
        if tuple(pixels.shape[1:]) != (a.num_channels, a.image_size, a.image_size):
            raise ValueError(f"pixels of shape {tuple(pixels.shape)}; the encoder takes "
                             f"[B, {a.num_channels}, {a.image_size}, {a.image_size}]")
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2) + self.position_embedding.weight
        for layer in self.layers:
            x = layer(x)
        return self.projection(pixel_shuffle(self.post_layernorm(x), a.scale_factor))


    def example_input(self) -> Tensor:
        a = self.args
        return torch.zeros(1, a.num_channels, a.image_size, a.image_size)


def build_vision(args, seed: int) -> nn.Module:
    """The artifact's encoder for ``args``' family: SmolVLM-style, or Muse Glimmer's for one image size."""
    if isinstance(args, GlimmerVisionArgs):
        return seeded(lambda: GlimmerImageEncoder(args), seed)
    return seeded(lambda: VisionEncoder(args), seed)


# --- Muse Glimmer's tower: host-precomputed patches, positions, 2D RoPE and tilings ---


class GlimmerVisionBlock(nn.Module):
    """Pre-LayerNorm block: biased q/k/v/o, 2D RoPE on adjacent pairs, attention under a given mask,
    an erf-GELU MLP."""

    def __init__(self, a: GlimmerVisionArgs):
        super().__init__()
        self.n_heads, self.head_dim = a.n_heads, a.latent_dim // a.n_heads
        self.ln_1, self.ln_2 = nn.LayerNorm(a.latent_dim), nn.LayerNorm(a.latent_dim)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(a.latent_dim, a.latent_dim) for _ in range(4))
        self.c_fc, self.c_proj = nn.Linear(a.latent_dim, a.mlp_hidden), nn.Linear(a.mlp_hidden, a.latent_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        h = self.ln_1(x)
        b, p, _ = h.shape

        def heads(t):
            return t.view(b, p, self.n_heads, self.head_dim)

        q = rope(heads(self.q_proj(h)), cos, sin, interleaved=True).transpose(1, 2)
        k = rope(heads(self.k_proj(h)), cos, sin, interleaved=True).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)).float() * self.head_dim**-0.5
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
        x = x + self.o_proj((weights @ heads(self.v_proj(h)).transpose(1, 2)).transpose(1, 2).reshape(b, p, -1))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GlimmerVisionEncoder(nn.Module):
    """Host inputs (ExecuTorch's ``precompute_vision_inputs``: patches, interpolated position
    embeddings, 2D RoPE tables, the tile permutation and its inverse, the global and per-tile masks,
    the pixel-shuffle gather) -> image tokens [1, P / f^2, hidden_size]."""

    def __init__(self, a: GlimmerVisionArgs):
        super().__init__()
        self.args = a
        self.conv1_linear = nn.Linear(a.patch_dim, a.latent_dim, bias=False)
        self.ln_pre, self.ln_post = nn.LayerNorm(a.latent_dim), nn.LayerNorm(a.latent_dim)
        self.blocks = nn.ModuleList(GlimmerVisionBlock(a) for _ in range(a.n_layers))
        self.adapter_fc = nn.Linear(a.latent_dim * a.downsample_factor**2, a.adapter_dim, bias=False)
        self.adapter_proj = nn.Linear(a.adapter_dim, a.adapter_dim, bias=False)
        self.vision_proj = nn.Linear(a.adapter_dim, a.hidden_size, bias=False)

    def forward(self, patches: Tensor, pos_emb: Tensor, cos_2d: Tensor, sin_2d: Tensor, sparse_perm: Tensor,
                inv_perm: Tensor, global_mask: Tensor, sparse_mask: Tensor, pixel_perm: Tensor) -> Tensor:
        a = self.args
        x = self.ln_pre(self.conv1_linear(patches) + pos_emb.to(patches.dtype))
        # tiles contiguous: global layers see every patch, the others one tile (the masks say which)
        x, cos, sin = x.index_select(1, sparse_perm), cos_2d.index_select(0, sparse_perm), sin_2d.index_select(0, sparse_perm)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, global_mask if a.layer_is_global(i) else sparse_mask)
        x = self.ln_post(x.index_select(1, inv_perm))
        # 2x2 downsample: the gather groups each square's f*f patches; features are patch-minor
        f, d = a.downsample_factor, a.latent_dim
        x = x[0].index_select(0, pixel_perm).view(-1, f * f, d).transpose(1, 2).reshape(1, -1, d * f * f)
        x = self.vision_proj(F.gelu(self.adapter_proj(F.gelu(self.adapter_fc(x)))))
        return F.rms_norm(x, (a.hidden_size,), None, a.rms_norm_eps)


def glimmer_config(a: GlimmerVisionArgs):
    """ExecuTorch's ``MuseGlimmerVisionConfig`` for these settings (its host precompute reads it)."""
    from executorch.examples.models.muse_glimmer.vision.precompute import MuseGlimmerVisionConfig

    return MuseGlimmerVisionConfig(
        patch_size=a.patch_size, patch_temporal=a.patch_temporal, downsample_factor=a.downsample_factor,
        sparse_attention_factor=a.sparse_attention_factor, pos_emb_grid_h=a.pos_grid, pos_emb_grid_w=a.pos_grid,
        latent_dim=a.latent_dim, n_heads=a.n_heads, n_layers=a.n_layers, rope_theta=a.rope_theta, mlp_hidden=a.mlp_hidden,
        adapter_dim=a.adapter_dim, encoder_output_dim=a.latent_dim * a.downsample_factor**2, hidden_size=a.hidden_size,
        rms_norm_eps=a.rms_norm_eps)


# the host inputs that depend only on the image size (and the position table), kept as buffers
HOST_INPUTS = ("pos_emb", "cos_2d", "sin_2d", "sparse_perm", "inv_perm", "global_mask", "sparse_mask", "pixel_perm")


class GlimmerImageEncoder(nn.Module):
    """Muse Glimmer's tower as the artifact's ``vision_encoder`` for one image size: the host inputs
    that depend only on the size (interpolated positions, 2D RoPE, the tile permutation, the masks,
    the pixel-shuffle gather) are computed once with ExecuTorch's precompute and kept as buffers; the
    method takes the image's patches [1, P, patch_dim] (``precompute.patchify_image``)."""

    def __init__(self, a: GlimmerVisionArgs):
        super().__init__()
        step = a.patch_size * a.downsample_factor
        if a.image_size % step:
            raise ValueError(f"vision.image_size={a.image_size} must be a multiple of patch_size x downsample = {step}")
        self.args = a
        self.encoder = GlimmerVisionEncoder(a)
        self.pos_embed_table = nn.Parameter(torch.randn(a.pos_grid**2, a.latent_dim))
        for name, value in self._host_inputs(self.pos_embed_table.data).items():
            self.register_buffer(name, value, persistent=False)

    def _host_inputs(self, table: Tensor) -> dict[str, Tensor]:
        from executorch.examples.models.muse_glimmer.vision.precompute import precompute_vision_inputs

        a = self.args
        with torch.no_grad():
            inputs = precompute_vision_inputs(torch.zeros(3, a.image_size, a.image_size), table, glimmer_config(a))
        return {name: getattr(inputs, name).clone() for name in HOST_INPUTS}

    def set_position_table(self, table: Tensor) -> None:
        """A loaded position table [pos_grid^2, latent_dim] (float32): kept, and the buffers computed
        from it (the interpolated positions) computed again, in their dtypes."""
        with torch.no_grad():
            self.pos_embed_table.copy_(table)
            for name, value in self._host_inputs(table.float()).items():
                getattr(self, name).copy_(value)

    def forward(self, patches: Tensor) -> Tensor:
        return self.encoder(patches, self.pos_emb, self.cos_2d, self.sin_2d, self.sparse_perm, self.inv_perm,
                            self.global_mask, self.sparse_mask, self.pixel_perm)

    def example_input(self) -> Tensor:
        return torch.zeros(1, self.args.n_patches, self.args.patch_dim)
