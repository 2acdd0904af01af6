"""The OPT family (paper Table 1) as data, plus a `tiny` model for tests, and what each costs.

`get(name)` for "tiny", "125m", "350m", "1.3b", "2.7b", "6.7b", "13b", "30b", "66b", "175b".
350M is post-LayerNorm, as its released weights are; its released checkpoint also projects the
embeddings to 512 dimensions (word_embed_proj_dim), which this family does not model: ours is
Table 1's 1024 throughout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class OPTConfig:
    name: str
    n_layer: int
    n_head: int
    d_model: int
    lr: float  # peak learning rate (Table 1)
    batch_tokens: int  # global batch in tokens (Table 1)
    vocab_size: int = 50272  # GPT-2's BPE + OPT's 4 specials, padded to a multiple of 8
    max_seq_len: int = 2048
    pre_ln: bool = True  # False: post-LN (350M)
    dropout: float = 0.1  # residual branches (not the embeddings)
    attn_dropout: float = 0.0  # on the attention weights (OPT's released configs: 0.0)
    init_std: float = 0.006
    layer_norm_eps: float = 1e-5
    activation_checkpointing: bool = False

    @property
    def ffn_dim(self) -> int:
        return 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def replace(self, **changes) -> "OPTConfig":
        return dataclasses.replace(self, **changes)


_M = 1_000_000
CONFIGS = {c.name: c for c in [
    OPTConfig("tiny", 2, 4, 64, 1e-3, 4096, vocab_size=512, max_seq_len=128),
    OPTConfig("125m", 12, 12, 768, 6.0e-4, _M // 2),
    OPTConfig("350m", 24, 16, 1024, 3.0e-4, _M // 2, pre_ln=False),
    OPTConfig("1.3b", 24, 32, 2048, 2.0e-4, _M),
    OPTConfig("2.7b", 32, 32, 2560, 1.6e-4, _M),
    OPTConfig("6.7b", 32, 32, 4096, 1.2e-4, 2 * _M),
    OPTConfig("13b", 40, 40, 5120, 1.0e-4, 4 * _M),
    OPTConfig("30b", 48, 56, 7168, 1.0e-4, 4 * _M),
    OPTConfig("66b", 64, 72, 9216, 0.8e-4, 2 * _M),
    OPTConfig("175b", 96, 96, 12288, 1.2e-4, 2 * _M),
]}


def get(name: str) -> OPTConfig:
    if name not in CONFIGS:
        raise KeyError(f"unknown OPT size {name!r}; expected one of {', '.join(CONFIGS)}")
    return CONFIGS[name]


def param_count(config: OPTConfig) -> int:
    """Exact trainable parameters (the output layer is tied to the token embeddings)."""
    d = config.d_model
    embeddings = config.vocab_size * d + (config.max_seq_len + 2) * d  # HF's positions are offset by 2
    final_ln = 2 * d if config.pre_ln else 0
    return embeddings + config.n_layer * block_params(config) + final_ln


def block_params(config: OPTConfig) -> int:
    """One decoder block: attention (q, k, v, out with biases), the FFN, two LayerNorms."""
    d, f = config.d_model, config.ffn_dim
    return 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * (2 * d)


def flops_per_token(config: OPTConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward), for MFU.

    6 * (non-embedding parameters + vocab_size * d_model) + 12 * n_layer * d_model * seq_len:
    every weight is used in one multiply-add per token forward (2 FLOPs) and two backward (4);
    the tied output projection is a real (vocab x d_model) matmul although its weights are the
    embeddings; the embedding lookups cost nothing. The attention term is the QK^T and AV
    matmuls (2 * 2 * seq_len * d_model per token per layer forward, x3 with backward), as in
    PaLM's MFU; with a causal mask half of it is wasted work that kernels may skip, which this
    count (like PaLM's) does not credit.
    """
    t = seq_len or config.max_seq_len
    d = config.d_model
    non_embedding = param_count(config) - config.vocab_size * d - (config.max_seq_len + 2) * d
    return 6.0 * (non_embedding + config.vocab_size * d) + 12.0 * config.n_layer * d * t
