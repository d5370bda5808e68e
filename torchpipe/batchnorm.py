"""Deferred batch norm: running statistics updated once per mini-batch, not once per micro-batch.

With ``chunks`` micro-batches a plain ``nn.BatchNorm*`` would update its
running mean and variance ``chunks`` times per step, each from a fraction of
the batch. :class:`DeferredBatchNorm` normalises each micro-batch with its own
statistics (as a BatchNorm layer does in training) but only accumulates them;
:func:`commit` then updates the running statistics once, from the whole
mini-batch, exactly as the unpartitioned module would. Recomputations do not
accumulate.
"""
from typing import Optional, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from torchpipe.context import is_recomputing

__all__ = ["DeferredBatchNorm", "commit", "discard"]


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm layer that defers its running-statistics update to :meth:`commit`."""

    count: Optional[Tensor]
    mean: Optional[Tensor]
    m2: Optional[Tensor]

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _reset_accumulation(self) -> None:
        self.count = None
        self.mean = None
        self.m2 = None

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training or not self.track_running_stats:
            return super().forward(input)
        if not is_recomputing():
            self._accumulate(input.detach())
        return F.batch_norm(
            input, None, None, self.weight, self.bias, training=True, momentum=0.0, eps=self.eps
        )

    def _accumulate(self, input: Tensor) -> None:
        # Chan et al.'s parallel update of count, mean and sum of squared deviations, in float64.
        dims = [d for d in range(input.dim()) if d != 1]
        x = input.to(torch.float64)
        n = x.numel() // x.size(1)
        var, mean = torch.var_mean(x, dim=dims, unbiased=False)
        m2 = var * n
        if getattr(self, "count", None) is None or self.count is None:
            self.count, self.mean, self.m2 = torch.tensor(float(n), dtype=torch.float64), mean, m2
            return
        assert self.mean is not None and self.m2 is not None
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta.pow(2) * (self.count * n / total)
        self.count = total

    def commit(self) -> None:
        """Updates the running statistics from everything accumulated since the last commit."""
        count = getattr(self, "count", None)
        if count is None:
            return
        assert self.mean is not None and self.m2 is not None
        running_mean = cast(Tensor, self.running_mean)
        running_var = cast(Tensor, self.running_var)
        with torch.no_grad():
            n = float(count)
            unbiased = self.m2 / max(n - 1.0, 1.0)
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
            if self.momentum is None:
                assert self.num_batches_tracked is not None
                factor = 1.0 / float(self.num_batches_tracked)
            else:
                factor = self.momentum
            running_mean.mul_(1 - factor).add_(self.mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        self._reset_accumulation()

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """``module`` with every ``nn.BatchNorm*`` (at any depth) replaced by a DeferredBatchNorm.

        The replacement shares the original's parameters and buffers.
        """
        if isinstance(module, _BatchNorm) and not isinstance(module, DeferredBatchNorm) and module.track_running_stats:
            deferred = cls.__new__(cls)
            deferred.__dict__.update(module.__dict__)
            deferred._parameters = dict(module._parameters)
            deferred._buffers = dict(module._buffers)
            deferred._modules = dict(module._modules)
            deferred._reset_accumulation()
            return deferred
        for name, child in list(module.named_children()):
            converted = cls.convert(child)
            if converted is not child:
                setattr(module, name, converted)
        return module


def commit(module: nn.Module) -> None:
    """Commits the accumulated statistics of every DeferredBatchNorm in ``module``."""
    for layer in module.modules():
        if isinstance(layer, DeferredBatchNorm):
            layer.commit()


def discard(module: nn.Module) -> None:
    """Drops the accumulated statistics of every DeferredBatchNorm in ``module`` (after a failed step)."""
    for layer in module.modules():
        if isinstance(layer, DeferredBatchNorm):
            layer._reset_accumulation()
