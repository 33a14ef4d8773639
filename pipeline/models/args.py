"""The decoder's settings, free of torch: the config schema and the feasibility checks read them
before anything heavy is imported."""

from dataclasses import dataclass, field

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")  # transformers' rope_type names
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU (Llama) | GeGLU with tanh-approximated GELU (Gemma)


@dataclass
class RopeScaling:
    """RoPE beyond a base frequency (``models/rope.py``), in the names of transformers' ``rope_parameters``.

    Static only: ``dynamic`` is plain RoPE up to ``original_context`` and ``longrope`` uses its short
    factors up to it; a build whose context goes beyond is refused (the frequencies would depend on the
    sequence's length)."""

    type: str = "default"  # default | linear | dynamic | llama3 | yarn | longrope
    factor: float = 1.0  # linear, dynamic, llama3, yarn; longrope: max_position_embeddings / original_context (the readers fill it)
    original_context: int = 0  # the context the model was pretrained on (original_max_position_embeddings)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the ramp's ends to whole dims
    attention_factor: float = 0.0  # yarn, longrope: cos and sin scaled by it; 0: derived from factor
    short_factor: list[float] | None = None  # longrope: per rotated pair
    long_factor: list[float] | None = None  # longrope (read and kept; used only beyond original_context)


@dataclass(frozen=True)
class LayerKV:
    window: int  # 0: flat (global) layer; > 0: sliding-window (ring) layer


@dataclass
class ModelArgs:
    vocab_size: int = 512
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 0  # per attention head; 0: dim // n_heads
    hidden_dim: int = 176
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Muse Glimmer)
    qk_norm_weight: bool = True  # false: the q/k norms have no learned scale (Muse Glimmer)
    sliding_window: int = 0  # keys a ring layer sees, counting the query itself
    layer_pattern: str = "F"  # repeated over layers: F = flat (global), R = ring (sliding window)
    # --- Muse Glimmer's options ---
    rope_interleaved: bool = False  # rotate adjacent pairs (2i, 2i+1) instead of halves
    flat_layers_nope: bool = False  # flat (global) layers use no RoPE
    attn_gate: bool = False  # attention output gated by sigmoid(x @ W_gate), per head and dim
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs before the residual adds
    post_norm_eps: float = 1e-8
    embed_norm: bool = False  # token embeddings RMS-normalised (no learned scale)
    attn_scale: float = 0.0  # softmax scale; 0: 1 / sqrt(head_dim)
    logit_multiplier: float = 1.0
    logit_soft_cap: float = 0.0  # > 0: logits = cap * tanh(logits * multiplier / cap)
    ffn_dim_multiplier: float = 0.0  # Muse Glimmer: hidden_dim 0 is int(ffn_dim_multiplier * dim) (families.py)
    # --- RoPE variants (Llama 3.x, Phi-3/4, Gemma 3, SmolLM3) ---
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rope_dim: int = 0  # rotated dims of each head, the first ones (partial rotary: Phi-3/4); 0: head_dim
    rope_local_base: float = 0.0  # > 0: ring layers rotate at this base, unscaled (Gemma 3); 0: as flat layers
    rope_layers: str = ""  # per layer, 1: RoPE, 0: none (SmolLM3's no_rope_layers), repeated; "": every layer
    # --- Gemma 3 ---
    mlp_act: str = "silu"  # silu (SwiGLU) | gelu_tanh (GeGLU)
    embed_scale: bool = False  # token embeddings times sqrt(dim)

    def __post_init__(self):
        if not self.head_dim and self.n_heads > 0:
            self.head_dim = self.dim // self.n_heads
        if not isinstance(self.rope_scaling, RopeScaling):  # a mapping: the config's section
            self.rope_scaling = RopeScaling(**{k: list(v) if k in ("short_factor", "long_factor") and v is not None else v
                                               for k, v in self.rope_scaling.items()})

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim

    def layer_has_rope(self, layer_id: int) -> bool:
        if self.flat_layers_nope and self.layer_kv()[layer_id].window == 0:
            return False
        return not self.rope_layers or (self.rope_layers * self.n_layers)[layer_id] == "1"

    def layer_kv(self) -> list[LayerKV]:
        kinds = (self.layer_pattern * self.n_layers)[: self.n_layers]
        return [LayerKV(window=self.sliding_window if kind == "R" else 0) for kind in kinds]

    def n_parameters(self) -> int:
        """Weights of ``models/transformer.py``'s Transformer with these settings."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * q + 2 * self.dim * kv
        attention += (q + 2 * kv) * self.qkv_bias + 2 * self.head_dim * (self.qk_norm and self.qk_norm_weight)
        attention += self.dim * q * self.attn_gate
        block = attention + 3 * self.dim * self.hidden_dim + 2 * self.dim + 2 * self.dim * self.post_norms
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * block + self.dim + head


def model_args(model_cfg) -> ModelArgs:
    """The ``model`` config section as the decoder's settings."""
    return ModelArgs(**{k: model_cfg[k] for k in ModelArgs.__dataclass_fields__})


@dataclass
class DraftArgs:
    """A DFlash draft (``models/dflash.py``), in the reference's names where it has them."""

    block_size: int = 16  # positions a draft block proposes from: the last accepted token, then masks
    num_hidden_layers: int = 1
    target_layer_ids: tuple[int, ...] = ()  # target layers whose outputs feed the context
    mask_token_id: int = 0
    dim: int = 64  # the target's width (embeddings and the output head are the target's)
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    hidden_dim: int = 176
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    rope_interleaved: bool = False  # both references rotate halves (NEOX)

    @property
    def mlp_act(self) -> str:
        return "silu"  # SwiGLU (transformer.FeedForward reads it)

    @property
    def sliding_window(self) -> int:
        return 0

    def layer_kv(self) -> list[LayerKV]:
        """Every draft layer is flat: its history is the context of its sequence, seen whole."""
        return [LayerKV(window=0) for _ in range(self.num_hidden_layers)]

    @property
    def feature_dim(self) -> int:
        """Width of the target's tapped features the draft reads: one target width per tapped layer."""
        return len(self.target_layer_ids) * self.dim

    def n_parameters(self) -> int:
        """Weights of ``models/dflash.py``'s draft (the embeddings and head are the target's)."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        layer = 2 * self.dim * q + 2 * self.dim * kv + 2 * self.head_dim + 2 * self.dim + 3 * self.dim * self.hidden_dim
        return self.feature_dim * self.dim + 2 * self.dim + self.num_hidden_layers * layer


def draft_args(draft_cfg, target: ModelArgs) -> DraftArgs:
    """The ``draft`` config section over ``target``: its width is the target's (embeddings and head are
    shared), its tapped layers the reference's formula when not given."""
    given = {k: draft_cfg[k] for k in DraftArgs.__dataclass_fields__ if k in draft_cfg and draft_cfg[k] is not None}
    given["dim"] = target.dim
    if "target_layer_ids" not in given:
        given["target_layer_ids"] = default_target_layer_ids(target.n_layers, given.get("num_hidden_layers", 1))
    given["target_layer_ids"] = tuple(given["target_layer_ids"])
    return DraftArgs(**given)


def default_target_layer_ids(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """The reference's choice of tapped target layers: the middle one for a one-layer draft, else
    ``n_draft_layers`` spread evenly from layer 1 to layer n_target_layers - 3 (dflash's
    ``build_target_layer_ids``)."""
    if n_draft_layers == 1:
        return [n_target_layers // 2]
    span = n_target_layers - 4
    return [round(1 + i * span / (n_draft_layers - 1)) for i in range(n_draft_layers)]


@dataclass
class VisionArgs:
    """A SigLIP-style vision encoder with SmolVLM's connector (``models/vision.py``), for one
    fixed square image size."""

    image_size: int = 32
    patch_size: int = 8
    num_channels: int = 3
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int = 64
    norm_eps: float = 1e-6
    scale_factor: int = 2  # pixel shuffle: scale_factor**2 neighbouring patches become one token
    out_dim: int = 64  # the target's width

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def n_image_tokens(self) -> int:
        return self.n_patches // self.scale_factor**2

    def n_parameters(self) -> int:
        """Weights of ``models/vision.py``'s ``VisionEncoder``."""
        d, h = self.dim, self.hidden_dim
        layer = 4 * d + 4 * (d * d + d) + (d * h + h) + (h * d + d)
        patches = self.num_channels * self.patch_size**2 * d + d + self.n_patches * d
        return patches + self.n_layers * layer + 2 * d + d * self.scale_factor**2 * self.out_dim


VISION_FAMILIES = ("smolvlm", "muse_glimmer")  # vision.family: SmolVLM's tower and connector, Muse Glimmer's tower


def vision_args(vision_cfg, target: ModelArgs):
    """The ``vision`` config section as its family's encoder settings, the output at the target's width:
    ``VisionArgs`` (smolvlm) or ``GlimmerVisionArgs`` (muse_glimmer, in the config's common names)."""
    out_dim = vision_cfg.out_dim or target.dim
    if vision_cfg.family == "muse_glimmer":
        v = vision_cfg
        return GlimmerVisionArgs(
            patch_size=v.patch_size, patch_temporal=v.patch_temporal, downsample_factor=v.scale_factor,
            sparse_attention_factor=v.sparse_attention_factor, latent_dim=v.dim, n_heads=v.n_heads, n_layers=v.n_layers,
            mlp_hidden=v.hidden_dim, adapter_dim=v.adapter_dim, hidden_size=out_dim, rms_norm_eps=v.norm_eps,
            image_size=v.image_size, pos_grid=v.pos_grid, rope_theta=v.rope_theta)
    fields = {k: vision_cfg[k] for k in VisionArgs.__dataclass_fields__ if k in vision_cfg and k != "out_dim"}
    return VisionArgs(**fields, out_dim=out_dim)


@dataclass
class GlimmerVisionArgs:
    """Muse Glimmer's vision tower (``models/vision.py``), in the names of ExecuTorch's
    ``MuseGlimmerVisionConfig``; its inputs are precomputed on the host (``vision/precompute.py``)."""

    patch_size: int = 14
    patch_temporal: int = 2
    downsample_factor: int = 2
    sparse_attention_factor: int = 4  # every 4th layer (and the last) is global; the others attend per tile
    latent_dim: int = 32
    n_heads: int = 4
    n_layers: int = 6
    mlp_hidden: int = 64
    adapter_dim: int = 48
    hidden_size: int = 40  # the target's width
    rms_norm_eps: float = 1e-5
    # the artifact's method: one fixed image size, the learned position table it interpolates
    image_size: int = 56  # a multiple of patch_size * downsample_factor
    pos_grid: int = 8  # the position table is pos_grid x pos_grid
    rope_theta: float = 10000.0

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def n_image_tokens(self) -> int:
        return self.n_patches // self.downsample_factor**2

    def n_parameters(self) -> int:
        """Weights of ``models/vision.py``'s ``GlimmerImageEncoder``."""
        d, h, a = self.latent_dim, self.mlp_hidden, self.adapter_dim
        block = 4 * d + 4 * (d * d + d) + (d * h + h) + (h * d + d)
        adapter = d * self.downsample_factor**2 * a + a * a + a * self.hidden_size
        return self.patch_dim * d + 4 * d + self.n_layers * block + adapter + self.pos_grid**2 * d

    @property
    def patch_dim(self) -> int:
        return self.patch_temporal * 3 * self.patch_size**2

    def layer_is_global(self, i: int) -> bool:
        return i == self.n_layers - 1 or (i + 1) % self.sparse_attention_factor == 0
