"""DataParallel: scatter a batch over replicas, run them in parallel, gather (or not) their outputs."""
import dataclasses
from collections.abc import Sequence as SequenceABC
from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.profiler import record_function

from torchpipe.parallel.parallel_apply import Arguments, parallel_apply
from torchpipe.parallel.replicate import module_device_error, replicate
from torchpipe.stream import as_device
from torchpipe.transfer import gather, move, split
from torchpipe.types import Device
from torchpipe.worker import WorkerGroup

__all__ = ["DataParallel", "default_device_ids"]


class ReplicaArgumentError(TypeError, ValueError):
    """An argument meant to hold one element per replica is not a list or tuple."""


def default_device_ids() -> List[torch.device]:
    """Every CUDA device, or one ``'cpu'`` replica when there is no CUDA."""
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


class DataParallel(nn.Module):
    """Runs ``module`` on slices of the batch in parallel, one replica per entry of ``device_ids``.

    Like :class:`torch.nn.DataParallel`, with replicas that may be CUDA devices
    or ``'cpu'`` (several times: they run on worker threads with one share of
    the intra-op threads each), and with flags that keep outputs where they
    are so that one network can feed the next without a gather and a
    re-scatter in between.

    Args:
        module: the module to run; its parameters and buffers must be on
            ``device_ids[0]``. Gradients accumulate into its parameters.
        device_ids: CUDA indices or devices (``'cpu'`` may appear, several
            times). Default: every CUDA device, or one ``'cpu'`` replica.
        output_device: where outputs are gathered (default ``device_ids[0]``).
        dim: the batch dimension to scatter and gather along.
        gather_to_one_device: if ``False``, return a tuple with one output per
            replica, in ``device_ids`` order, each on its own device.
        inputs_are_scattered: if ``True``, every argument is a sequence with one
            element per replica (as returned with ``gather_to_one_device=False``),
            used as it is (moved to its replica's device if it is elsewhere).
        except_keywords: dict keys, at any depth of the output, whose values are
            left as per-replica tuples instead of being gathered.
        sort_and_gather: gather the outputs in replica order even when
            ``gather_to_one_device=False``, so rows line up with the input batch.
        cpu_keywords: keyword arguments that stay on the CPU (split along ``dim``).
        batch_outputs: if ``False``, return a list with each replica's output
            moved to ``output_device`` instead of concatenating them.

    Gathering joins the replicas' outputs leaf by leaf: tensors are
    concatenated along ``dim`` (0-dimensional ones stacked into a vector),
    and every other leaf (an int, a string, an object) becomes a tuple with
    one value per replica, in ``device_ids`` order, so nothing a replica
    returned is dropped: ``(logits, count)`` gives ``(logits, (count_0,
    count_1, ...))``, with one replica too (a 1-tuple). A leaf that is
    ``None`` in every replica stays ``None``. Values under
    ``except_keywords`` are per-replica tuples as they are.

    Raises:
        RuntimeError: (on forward) the module is not on ``device_ids[0]``.
        ValueError: ``device_ids`` is empty; or (on forward, with
            ``inputs_are_scattered=True``) an argument does not have one
            element per replica.

    Example::

        features = DataParallel(extractor, ['cpu', 'cpu'], gather_to_one_device=False)
        head = DataParallel(classifier, ['cpu', 'cpu'], inputs_are_scattered=True)
        logits = head(features(images))  # no gather / scatter in between
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Optional[Sequence[Device]] = None,
        output_device: Optional[Device] = None,
        dim: int = 0,
        *,
        gather_to_one_device: bool = True,
        inputs_are_scattered: bool = False,
        except_keywords: Collection[Any] = (),
        sort_and_gather: bool = False,
        cpu_keywords: Collection[str] = (),
        batch_outputs: bool = True,
    ) -> None:
        super().__init__()
        devices = default_device_ids() if device_ids is None else [as_device(d) for d in device_ids]
        if not devices:
            raise ValueError("device_ids is empty; give at least one device, e.g. device_ids=['cpu']")
        self.module = module
        self.device_ids: List[torch.device] = devices
        self.output_device: torch.device = devices[0] if output_device is None else as_device(output_device)
        self.dim = dim
        self.gather_to_one_device = gather_to_one_device
        self.inputs_are_scattered = inputs_are_scattered
        self.except_keywords = frozenset(except_keywords)
        self.sort_and_gather = sort_and_gather
        self.cpu_keywords = frozenset(cpu_keywords)
        self.batch_outputs = batch_outputs
        self._workers: Optional[WorkerGroup] = None

    def __getstate__(self) -> Dict[str, Any]:
        # Threads cannot be copied or pickled; a copy starts its own workers.
        state = self.__dict__.copy()
        state["_workers"] = None
        return state

    def extra_repr(self) -> str:
        return f"device_ids={[str(d) for d in self.device_ids]}, output_device={self.output_device}"

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with record_function("torchpipe/dp/forward"):
            if self.inputs_are_scattered:
                arguments = self._per_replica_arguments(inputs, kwargs, transfer=True, strict_type=False)
            else:
                arguments = self._scatter(inputs, kwargs)
            outputs = self._run(arguments)
            return self._gather(outputs)

    # --- the steps of one forward ------------------------------------------------------------

    def _check_module_device(self) -> None:
        message = module_device_error(self.module, self.device_ids[0])
        if message:
            raise RuntimeError(message)

    def _scatter(self, inputs: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[Arguments]:
        if not inputs and not kwargs:
            # Nothing to split: run the module once, on device_ids[0], as torch does.
            return [((), {})]
        pieces = split((inputs, kwargs), len(self.device_ids), self.dim)
        arguments: List[Arguments] = []
        for (args, kw), device in zip(pieces, self.device_ids):
            moved = {k: v if k in self.cpu_keywords else move(v, device) for k, v in kw.items()}
            arguments.append((move(args, device), moved))
        return arguments

    def _per_replica_arguments(
        self, inputs: Tuple[Any, ...], kwargs: Dict[str, Any], *, transfer: bool, strict_type: bool
    ) -> List[Arguments]:
        count = len(self.device_ids)
        named: List[Tuple[str, Any]] = [(f"positional argument {i}", v) for i, v in enumerate(inputs)]
        named += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
        problems: List[str] = []
        for name, value in named:
            if not _is_per_replica(value, strict_type):
                problems.append(
                    f"{name} is a {type(value).__name__}, not a list or tuple with one element per replica"
                )
            elif len(value) != count:
                problems.append(f"{name} has {len(value)} elements but there are {count} replicas")
        if problems:
            # A wrong length is a ValueError; an argument that is no per-replica sequence at all is
            # both a wrong type and a wrong value, and catchable as either.
            error = ReplicaArgumentError if all("not a list" in p for p in problems) else ValueError
            raise error(
                f"{type(self).__name__} expects every argument to hold one element per replica "
                f"(device_ids: {[str(d) for d in self.device_ids]}): " + "; ".join(problems)
            )
        if not named:
            return [((), {})]
        arguments: List[Arguments] = []
        for i, device in enumerate(self.device_ids):
            args = tuple(v[i] for v in inputs)
            kw = {k: v[i] for k, v in kwargs.items()}
            if transfer:
                args = move(args, device)
                kw = {k: v if k in self.cpu_keywords else move(v, device) for k, v in kw.items()}
            arguments.append((args, kw))
        return arguments

    def _run(self, arguments: List[Arguments]) -> List[Any]:
        """Runs one replica per argument set (on the caller's thread when there is only one)."""
        self._check_module_device()
        if len(arguments) == 1:
            args, kwargs = arguments[0]
            return [self.module(*args, **kwargs)]
        devices = self.device_ids[: len(arguments)]
        if self._workers is None or not self._workers.alive:  # none yet, or made before this process forked
            self._workers = WorkerGroup(self.device_ids, "dp")
        replicas = replicate(self.module, devices)
        return parallel_apply(replicas, arguments, self._workers)

    def _gather(self, outputs: List[Any]) -> Any:
        if not self.gather_to_one_device and not self.sort_and_gather:
            return tuple(outputs)
        if not self.batch_outputs:
            return [move(o, self.output_device) for o in outputs]
        # Replicas' outputs are already in device_ids order, which is the order of the batch.
        joined = gather(outputs, self.output_device, self.dim, keep_keys=self.except_keywords)
        return _per_replica_leaves(joined, outputs, self.output_device, self.except_keywords)


def _per_replica_leaves(joined: Any, parts: Sequence[Any], device: torch.device, keep_keys: Collection[Any]) -> Any:
    """``joined`` (``transfer.gather`` of ``parts``) with each leaf that is not a tensor made a per-replica tuple.

    ``transfer.join`` keeps the first part's value of such a leaf; replicas
    may return different ones (a count, a list of names), so the gathered
    output holds all of them, in replica order, moved like ``transfer.move``
    moves them. Walks the structure as ``transfer.join`` does.
    """
    if isinstance(joined, Tensor):
        return joined
    if isinstance(joined, (list, tuple)):
        items = [_per_replica_leaves(joined[k], [p[k] for p in parts], device, keep_keys) for k in range(len(joined))]
        if isinstance(joined, list):
            return items
        if hasattr(joined, "_fields"):  # a named tuple
            return type(joined)(*items)
        return tuple(items)
    if isinstance(joined, dict):
        rebuilt = {
            k: v if k in keep_keys else _per_replica_leaves(v, [p[k] for p in parts], device, keep_keys)
            for k, v in joined.items()
        }
        return rebuilt if type(joined) is dict else type(joined)(rebuilt)
    if dataclasses.is_dataclass(joined) and not isinstance(joined, type):
        changes = {
            f.name: _per_replica_leaves(getattr(joined, f.name), [getattr(p, f.name) for p in parts], device, keep_keys)
            for f in dataclasses.fields(joined)
            if f.init
        }
        return dataclasses.replace(joined, **changes)
    if all(p is None for p in parts):
        return None
    return tuple(move(p, device) for p in parts)


def _is_per_replica(value: Any, strict_type: bool) -> bool:
    if strict_type:
        return isinstance(value, (list, tuple))
    return isinstance(value, SequenceABC) and not isinstance(value, (str, bytes, Tensor))
