"""Stage boundaries: the leaves a stage's graph starts from, and the backward of one stage's graph.

[Note: boundaries] Each stage's input for a micro-batch is a detached leaf
(requiring grad when the tensor it stands for does), and its output keeps its
graph, so every (stage, micro-batch) owns a small autograd graph cut at the
stage boundaries. The backward of stage ``s`` for micro-batch ``i`` runs on
that graph alone and hands the leaves' gradients to stage ``s - 1``. This lets
each backward run as a task on its stage's worker (on CPU the autograd engine
runs a backward on the thread that calls it, so one big graph would run the
whole backward on one thread), makes checkpointing simple (a recomputation runs
the stage again from the same leaves), and is what one process per stage needs.
A stage runs on an alias of its leaves (:class:`Boundary`), so that it may
change its input in place as it would change the intermediate tensor the plain
module gives it, unless nothing in it can (:func:`takes_leaves`).
"""
import contextlib
import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Tuple, Type

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

__all__ = [
    "Boundary", "is_differentiable", "make_leaves", "copy_leaf", "alias", "takes_leaves", "own_gradients", "own_version"
]


class Boundary(torch.autograd.Function):
    """The input a stage sees: an alias of its leaves that is not a leaf itself.

    ::

        forward:   leaf ──► alias (same memory)       so an in-place first layer works,
        backward:  leaf.grad ◄── grad                  as on any intermediate tensor
    """

    @staticmethod
    def forward(ctx: Any, *leaves: Tensor) -> Tuple[Tensor, ...]:
        return tuple(leaf.detach() for leaf in leaves)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Tuple[Tensor, ...]:
        return grads


def is_differentiable(tensor: Tensor) -> bool:
    """Whether ``tensor``'s dtype can carry a gradient."""
    return tensor.is_floating_point() or tensor.is_complex()


def make_leaves(tensors: Sequence[Tensor], requires_grad: Sequence[bool]) -> Tuple[Tensor, ...]:
    """Detached leaves of ``tensors`` (same memory), each requiring grad where its flag says and its dtype allows."""
    return tuple(
        t.detach().requires_grad_(flag and is_differentiable(t)) for t, flag in zip(tensors, requires_grad)
    )


def copy_leaf(leaf: Tensor) -> Tensor:
    """A copy of ``leaf`` in memory of its own, a leaf requiring grad as ``leaf`` does: what a recomputation
    starts from, whatever a layer then does to the original in place."""
    return leaf.detach().clone().requires_grad_(leaf.requires_grad)


def own_version(tensor: Tensor) -> Tensor:
    """A tensor on ``tensor``'s memory with a version counter of its own (not a view, no grad history).

    The micro-batches of stage 0 are views of the caller's one input, and
    views share their base's version counter: an in-place first layer working
    on micro-batch 1 would look, to autograd, like a change of what micro-batch
    0's graph saved. They are disjoint memory, so each gets its own counter;
    a change of the caller's input between forward and backward is checked
    by the runner instead (see ``StageState.versions``). A first stage that
    cannot change its input in place (:func:`takes_leaves`) needs none.
    """
    # A tensor made here requires no grad, so set_ records nothing even with grad enabled: no no_grad needed.
    alias = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)
    return alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())


def alias(leaves: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
    """The stage's view of its leaves (see :class:`Boundary`); leaves without grad pass as they are."""
    needing = [k for k, leaf in enumerate(leaves) if leaf.requires_grad]
    if not needing:
        return leaves
    aliases = Boundary.apply(*(leaves[k] for k in needing))  # type: ignore[no-untyped-call]
    result = list(leaves)
    for k, view in zip(needing, aliases):
        result[k] = view
    return tuple(result)


#: Layers whose forward reads its input and makes new tensors of it: it neither changes the input in place nor
#: returns it or a view of it (their classes' own forward, as PyTorch defines it).
_FRESH_OUTPUT: Dict[Type[nn.Module], Callable[..., Any]] = {
    cls: cls.forward
    for cls in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                nn.ConvTranspose3d, nn.LayerNorm, nn.GroupNorm)
}


def takes_leaves(stage: Optional[torch.nn.Module]) -> bool:
    """Whether ``stage`` may run on its input leaves as they are, without :func:`alias`.

    The alias is there so that a stage that changes its input in place works,
    as on the intermediate tensor the plain module would give it. A plain
    ``nn.Sequential`` whose first layer is one of PyTorch's layers that only
    read their input (a ``Linear``, a convolution, a norm other than batch
    norm), with no hooks that could see the input (on the stage, on that layer,
    or global), hands the input to that layer alone: nothing can change it in
    place, and the alias would only cost its autograd function, forward and
    backward, for every micro-batch and stage (a share of a tiny model's step).
    Anything else (a subclass, a wrapped stage such as FSDP2's, a hook) keeps
    the alias.
    """
    if type(stage) is not nn.Sequential or len(stage) == 0 or _hooked(stage):
        return False
    first = stage[0]
    forward = _FRESH_OUTPUT.get(type(first))
    if forward is None or type(first).forward is not forward or _hooked(first):
        return False
    return not any(getattr(_module, name, None) for name in _GLOBAL_HOOKS)


#: The hooks of every module (``torch.nn.modules.module.register_module_*_hook``).
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")


def _hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
                or module._backward_hooks)


@contextmanager
def own_gradients(
    params: Sequence[Tensor], sums: Sequence[Optional[Tensor]], locks: Sequence[threading.Lock] = ()
) -> Generator[List[Optional[Tensor]], None, None]:
    """Runs a backward that leaves ``params``' ``.grad`` and hooks as they were; yields, filled after the
    block, each parameter's gradient sum: ``sums`` (the earlier micro-batches', None where none) plus what the
    block accumulated, added in place into it by autograd's accumulator (no tensor allocated, no second pass).
    ``locks`` are held for the block: one per parameter that another worker's stage shares (see [Note: tied
    parameters]).

    [Note: parameter gradients] A GPipe stage's backward of one micro-batch
    accumulates into every leaf of its graph as usual (its input leaves, and
    any tensor a layer uses that requires grad), but the gradients of the
    module's own parameters it takes aside: GPipe's autograd function returns
    their sums over micro-batches to the autograd engine, which accumulates
    them into ``.grad`` (or hands them to the user's ``torch.autograd.grad``,
    touching no ``.grad``) and runs the parameters' hooks then, once, on the
    whole gradient, as without GPipe. So for the block each parameter's
    ``.grad`` is set aside and its hooks are silenced (emptied in place, the
    engine reads them from the same dict), then both are put back. A
    pipeline runs one phase at a time (the runner's phase lock), so no other
    step's backward sees the swap; a parameter tied to another worker's stage
    has a lock that worker's backward waits for; and the engine of another
    thread's backward pass, which would add into ``.grad`` or run the hooks
    after its own phase, is kept out by [Note: gradient lease].
    """
    with contextlib.ExitStack() as held:
        for lock in locks:
            held.enter_context(lock)
        with _swapped(params, sums) as found:
            yield found


@contextmanager
def _swapped(
    params: Sequence[Tensor], sums: Sequence[Optional[Tensor]]
) -> Generator[List[Optional[Tensor]], None, None]:
    saved_grads = [p.grad for p in params]
    muted: List[Tuple[Dict[Any, Any], List[Tuple[Any, Any]]]] = []
    for param, total in zip(params, sums):
        param.grad = total
        for attribute in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            hooks = getattr(param, attribute, None)
            if hooks:
                muted.append((hooks, list(hooks.items())))
                hooks.clear()
    found: List[Optional[Tensor]] = []
    try:
        yield found
    finally:
        for param, grad in zip(params, saved_grads):
            found.append(param.grad)
            param.grad = grad
        for hooks, items in muted:
            hooks.update(items)
