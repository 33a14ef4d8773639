"""The decoder's settings, free of torch: the config schema and the feasibility checks read them
before anything heavy is imported."""

from dataclasses import dataclass


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
    hidden_dim: int = 176
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    sliding_window: int = 0  # keys a ring layer sees, counting the query itself
    layer_pattern: str = "F"  # repeated over layers: F = flat (global), R = ring (sliding window)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def layer_kv(self) -> list[LayerKV]:
        kinds = (self.layer_pattern * self.n_layers)[: self.n_layers]
        return [LayerKV(window=self.sliding_window if kind == "R" else 0) for kind in kinds]

    def n_parameters(self) -> int:
        """Weights of ``models/transformer.py``'s Transformer with these settings."""
        attention = self.dim * self.n_heads * self.head_dim * 2 + self.dim * self.n_kv_heads * self.head_dim * 2
        block = attention + 3 * self.dim * self.hidden_dim + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * block + self.dim + head


def model_args(model_cfg) -> ModelArgs:
    """The ``model`` config section as the decoder's settings."""
    return ModelArgs(**{k: model_cfg[k] for k in ModelArgs.__dataclass_fields__})
