"""Skips inside a pipeline: the tracker of one (stage, micro-batch) task, and the skips' gradients.

[Note: skips] A skip whose two ends are in the same stage stays in the step's
registry (``local``). Otherwise the stashed tensor crosses from the stashing
stage straight to the popping stage, where it becomes a leaf (like a stage
input). The popping stage's backward computes that leaf's gradient with its
inputs' and sends it straight back; the stashing stage's backward includes the
stashed tensor, with that gradient, among its roots. A recomputation of the
stashing stage re-stashes (the registry keeps the new tensor, with its graph;
nothing is sent again); a recomputation of the popping stage pops the same
leaf (a copy of it, when its first forward was checkpointed, so that a layer
modifying it in place cannot change what the recomputation sees).

Every skip route carries exactly one message per micro-batch each way, so a
stage never waits for a skip that will not come. A skippable layer that
returns without stashing what it declares raises (as in a plain
``nn.Sequential``); a declared stash missing all the same is sent as "not
stashed", and popping it is a ``RuntimeError`` naming the layer and the skip.
"""
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor

from torchpipe.runtime.boundary import alias, copy_leaf, is_differentiable, make_leaves
from torchpipe.runtime.transport import Edge, EdgeKind, Message
from torchpipe.skip.namespace import Namespace

if TYPE_CHECKING:
    from torchpipe.runtime.step import Step

__all__ = ["StageSkips", "SkipName", "received_skips", "stashed_roots"]

#: A skip's namespace and name.
SkipName = Tuple[Namespace, str]


def _label(layer: Any) -> str:
    return type(layer).__name__


class StageSkips:
    """Serves the stash and pop requests of skippable layers in one (stage, micro-batch) task."""

    def __init__(self, step: "Step", stage: int, microbatch: int, *, checkpointing: bool, recomputing: bool) -> None:
        self.step = step
        self.stage = stage
        self.microbatch = microbatch
        self.checkpointing = checkpointing
        self.recomputing = recomputing
        #: What this task stashed, and, for the later stages, the message to send them.
        self.stashed: Dict[SkipName, Optional[Message]] = {}
        self.popped: Set[SkipName] = set()

    def save(self, layer: Any, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        step, s, i = self.step, self.stage, self.microbatch
        if (ns, name) in self.stashed:
            raise RuntimeError(f"{_label(layer)} stashed {name!r} ({ns}) twice in one forward of micro-batch {i}")
        route = step.stages.skip_layout.route(ns, name)
        key = (i, ns, name)
        if route.pop == s:
            self.stashed[(ns, name)] = None
            step.skips.local[key] = tensor
            return
        if self.recomputing:
            step.skips.stashed[key] = tensor  # now with its graph, for this stage's backward
            return
        if step.grad_enabled and not self.checkpointing:
            step.skips.stashed[key] = tensor
        if tensor is None:
            message = Message([None], (False,), True)
        else:
            needs_grad = is_differentiable(tensor) if self.checkpointing else tensor.requires_grad
            message = Message([tensor.detach()], (needs_grad,), True)
        self.stashed[(ns, name)] = message  # sent by finish(), in the layout's order

    def load(self, layer: Any, ns: Namespace, name: str) -> Optional[Tensor]:
        step, s, i = self.step, self.stage, self.microbatch
        if (ns, name) in self.popped:
            raise RuntimeError(f"{_label(layer)} popped {name!r} ({ns}) twice in one forward of micro-batch {i}")
        self.popped.add((ns, name))
        route = step.stages.skip_layout.route(ns, name)
        key = (i, ns, name)
        if route.stash == s:
            try:
                return step.skips.local.pop(key)
            except KeyError:
                raise RuntimeError(
                    f"{_label(layer)} popped {name!r} ({ns}) but no earlier layer stashed it in this forward"
                ) from None
        leaf: Optional[Tensor]
        if self.recomputing:
            leaf = step.skips.popped.get(key)
        else:
            message = step.transport.recv(Edge(EdgeKind.SKIP, i, route.stash, s, (ns, name)))
            if not message.tensors:
                raise RuntimeError(
                    f"{_label(layer)} popped {name!r} ({ns}) but no earlier layer stashed it in this forward "
                    f"(the layer that declares it, in stage {route.stash}, did not stash it this time)"
                )
            tensor = message.tensors[0]
            needs_grad = message.requires_grad[0] and step.grad_enabled
            leaf = None if tensor is None else make_leaves([tensor], [needs_grad])[0]
            if step.grad_enabled:
                # What the recomputation pops: a copy, if this forward is checkpointed and may change it in place.
                step.skips.popped[key] = leaf if leaf is None or not self.checkpointing else copy_leaf(leaf)
        if leaf is not None and torch.is_grad_enabled() and leaf.requires_grad:
            return alias((leaf,))[0]
        return leaf

    def message(self, ns: Namespace, name: str) -> Message:
        """What the forward sends the stage that pops ``(ns, name)``: the stashed tensor, or, for a declared
        stash that was not made, an empty message (every route carries one message per micro-batch)."""
        return self.stashed.get((ns, name)) or Message([], (), True)


def received_skips(step: "Step", stage: int, microbatch: int) -> List[Optional[Tensor]]:
    """The leaves of the skips ``stage`` popped from earlier stages in ``microbatch``, in the layout's order
    (None: not received)."""
    names = step.stages.skip_layout.pops_from_before[stage]
    return [step.skips.popped.pop((microbatch, ns, name), None) for ns, name in names]


def stashed_roots(step: "Step", stage: int, microbatch: int) -> Tuple[List[Tensor], List[Tensor]]:
    """The tensors ``stage`` stashed for later stages in ``microbatch`` that join its backward, with their
    gradients (received from the popping stages, whose backward ran before)."""
    roots: List[Tensor] = []
    grads: List[Tensor] = []
    for ns, name in step.stages.skip_layout.stashes_for_later[stage]:
        pop = step.stages.skip_layout.route(ns, name).pop
        grad = step.transport.recv(Edge(EdgeKind.SKIP_GRADIENT, microbatch, pop, stage, (ns, name))).tensors[0]
        stashed = step.skips.stashed.pop((microbatch, ns, name), None)
        if stashed is not None and grad is not None and stashed.requires_grad:
            roots.append(stashed)
            grads.append(grad)
    return roots, grads
