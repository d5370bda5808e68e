"""What GPipe and Pipeline share as modules: parts that stay where they were placed, gradients clipped as the
plain module's, and deferred batch norm's statistics committed once per mini-batch."""
import contextlib
from typing import Any, Generator, List, Optional, Sequence, Union, cast

import torch
from torch import Tensor, nn

from torchpipe.batchnorm import DeferredBatchNorm, commit, discard
from torchpipe.clip import Exchange, clip_grad_norm
from torchpipe.partition import moving_denied, names_a_device

__all__ = ["Pipelined"]


class Pipelined(nn.Module):
    """The base of :class:`~torchpipe.GPipe` and :class:`~torchpipe.Pipeline`.

    A subclass says what its parts are called and how the user's handle on it
    is named in messages (:attr:`_parts`, :attr:`_handle`), which of its
    parameters make its share of the whole model's norm (:meth:`_counted`) and
    how the shares of several ranks are combined (:meth:`_exchange`).
    """

    balance: List[int]
    devices: List[torch.device]
    chunks: int
    checkpoint: str
    #: What a checkpointed micro-batch recomputes: ``'full'``, ``'selective'`` or a policy.
    recompute: Any = "full"
    deferred_batch_norm: bool
    #: What a message calls the placed parts (``'partitions'``, ``'stages'``) and the user's handle (``'g'``).
    _parts = "stages"
    _handle = "pipe"

    def _keep_arguments(
        self, module: nn.Sequential, balance: List[int], devices: List[torch.device], chunks: int, checkpoint: str,
        deferred_batch_norm: bool,
    ) -> nn.Sequential:
        """Keeps what every pipeline is made with (``devices``: one per stage); returns ``module``, its batch
        norms deferred where asked (see :class:`~torchpipe.batchnorm.DeferredBatchNorm`)."""
        self.balance = balance
        self.devices = devices
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norm = deferred_batch_norm
        return cast(nn.Sequential, DeferredBatchNorm.convert(module)) if deferred_batch_norm else module

    # --- moving is the pipeline's job ------------------------------------------------------------------

    def cuda(self, device: Optional[Union[int, torch.device]] = None) -> Any:
        raise moving_denied(type(self).__name__, self._parts, self._handle)

    def cpu(self) -> Any:
        raise moving_denied(type(self).__name__, self._parts, self._handle)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        if names_a_device(args, kwargs):
            raise moving_denied(type(self).__name__, self._parts, self._handle)
        super().to(*args, **kwargs)
        return self

    # --- gradients -------------------------------------------------------------------------------------

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clips the whole model's gradients as ``torch.nn.utils.clip_grad_norm_`` on the plain module would.

        The norm covers every stage (on every rank, and on a mesh every
        replica's shard), a tied parameter with copies counted once; every
        rank scales its gradients by the same factor and gets the same total
        norm. Across processes every rank calls it (it is a collective).

        Returns:
            The total norm of the gradients, before clipping.
        """
        params = list(self.parameters())
        return clip_grad_norm(params, self._counted(params), max_norm, norm_type,
                              error_if_nonfinite=error_if_nonfinite, exchange=self._exchange())

    def _counted(self, params: List[nn.Parameter]) -> List[nn.Parameter]:
        """The parameters of ``params`` that make this process's share of the whole model's norm."""
        return params

    def _exchange(self) -> Optional[Exchange]:
        """How the shares of several ranks are combined (None: one process)."""
        return None

    # --- deferred batch norm ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _batch_norm_statistics(self, stages: Sequence[nn.Module]) -> Generator[None, None, None]:
        """Commits the block's deferred batch norm statistics of ``stages`` once it ended well in training mode
        (one update per mini-batch, as the plain module makes), and discards them when it raised."""
        if not self.deferred_batch_norm:
            yield
            return
        try:
            yield
        except BaseException:
            for stage in stages:
                discard(stage)
            raise
        if self.training:
            for stage in stages:
                commit(stage)
