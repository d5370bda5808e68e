"""Releasing what was sent: a stage output's data, once a transport has sent it to another rank.

[Note: released outputs] A stage keeps each micro-batch's output until its
backward, as the root the output's gradient enters the graph at. Autograd
reads only the root's shape and dtype there, not its data, so once the output
has gone to another rank (copied into a message, or read by a send that has
completed) the sender frees the output's storage and keeps the tensor's
metadata and graph (``untyped_storage().resize_(0)``, as Megatron-LM's
``deallocate_output_tensor`` does). An output is released only where nothing
else reads its data again:

- it is the result of an operation of the stage (a ``grad_fn``, no leaf) and
  owns its storage (no view: a view's base may be needed elsewhere);
- no other tensor the stage sends or stashes shares its storage;
- no node of the graph made after it saved it (``ReLU`` saves its result,
  and so would a layer that takes a first output to compute a second): the
  nodes between the outputs' ``grad_fn``s and the graph below them are looked
  at, up to :data:`LOOKED_AT` nodes (beyond that the output is kept).

A DTensor output is released by its local tensor. Under checkpointing the
output is computed without graph and kept by nothing once sent.
"""
from typing import Any, Iterable, List, Optional, Sequence, Set

from torch import Tensor

__all__ = ["releasable", "release", "local", "storage", "LOOKED_AT"]

#: The most graph nodes looked at for tensors that saved an output (past it, the outputs are kept).
LOOKED_AT = 64


def local(tensor: Tensor) -> Tensor:
    """The tensor that holds ``tensor``'s data on this rank: a DTensor's local tensor, else itself."""
    inner = getattr(tensor, "_local_tensor", None)
    return inner if isinstance(inner, Tensor) else tensor


def storage(tensor: Tensor) -> Optional[int]:
    """Where ``tensor``'s data is; None for a tensor that holds no storage of its own (a wrapper subclass: a
    collective's result in flight)."""
    inner = local(tensor)
    if type(inner) is not Tensor:
        return None
    try:
        return int(inner.untyped_storage().data_ptr())
    except RuntimeError:
        return None


def _saved(node: Any) -> Iterable[Tensor]:
    """The tensors autograd ``node`` saved for its backward."""
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:  # freed already, or not a tensor that can be unpacked
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        yield from (v for v in values if isinstance(v, Tensor))
    saved = getattr(node, "saved_tensors", None)  # a custom autograd Function's ctx.save_for_backward
    if isinstance(saved, tuple):
        yield from (v for v in saved if isinstance(v, Tensor))


def releasable(outputs: Sequence[Tensor], others: Sequence[Tensor] = ()) -> List[Tensor]:
    """The ``outputs`` whose data nothing reads again once they are sent (see [Note: released outputs]);
    ``others``: the other tensors the action sends or keeps (skips it stashed)."""
    candidates = [t for t in outputs if isinstance(t, Tensor) and t.grad_fn is not None and not t.is_meta
                  and storage(t) is not None and local(t)._base is None and local(t).untyped_storage().nbytes() > 0]
    if not candidates:
        return []
    storages = [storage(t) for t in outputs if isinstance(t, Tensor)]
    shared: Set[Optional[int]] = {p for p in storages if storages.count(p) > 1}
    shared |= {storage(t) for t in others if isinstance(t, Tensor)}
    wanted = {storage(t) for t in candidates} - shared
    if not wanted:
        return []
    # The nodes made after the outputs: from each output's grad_fn down, not past another output's.
    stack = [t.grad_fn for t in outputs if isinstance(t, Tensor) and t.grad_fn is not None]
    ends = set(stack)
    seen: Set[Any] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > LOOKED_AT:
            return []
        wanted -= {storage(s) for s in _saved(node)}
        if not wanted:
            return []
        for child, _ in node.next_functions:
            if child is not None and child not in ends and len(ends) > 1:
                stack.append(child)
    return [t for t in candidates if storage(t) in wanted]


def release(tensors: Sequence[Tensor]) -> None:
    """Frees the data of ``tensors`` (see [Note: released outputs]); their shapes and graphs stay."""
    for tensor in tensors:
        local(tensor).untyped_storage().resize_(0)
