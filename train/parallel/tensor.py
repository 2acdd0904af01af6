"""Megatron-style tensor parallelism: the layers, and the collectives they make, each one visible.

A tensor group of T ranks holds 1/T of each split weight. Two autograd functions carry all of the
communication (Megatron's "mappings"):

- `copy_to(x)`: identity forward; all-reduce of the gradient backward. Where a replicated activation
  enters a column-parallel layer: every rank's partial input gradient is summed.
- `reduce_from(x)`: all-reduce forward; identity backward. Where a row-parallel layer's partial
  outputs become the replicated activation again.

So a column-parallel layer followed by a row-parallel one (q/k/v -> out_proj, fc1 -> fc2) costs one
all-reduce forward and one backward. The vocabulary-parallel embedding masks the ids outside its
rows and sums over the group; the tied output layer gives each rank the logits of its rows, and
`vocab_parallel_cross_entropy` finds the loss from them without ever gathering (B, T, vocab).

Parameters that are split carry `tensor_model_parallel = True`, which DeepSpeed reads
(deepspeed/runtime/utils.py: is_model_parallel_parameter) so that the gradient norm counts every
shard and each replicated parameter once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFrom.apply(x, group)


def _mark(p: nn.Parameter, dim: int) -> nn.Parameter:
    """A split parameter: DeepSpeed's flag, and the dimension its shards concatenate along."""
    p.tensor_model_parallel, p.partition_dim = True, dim
    return p


class ColumnParallelLinear(nn.Module):
    """y[..., rows of this rank] = x W_r^T + b_r: the output features split over the group."""

    def __init__(self, full: nn.Linear, group, rank: int, size: int):
        super().__init__()
        self.group = group
        rows = full.out_features // size
        self.weight = _mark(nn.Parameter(full.weight.detach()[rank * rows:(rank + 1) * rows].clone()), 0)
        self.bias = _mark(nn.Parameter(full.bias.detach()[rank * rows:(rank + 1) * rows].clone()), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) replicated -> (..., out / T) this rank's
        return F.linear(copy_to(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, + b: the input features split, the output replicated."""

    def __init__(self, full: nn.Linear, group, rank: int, size: int):
        super().__init__()
        self.group = group
        cols = full.in_features // size
        self.weight = _mark(nn.Parameter(full.weight.detach()[:, rank * cols:(rank + 1) * cols].clone()), 1)
        self.bias = nn.Parameter(full.bias.detach().clone())  # replicated: added once, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in / T) this rank's -> (..., out) replicated
        return reduce_from(F.linear(x, self.weight), self.group) + self.bias


class VocabParallelEmbedding(nn.Module):
    """The token embedding, rows [start, start + V/T) on this rank; also the tied output layer's weight."""

    def __init__(self, full: nn.Embedding, group, rank: int, size: int):
        super().__init__()
        self.group = group
        rows = full.num_embeddings // size
        self.start, self.end = rank * rows, (rank + 1) * rows
        self.weight = _mark(nn.Parameter(full.weight.detach()[self.start:self.end].clone()), 0)
        self.size = size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, d) replicated
        outside = (ids < self.start) | (ids >= self.end)
        x = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return reduce_from(x.masked_fill(outside.unsqueeze(-1), 0.0), self.group)

    def output(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The tied output layer (model/opt.py's TokenEmbedding.output): with targets the mean cross-entropy
        from this rank's logits; without, the whole (B, T, vocab) logits, gathered (for evaluation and tests)."""
        logits = self.logits(x)
        if targets is not None:
            return self.loss(logits, targets)
        shards = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(shards, logits.contiguous(), group=self.group)
        return torch.cat(shards, dim=-1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) replicated -> (B, T, V/T) this rank's rows
        return F.linear(copy_to(x, self.group), self.weight)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy over the group from each rank's (B, T, V/T) logits."""
        return vocab_parallel_cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1),
                                            self.start, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over rows of logits split by vocabulary: max, sum of exponentials and the
    target's logit are each one all-reduce of (N,) values; the gradient is softmax - one-hot, locally.
    A negative target (-100, as torch's cross_entropy ignores) is not scored: the mean is over the rest."""

    @staticmethod
    def forward(ctx, logits, targets, start, group):  # logits (N, V/T) fp32, targets (N,)
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        local = targets - start
        inside = (local >= 0) & (local < logits.size(-1))
        rows = torch.arange(logits.size(0), device=logits.device)
        target_logit = torch.where(inside, shifted[rows, local.clamp(0, logits.size(-1) - 1)], torch.zeros_like(top))
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(target_logit, group=group)
        dist.all_reduce(total, group=group)
        scored = targets >= 0
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, inside, scored)
        return ((total.log() - target_logit) * scored).sum() / scored.sum()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside, scored = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.size(0), device=g.device)[inside]
        g[rows, local[inside]] -= 1.0
        return g * scored.unsqueeze(-1) * (grad / scored.sum()), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, start: int, group) -> torch.Tensor:
    return _VocabParallelCrossEntropy.apply(logits, targets, start, group)
