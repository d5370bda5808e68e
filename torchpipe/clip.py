"""Gradient clipping over a whole pipelined model: every stage, device and rank, a tied parameter counted once.

``torch.nn.utils.clip_grad_norm_`` on one rank's parameters would clip by that
rank's norm, and on a pipeline with tied copies it would count a tied
parameter once per copy. :func:`clip_grad_norm` computes the plain module's
norm instead: each rank adds up its share (``sum |g|^p``, or ``max |g|`` for
the infinity norm), counting each tied parameter on one holder only, each
data-parallel replica's identical gradients once (``'replicate'``) and every
shard of a sharded one (``'shard'``), and the shares are combined across
ranks; every rank then scales its gradients by the same factor.
"""
import math
from typing import Callable, Iterable, List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["clip_grad_norm", "local_share"]

#: Combines every rank's share (a list of floats per rank): across processes, through the pipeline's channel.
Exchange = Callable[[List[float]], List[List[float]]]


def _local(tensor: Tensor) -> Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def local_share(grads: Iterable[Tensor], norm_type: float) -> float:
    """This rank's share of the total norm: ``sum |g|^p`` over its gradients (``max |g|`` for ``inf``)."""
    share = 0.0
    for grad in grads:
        local = _local(grad)
        if local.numel() == 0:
            continue
        norm = float(torch.linalg.vector_norm(local.detach(), norm_type, dtype=torch.float64))
        share = max(share, norm) if math.isinf(norm_type) else share + norm**norm_type
    return share


def clip_grad_norm(
    params: Sequence[Tensor],
    counted: Sequence[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    exchange: Optional[Exchange] = None,
) -> Tensor:
    """Clips the gradients of ``params`` by the total norm of the gradients of ``counted`` on every rank.

    Args:
        params: this rank's parameters, each once (every copy of a tied one): all are scaled.
        counted: those whose gradients make this rank's share of the norm (a tied parameter on one rank
            only, a replicated one on one replica only).
        max_norm: the largest total norm allowed.
        norm_type: ``p`` of the p-norm (any positive float, or ``inf``).
        error_if_nonfinite: raise if the total norm is NaN or infinite, as PyTorch's does.
        exchange: across processes, every rank's share, in rank order (None: one process).

    Returns:
        The total norm of the whole model's gradients (before clipping), the same on every rank.

    Raises:
        ValueError: ``norm_type`` is not positive.
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type}")
    share = local_share([p.grad for p in counted if p.grad is not None], norm_type)
    shares = [share] if exchange is None else [values[0] for values in exchange([share])]
    if math.isinf(norm_type):
        total = max(shares, default=0.0)
    else:
        total = math.fsum(shares) ** (1.0 / norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    dtype = grads[0].dtype if grads else (params[0].dtype if params else torch.float32)
    device = grads[0].device if grads else torch.device("cpu")
    result = torch.tensor(total, dtype=dtype, device=device)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total}, so they cannot be clipped; set "
            "error_if_nonfinite=False to clip anyway (the gradients become NaN)"
        )
    coefficient = max_norm / (total + 1e-6)
    if not coefficient >= 1.0:  # as PyTorch's: a NaN norm makes the gradients NaN
        with torch.no_grad():
            for grad in grads:
                grad.mul_(coefficient)
    return result
