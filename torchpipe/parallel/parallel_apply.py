"""Running replicas in parallel on worker threads, forward and backward.

[Note: parallel backward] PyTorch's autograd engine runs every CPU node on
the thread that called ``backward()``, so replicas whose forward ran on
several CPU worker threads would still share one thread for their backward.
Each replica therefore records its forward as a graph of its own, in its
worker, on detached copies of its inputs; one :class:`ParallelBackward` node
joins those graphs to the caller's. When the caller's backward reaches it,
the node hands each replica's output gradients to that replica's worker, which
runs ``torch.autograd.grad`` on its own graph, and returns the gradients of
the inputs and of the parameters as any autograd node does. Gradients thus
reach the original parameters through the ordinary engine (``.grad``,
hooks and ``torch.autograd.grad`` behave as with one module) while the
replicas' backward passes run in parallel.

Gradient mode, inference mode and autocast are thread-local in PyTorch; a
worker runs each task in the caller's (:class:`ThreadContext`).
"""
import sys
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch
from torch import Tensor
from torch.autograd.profiler import record_function

from torchpipe import waits
from torchpipe.parallel.replicate import Replica
from torchpipe.rng import may_draw, step_seed, streams, task_seed
from torchpipe.transfer import map_structure, tensors_of
from torchpipe.worker import ThreadContext, WorkerGroup

__all__ = ["Arguments", "ThreadContext", "ParallelBackward", "parallel_apply", "run_all", "wait_all"]

R = TypeVar("R")

#: The positional and keyword arguments of one replica.
Arguments = Tuple[Tuple[Any, ...], Dict[str, Any]]

def wait_all(futures: Sequence["Future[Any]"], devices: Sequence[torch.device]) -> List[Any]:
    """The results of ``futures``, after every one has finished.

    Raises:
        BaseException: the first failure in replica order, the very exception
            object with its own type, message and traceback; on Python 3.11
            and later with a note (``add_note``) naming the replica. Older
            Pythons have no notes, and the exception is not wrapped or
            chained just to say where it came from.
    """
    errors: List[Tuple[int, BaseException]] = []
    results: List[Any] = []
    for index, future in enumerate(futures):
        error = future.exception()
        if error is not None:
            errors.append((index, error))
            results.append(None)
        else:
            results.append(future.result())
    if errors:
        index, error = errors[0]
        if sys.version_info >= (3, 11):
            error.add_note(f"(raised in torchpipe data-parallel replica {index} on {devices[index]})")
        raise error
    return results


def run_all(
    workers: WorkerGroup, tasks: Sequence[Callable[[], R]], devices: Sequence[torch.device], label: str
) -> List[R]:
    """Runs ``tasks[i]`` on worker ``i``, all at once; their results (see :func:`wait_all`), once every one has
    finished. A task that would wait for this thread fails instead (see [Note: waits])."""
    threads = [workers[i].thread for i in range(len(tasks))]
    with waits.waiting(f"the data-parallel replicas of {label!r}", threads):
        futures = [workers[i].submit(task) for i, task in enumerate(tasks)]
        return wait_all(futures, devices)


@dataclass
class _State:
    """What :class:`ParallelBackward` needs from the forward pass."""

    workers: WorkerGroup
    devices: List[torch.device]
    #: Per replica: its output tensors (still attached to its own graph).
    outputs: List[List[Tensor]]
    #: Per replica: the tensors its gradients are taken for (parameters, then input leaves).
    targets: List[List[Tensor]]
    label: str


class ParallelBackward(torch.autograd.Function):
    """Joins the replicas' own graphs to the caller's; their backward passes run in parallel.

    ::

        forward (caller)      params_i, inputs_i ──▶ [ParallelBackward] ──▶ outputs_i (detached)
                              (worker i ran: inputs_i.detach() ──replica_i──▶ outputs_i)
        backward (caller)     grad params_i, grad inputs_i ◀── [ParallelBackward] ◀── grad outputs_i
                              (worker i runs: torch.autograd.grad(outputs_i, targets_i, grad outputs_i))

    See [Note: parallel backward].
    """

    @staticmethod
    def forward(ctx: Any, state: _State, *inputs: Tensor) -> Tuple[Tensor, ...]:
        ctx.state = state
        ctx.set_materialize_grads(False)
        # Saved only to learn whether the engine freed this node's state (retain_graph=False).
        ctx.save_for_backward(inputs[0])
        detached: List[Tensor] = []
        constant: List[Tensor] = []
        for outputs in state.outputs:
            for output in outputs:
                copy = output.detach()
                detached.append(copy)
                if not output.requires_grad:
                    constant.append(copy)
        ctx.mark_non_differentiable(*constant)
        return tuple(detached)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        state: _State = ctx.state
        if not state.outputs:
            raise RuntimeError(
                "Trying to backward through the data-parallel replicas a second time; "
                "pass retain_graph=True to the first backward"
            )
        create_graph = torch.is_grad_enabled()
        tasks: List[Callable[[], Optional[Tuple[Optional[Tensor], ...]]]] = []
        position = 0
        for index, (outputs, targets) in enumerate(zip(state.outputs, state.targets)):
            pairs = [
                (o, g) for o, g in zip(outputs, grads[position : position + len(outputs)]) if g is not None
            ]
            position += len(outputs)
            tasks.append(_grad_task(pairs, targets, create_graph, state, index))
        results = run_all(state.workers, tasks, state.devices, state.label)

        # Free the replicas' graphs once the caller's backward is over, unless it retains its graph.
        def release() -> None:
            try:
                _ = ctx.saved_tensors
            except RuntimeError:
                state.outputs = []
                state.targets = []

        torch.autograd.Variable._execution_engine.queue_callback(release)

        flat: List[Optional[Tensor]] = [None]
        for targets, result in zip(state.targets, results):
            flat.extend(result if result is not None else [None] * len(targets))
        return tuple(flat)


def _grad_task(
    pairs: List[Tuple[Tensor, Tensor]],
    targets: List[Tensor],
    create_graph: bool,
    state: _State,
    index: int,
) -> Any:
    def task() -> Optional[Tuple[Optional[Tensor], ...]]:
        if not pairs or not targets:
            return None
        with record_function(f"torchpipe/{state.label}/replica{index}/backward"):
            with torch.set_grad_enabled(create_graph):
                return torch.autograd.grad(
                    [o for o, _ in pairs],
                    targets,
                    [g for _, g in pairs],
                    retain_graph=True,
                    create_graph=create_graph,
                    allow_unused=True,
                )

    return task


def _forward_task(
    replica: Replica, arguments: Arguments, context: ThreadContext, label: str, seed: Optional[int]
) -> Any:
    def task() -> Any:
        # Each replica draws from a stream of its own (see [Note: random streams]).
        with context.entered(), record_function(label), streams(seed):
            args, kwargs = arguments
            return replica.module(*args, **kwargs)

    return task


def parallel_apply(
    replicas: Sequence[Replica],
    arguments: Sequence[Arguments],
    workers: WorkerGroup,
    label: str = "dp",
) -> List[Any]:
    """Calls replica i with ``arguments[i]`` on worker i, all at once; returns the outputs in order.

    When gradients are recorded, the outputs hang on one :class:`ParallelBackward`
    node, so the replicas' backward passes run in parallel too.

    Raises:
        BaseException: what a replica raised (see :func:`wait_all`); every
            replica has finished by then.
    """
    if len(replicas) != len(arguments) or len(replicas) > len(workers):
        raise ValueError(
            f"{len(replicas)} replicas, {len(arguments)} argument sets and {len(workers)} workers do not match"
        )
    devices = [r.device for r in replicas]
    context = ThreadContext.capture()
    seed = step_seed() if may_draw(replicas[0].module) else None
    seeds = [None if seed is None else task_seed(seed, i) for i in range(len(replicas))]
    sources: List[List[Tensor]] = [[t for t in tensors_of(a) if t.requires_grad] for a in arguments]
    needs_grad = context.grad_enabled and (
        any(s for s in sources) or any(p.requires_grad for r in replicas for p in r.parameters)
    )
    if not needs_grad:
        forwards = [
            _forward_task(r, a, context, f"torchpipe/{label}/replica{i}/forward", seeds[i])
            for i, (r, a) in enumerate(zip(replicas, arguments))
        ]
        return run_all(workers, forwards, devices, label)

    # Each replica records a graph of its own that starts at detached copies of its inputs.
    leaves: List[Arguments] = [map_structure(_detach_leaf, a) for a in arguments]
    forwards = [
        _forward_task(r, a, context, f"torchpipe/{label}/replica{i}/forward", seeds[i])
        for i, (r, a) in enumerate(zip(replicas, leaves))
    ]
    outputs = run_all(workers, forwards, devices, label)
    flat_outputs = [tensors_of(o) for o in outputs]
    if not any(flat_outputs):
        return outputs

    parameters = [[p for p in r.parameters if p.requires_grad] for r in replicas]
    targets = [p + [t for t in tensors_of(a) if t.requires_grad] for p, a in zip(parameters, leaves)]
    state = _State(workers, devices, flat_outputs, targets, label)
    inputs = [t for p, s in zip(parameters, sources) for t in p + s]
    joined: Iterator[Tensor] = iter(ParallelBackward.apply(state, *inputs))  # type: ignore[no-untyped-call]
    return [map_structure(lambda leaf: next(joined) if isinstance(leaf, Tensor) else leaf, o) for o in outputs]


def _detach_leaf(leaf: Any) -> Any:
    if isinstance(leaf, Tensor) and leaf.requires_grad:
        return leaf.detach().requires_grad_()
    return leaf
