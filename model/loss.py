"""The tied output layer and its cross-entropy in one pass, a block of rows at a time.

Why: at a small model the loss, not the blocks, is the step. A laptop's proxy model (d_model 64, a 4,096-token
vocabulary) spends over half of each CPU step writing and rereading the (tokens x vocabulary) fp32 logits:
32 MB per 2,048 tokens, for the forward product, the log-softmax, its gradient and a zero fill, each a pass over
main memory. At 1.3B the same tensor is 1.65 GB of a GPU's memory per micro-batch. Here each block's logits
live only while its loss and its gradient are computed (the gradient of a mean loss needs nothing from later
blocks), so they stay in cache and the full tensor never exists. Same arithmetic as `F.linear` then
`F.cross_entropy`, to rounding (tests/test_model.py holds it to that).

The gradients are computed in the forward pass and kept (N x d_model and vocabulary x d_model, the sizes of
the inputs); backward only scales them by the incoming gradient, as a scalar loss's backward does.
"""

from __future__ import annotations

import torch

# Bytes of fp32 logits per block: a CPU's L2-L3 cache; on a GPU a few blocks per micro-batch at 1.3B.
BLOCK_BYTES = {"cpu": 2 << 20, "cuda": 256 << 20}


def block_rows(vocab: int, device: torch.device) -> int:
    return max(1, BLOCK_BYTES.get(device.type, BLOCK_BYTES["cuda"]) // (4 * vocab))


def _blocks(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, want_x: bool, want_w: bool):
    """(mean loss, its gradient for x or None, for weight or None): x (N, d), weight (V, d), targets (N,).
    The gradients are of the unscaled loss. Under fp16 they are computed and kept in fp32: a loss scaler's factor
    comes only in backward, and an unscaled fp16 gradient would underflow (what the scaler is there to prevent);
    bf16 has fp32's range, so its products stay in bf16."""
    work = torch.float32 if x.dtype == torch.float16 else x.dtype
    w = weight.to(work)
    scored = targets >= 0  # a negative target (-100, as torch's cross_entropy ignores) is not scored
    count = scored.sum().clamp(min=1).float()
    grad_x = torch.zeros(x.shape, dtype=work, device=x.device) if want_x else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    rows = block_rows(weight.size(0), x.device)
    for start in range(0, x.size(0), rows):
        xb, tb, keep = x[start:start + rows], targets[start:start + rows], scored[start:start + rows]
        logits = (xb @ weight.t()).float()
        target_logit = logits.gather(1, index := tb.clamp(min=0).unsqueeze(1)).squeeze(1)
        peak = logits.amax(dim=-1, keepdim=True)
        probs = logits.sub_(peak).exp_()  # one exp per logit, in the logits' own memory
        sums = probs.sum(dim=-1, keepdim=True)
        total += ((peak.squeeze(1) + sums.log().squeeze(1) - target_logit) * keep).sum()
        if not (want_x or want_w):
            continue
        probs.div_(sums)  # softmax
        probs.scatter_add_(1, index, torch.full_like(index, -1, dtype=probs.dtype))  # minus the one-hot
        dlogits = probs.mul_((keep.float() / count).unsqueeze(1)).to(work)
        if want_x:
            grad_x[start:start + rows] = dlogits @ w
        if want_w:
            grad_w += (dlogits.t() @ xb.to(work)).float()
    return total / count, grad_x, grad_w if want_w else None


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss, grad_x, grad_w = _blocks(x, weight, targets, *ctx.needs_input_grad[:2])
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.save_for_backward(grad_x if grad_x is not None else x.new_empty(0),
                              grad_w if grad_w is not None else weight.new_empty(0))
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_x, grad_w = ctx.saved_tensors  # scaled here (by a loss scaler's factor too), then in the inputs' dtypes
        return ((grad_x * grad_loss.to(grad_x.dtype)).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None,
                (grad_w * grad_loss.float()).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None, None)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of `F.linear(x, weight)` against `targets`: x (..., d), weight (V, d), targets
    (...), without the (..., V) logits ever existing whole. Negative targets are not scored. Without autograd
    (evaluation under no_grad) no gradient is computed: a Function's forward would be told its inputs need one."""
    x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(x, weight, targets)
    return _blocks(x, weight, targets, False, False)[0]
