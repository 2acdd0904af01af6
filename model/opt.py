"""The OPT decoder, readable top to bottom (nanoGPT style), parameter names as Hugging Face's.

Token embeddings + learned positional embeddings (offset by 2, as OPT's checkpoints index them),
then n_layer blocks of causal self-attention and a ReLU FFN of 4 * d_model, each pre-LN (or
post-LN, as 350M), a final LayerNorm (pre-LN only), and the output projection tied to the token
embeddings. Dropout on the residual branches, not on the embeddings.

Module names follow `transformers`' OPTForCausalLM without its "model." prefix
(decoder.layers.0.self_attn.q_proj.weight, ...), so export and import (model/hf.py) are a rename.

Monitoring for the stability autopilot: every forward leaves `last_activation_norm`, the mean L2
norm of the final layer's output per token (OPT saw divergence follow its growth), computed
without gradient; `block_grad_norms()` gives each block's gradient norm after a backward.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.configs import OPTConfig
from model.loss import linear_cross_entropy

POSITION_OFFSET = 2  # OPT's checkpoints keep two unused rows before position 0


def init_(name: str, tensor: torch.Tensor, config: OPTConfig, generator: torch.Generator | None = None) -> None:
    """OPT's init of the parameter called `name`, in place: normal(0, init_std); each block's output
    projections (out_proj, fc2) scaled by 1/sqrt(2 * n_layer); biases 0; LayerNorms 1 and 0.

    Every rule is elementwise (i.i.d. or constant), so it applies as well to any slice of the
    parameter: a ZeRO-3 partition is initialized where it lives, with a generator of its own
    (train/build.py), without ever gathering the whole parameter."""
    with torch.no_grad():
        if "layer_norm" in name:
            tensor.fill_(1.0 if name.endswith("weight") else 0.0)
        elif name.endswith("bias"):
            tensor.zero_()
        elif name.endswith(("out_proj.weight", "fc2.weight")):
            tensor.normal_(0.0, config.init_std / math.sqrt(2 * config.n_layer), generator=generator)
        else:
            tensor.normal_(0.0, config.init_std, generator=generator)


def generator_for(seed: int, name: str) -> torch.Generator:
    """The random stream of one parameter: a function of the run's seed and the parameter's name only, so a
    model built piece by piece (a pipeline stage builds only its own layers) gets the same weights as one
    built whole."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def init_seeded(module: nn.Module, prefix: str, config: OPTConfig, seed: int) -> None:
    """OPT's init of every parameter of `module`, which sits at `prefix` in the whole model, each from its own stream."""
    for name, p in module.named_parameters():
        full = f"{prefix}.{name}" if prefix else name
        init_(full, p, config, generator=generator_for(seed, full))


class Attention(nn.Module):
    def __init__(self, config: OPTConfig):
        super().__init__()
        d = config.d_model
        self.head_dim, self.dropout = config.head_dim, config.attn_dropout
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, C) -> (B, heads, T, head_dim): all n_head heads, or a tensor-parallel rank's share of them
        # (train/parallel/groups.py splits q/k/v by heads), so the head count is read off the projection
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, config: OPTConfig):
        super().__init__()
        self.pre_ln, self.dropout = config.pre_ln, config.dropout
        self.self_attn = Attention(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(config.d_model, config.ffn_dim)
        self.fc2 = nn.Linear(config.ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d_model) -> same
        h = self.self_attn(self.self_attn_layer_norm(x) if self.pre_ln else x)
        x = x + F.dropout(h, self.dropout, self.training)
        if not self.pre_ln:
            x = self.self_attn_layer_norm(x)
        h = self.fc2(F.relu(self.fc1(self.final_layer_norm(x) if self.pre_ln else x)))
        x = x + F.dropout(h, self.dropout, self.training)
        return x if self.pre_ln else self.final_layer_norm(x)


class TokenEmbedding(nn.Embedding):
    """The token embeddings, and the output layer tied to them."""

    def output(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, d_model) -> (B, T, vocab_size) logits, or with (B, T) targets the mean cross-entropy (computed
        a block of rows at a time, without the whole logits: model/loss.py)."""
        return self.logits(x) if targets is None else linear_cross_entropy(x, self.weight, targets)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


class Decoder(nn.Module):
    def __init__(self, config: OPTConfig):
        super().__init__()
        self.embed_tokens = TokenEmbedding(config.vocab_size, config.d_model)
        self.embed_positions = nn.Embedding(config.max_seq_len + POSITION_OFFSET, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.final_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.pre_ln else None


class OPT(nn.Module):
    def __init__(self, config: OPTConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        self.decoder = Decoder(config)
        self.last_activation_norm: torch.Tensor | None = None
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int | None = None) -> None:
        """OPT's init; with a seed, each parameter from a stream of its own (`generator_for`), else all from
        torch's global generator in turn."""
        if seed is not None:
            init_seeded(self, "", self.config, seed)
            return
        for name, p in self.named_parameters():
            init_(name, p, self.config)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) token ids -> (B, T, vocab_size) logits; with (B, T) targets, the mean cross-entropy."""
        return self.decoder.embed_tokens.output(self.hidden(input_ids), targets)

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, d_model): the embeddings, every block, the final LayerNorm."""
        B, T = input_ids.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence of {T} tokens, the model takes at most {self.config.max_seq_len}")
        d = self.decoder
        positions = torch.arange(T, device=input_ids.device) + POSITION_OFFSET
        x = d.embed_tokens(input_ids) + d.embed_positions(positions)  # (B, T, d_model)
        for block in d.layers:
            if self.config.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if d.final_layer_norm is not None:
            x = d.final_layer_norm(x)
        with torch.no_grad():  # a tensor, so that no step waits for it unless it is read
            self.last_activation_norm = x.detach().float().norm(dim=-1).mean()
        return x

    def block_grad_norms(self) -> list[float]:
        """Each block's gradient L2 norm (after backward; 0 for a block without gradients)."""
        out = []
        for block in self.decoder.layers:
            grads = [p.grad.detach().float().norm() ** 2 for p in block.parameters() if p.grad is not None]
            out.append(torch.stack(grads).sum().sqrt().item() if grads else 0.0)
        return out
