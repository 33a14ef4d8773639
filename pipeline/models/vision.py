"""A SigLIP-style vision encoder and SmolVLM's connector, for one fixed square image size.

Patches (a strided convolution) plus learned position embeddings, pre-norm encoder layers
(LayerNorm, non-causal multi-head attention with biases, a tanh-GELU MLP), a final LayerNorm; the
connector folds each ``scale_factor x scale_factor`` square of patch features into one token
(pixel shuffle) and projects it to the target's width. The image's tokens replace the embeddings of
the prompt's image placeholder tokens. ``transformers``' SmolVLM vision tower and connector are the
reference (``tests/test_vision.py``).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.models.args import VisionArgs


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


def build_vision(args: VisionArgs, seed: int) -> VisionEncoder:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        encoder = VisionEncoder(args)
    finally:
        torch.random.set_rng_state(state)
    return encoder.eval().requires_grad_(False)
