"""What a checkpointed micro-batch recomputes: its whole stage (``'full'``), or all but what a policy keeps.

[Note: selective recomputation] ``checkpoint=`` picks the micro-batches whose first forward keeps no graph;
``recompute=`` says what their recomputation runs again. ``'full'``: the stage keeps (a copy of) its input and runs
the whole forward again just before the backward. ``'selective'`` or a policy: the first forward also keeps the
outputs of the operators the policy names (for ``'selective'``: :data:`KEPT`, the matrix multiplications, attention
and collectives), and the recomputation takes those instead of running them: it runs the norms, activations and
elementwise operators again, whose outputs are cheap to make and as large as a matrix multiplication's. So a
selective micro-batch holds its input and the kept outputs from its forward to its recomputation: more than
``'full'``, and it recomputes less. It holds less than no checkpoint where the layers after a kept output save
what they are given (GELU, SiLU, norms: a transformer's blocks); where they save their result instead (ReLU,
tanh), the kept outputs are extra, and a selective micro-batch holds about as much as one not checkpointed.

Both passes run under PyTorch's :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`: the first
forward under the context that stores what the policy keeps, the recomputation (on the same random streams, so
dropout draws the same mask) under the one that hands the stored outputs back in the order they were made. So
both run the same operators in the same order, which is why both run with grad: an operator may run as others
without it (``matmul`` folds its batch dimensions into one ``mm`` only when nothing requires grad; DTensor's
operators differ too). The first forward's graph saves nothing (:func:`discarding`), and goes with its outputs.
Autograd records the kept operators as usual, so the backward is the plain one. A compiled
layer's operators are not seen one by one: its part of the stage is recomputed whole. A kept output that a later
operator changes in place (``nn.ReLU(inplace=True)`` after a ``Linear``) cannot be handed back: the recomputation
raises an error that says so.
"""
import contextlib
from typing import Any, Callable, ContextManager, FrozenSet, Optional, Tuple, Union

import torch

__all__ = ["KEPT", "Policy", "RecomputeLike", "Selective", "describe_recompute", "discarding", "kept", "mutated",
           "verify_recompute"]

#: ``policy(op) -> bool``: whether a selective recomputation keeps the output of ``op`` (a
#: ``torch._ops.OpOverload`` such as ``torch.ops.aten.mm.default``; ``op.overloadpacket`` is ``torch.ops.aten.mm``).
Policy = Callable[[Any], bool]
RecomputeLike = Union[str, Policy]

#: The operators (by name in ``torch.ops``) whose outputs ``recompute='selective'`` keeps: matrix multiplications
#: (convolutions among them), attention, and the functional collectives of tensor parallelism.
KEPT = (
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm", "aten.convolution",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._flash_attention_forward", "aten._efficient_attention_forward",
    "_c10d_functional.all_reduce", "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional.all_gather_into_tensor", "_c10d_functional.all_to_all_single",
)


def _packets(names: Tuple[str, ...]) -> FrozenSet[Any]:
    found = set()
    for name in names:
        namespace, _, op = name.partition(".")
        try:
            found.add(getattr(getattr(torch.ops, namespace), op))
        except (AttributeError, RuntimeError):  # an operator this torch lacks
            continue
    return frozenset(found)


def kept(op: Any) -> bool:
    """``recompute='selective'``'s policy: whether ``op`` is one of :data:`KEPT`."""
    return getattr(op, "overloadpacket", op) in _kept_packets()


_KEPT_PACKETS: Optional[FrozenSet[Any]] = None


def _kept_packets() -> FrozenSet[Any]:
    global _KEPT_PACKETS
    if _KEPT_PACKETS is None:
        _KEPT_PACKETS = _packets(KEPT)
    return _KEPT_PACKETS


def verify_recompute(recompute: Any, checkpoint: str) -> Optional[Policy]:
    """The policy of a ``recompute=`` argument (None for ``'full'``).

    Raises:
        ValueError: ``recompute`` is another string, or is not ``'full'`` with ``checkpoint='never'``, or needs
            ``create_selective_checkpoint_contexts``, which this torch lacks.
        TypeError: ``recompute`` is neither a string nor callable.
    """
    if isinstance(recompute, str):
        if recompute not in ("full", "selective"):
            raise ValueError(f"recompute must be 'full', 'selective' or a function policy(op) -> bool, "
                             f"got {recompute!r}")
        policy: Optional[Policy] = None if recompute == "full" else kept
    elif callable(recompute):
        policy = recompute
    else:
        raise TypeError(f"recompute must be 'full', 'selective' or a function policy(op) -> bool, got {recompute!r}")
    if policy is None:
        return None
    if checkpoint == "never":
        raise ValueError(
            f"recompute={describe_recompute(recompute)!r} says what a checkpointed micro-batch recomputes, but "
            "checkpoint='never' checkpoints none: checkpoint= picks the micro-batches to recompute ('always' or "
            "'except_last')"
        )
    if not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"):
        raise ValueError(f"recompute={describe_recompute(recompute)!r} needs "
                         "torch.utils.checkpoint.create_selective_checkpoint_contexts, which torch "
                         f"{torch.__version__} lacks; upgrade PyTorch (2.4 or later) or use recompute='full'")
    return policy


def describe_recompute(recompute: Any) -> str:
    """``recompute`` as the ranks compare it: the string, or ``'a function'``."""
    return recompute if isinstance(recompute, str) else "a function"


class Selective:
    """The two passes of one selectively recomputed (stage, micro-batch): :attr:`first` for its forward, then
    :attr:`again` for its recomputation (see [Note: selective recomputation]); the kept outputs live in them."""

    __slots__ = ("first", "again")

    def __init__(self, policy: Policy) -> None:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        def decide(context: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
            return bool(policy(op))

        self.first: ContextManager[Any]
        self.again: ContextManager[Any]
        self.first, self.again = create_selective_checkpoint_contexts(decide)  # type: ignore[no-untyped-call]


def discarding() -> ContextManager[Any]:
    """Grad enabled, and every tensor autograd would save dropped: a graph made under it has no backward."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.enable_grad())
    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_drop, _dropped))
    return stack


def _drop(tensor: Any) -> None:
    return None


def _dropped(packed: Any) -> Any:
    raise RuntimeError("the first forward of a selectively recomputed micro-batch keeps no graph: its backward runs "
                       "on its recomputation's")


def mutated(error: RuntimeError) -> bool:
    """Whether ``error`` is the recomputation's refusal of a kept output changed in place since its forward."""
    return "has been mutated" in str(error)
