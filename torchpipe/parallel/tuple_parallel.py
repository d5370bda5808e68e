"""TupleParallel: one mini-batch per replica in, one output per replica out, nothing scattered or gathered."""
from typing import Any, Callable, Optional, Sequence

from torch import nn
from torch.autograd.profiler import record_function

from torchpipe.parallel.collate import per_output
from torchpipe.parallel.data_parallel import DataParallel
from torchpipe.transfer import move
from torchpipe.types import Device

__all__ = ["TupleParallel"]


class TupleParallel(DataParallel):
    """Runs replica i of ``module`` on element i of every argument, in parallel.

    Every argument of :meth:`forward` is a list or tuple of length
    ``len(device_ids)``, element i being the mini-batch of replica i (what
    ``DataLoader(collate_fn=torchpipe.parallel.default_collate(n))`` yields).
    The result is a tuple of per-replica outputs, each on its own device, or,
    if the module returns a tuple, a list of per-output tuples. Attribute
    access falls through to the wrapped module.

    Args:
        module: the module to run; its parameters and buffers must be on
            ``device_ids[0]`` by the first call. Gradients accumulate into them.
        device_ids: as for :class:`DataParallel` (``'cpu'`` may repeat).
        transfer_input: move element i of every argument to ``device_ids[i]``
            (``.to`` on custom types); if ``False`` they are used as they are.
        transfer_output: move every output to ``device_ids[0]``.
        reduction: applied last to the result, e.g. :func:`torchpipe.parallel.cat`.

    Raises:
        TypeError: (on forward) an argument is not a list or tuple.
        ValueError: (on forward) an argument's length is not ``len(device_ids)``.
        RuntimeError: (on forward) the module is not on ``device_ids[0]``.

    Example::

        model = TupleParallel(net, ['cpu', 'cpu'], transfer_output=True, reduction=cat)
        loader = DataLoader(dataset, batch_size=32, collate_fn=default_collate(2))
        for x, y in loader:
            loss = criterion(model(x), torch.cat(y))
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Optional[Sequence[Device]] = None,
        *,
        transfer_input: bool = True,
        transfer_output: bool = False,
        reduction: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        super().__init__(module, device_ids, inputs_are_scattered=True, gather_to_one_device=False)
        self.transfer_input = transfer_input
        self.transfer_output = transfer_output
        self.reduction = reduction

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with record_function("torchpipe/tp/forward"):
            arguments = self._per_replica_arguments(args, kwargs, transfer=self.transfer_input, strict_type=True)
            outputs = self._run(arguments)
            if self.transfer_output:
                outputs = [move(o, self.device_ids[0]) for o in outputs]
            result = per_output(outputs)
            return self.reduction(result) if self.reduction is not None else result

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" not in modules:
                raise
            return getattr(modules["module"], name)
