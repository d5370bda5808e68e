"""Tied parameters: one ``Parameter`` held by several layers (a language model's embedding and output head).

[Note: tied parameters] A layer of stage ``a`` and a layer of stage ``b``
may hold the same ``Parameter`` (``lm_head.weight is wte.weight``). Where the
holders are on one device in one process they keep sharing that one tensor:
its gradient accumulates into the one ``.grad`` from both stages' backwards
(autograd's gradient accumulator takes a lock, so two workers may do it at
once; GPipe, which sets parameter gradients aside during a backward, takes a
lock per shared parameter, see ``runtime/boundary.own_gradients``).
Elsewhere (other devices, other ranks) each holder's device gets a copy of
its own; the copies start equal, with the values of the first stage that
holds the parameter, and at the end of every training step each copy's
``.grad`` becomes the plain module's gradient of the parameter: the sum of
every copy's gradient of the step, added to what ``.grad`` held before the
step. So identical optimizer steps keep the copies equal, and every copy is
what the plain module's parameter would be. ``state_dict()`` holds the
parameter under every plain key that names it, as the plain module's does,
and loading a state dict sets every copy.
"""
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from torchpipe.runtime.step import StageHooks, Step

__all__ = [
    "Holder", "Tie", "find_ties", "untie_devices", "retie", "shared_stages", "TiedCopies", "need_all_copies",
    "sum_copies",
]


class Holder(NamedTuple):
    """Where a layer holds a tied parameter: ``module[layer].<path>.<attribute>``."""

    layer: str
    path: str
    attribute: str

    @property
    def key(self) -> str:
        """The plain module's state-dict key of the parameter here (``'5.weight'``)."""
        return ".".join(part for part in (self.layer, self.path, self.attribute) if part)

    def module(self, root: nn.Module) -> nn.Module:
        """The submodule of ``root`` (a stage, or the whole Sequential) whose attribute it is."""
        owner = root._modules[self.layer]
        assert owner is not None
        return owner.get_submodule(self.path) if self.path else owner

    def get(self, root: nn.Module) -> nn.Parameter:
        param = self.module(root)._parameters[self.attribute]
        assert param is not None
        return param

    def set(self, root: nn.Module, param: nn.Parameter) -> None:
        self.module(root)._parameters[self.attribute] = param

    def attach(self, layer: nn.Module, param: nn.Parameter) -> None:
        """Holds ``param`` in ``layer`` (a stand-in for this holder's layer) at this holder's path, making the
        empty submodules on the way."""
        module = layer
        for part in self.path.split(".") if self.path else []:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        module._parameters[self.attribute] = param


class Tie(NamedTuple):
    """A parameter held by layers of several stages: its holders in the module's order, with their stages."""

    holders: Tuple[Holder, ...]
    stages: Tuple[int, ...]

    @property
    def keys(self) -> List[str]:
        """Every plain state-dict key of the parameter."""
        return [h.key for h in self.holders]


def find_ties(module: nn.Sequential, balance: Sequence[int]) -> List[Tie]:
    """The parameters that layers in different stages of ``module`` (cut by ``balance``) share, in the order of
    their first holder. Parameters shared inside one stage need nothing: they are one tensor on one device."""
    stage_of: Dict[str, int] = {}
    start = 0
    for s, count in enumerate(balance):
        for name in list(module._modules)[start : start + count]:
            stage_of[name] = s
        start += count
    holders: Dict[int, List[Holder]] = {}
    for name, layer in module._modules.items():
        if layer is None:
            continue
        for qualified, sub in layer.named_modules(remove_duplicate=False):
            for attribute, param in sub._parameters.items():
                if param is not None:
                    holders.setdefault(id(param), []).append(Holder(name, qualified, attribute))
    ties = []
    for found in holders.values():
        stages = sorted({stage_of[h.layer] for h in found})
        if len(stages) > 1:
            ties.append(Tie(tuple(found), tuple(stages)))
    return ties


def untie_devices(stages: Sequence[nn.Module], devices: Sequence[torch.device], ties: Sequence[Tie]) -> None:
    """Before the stages are placed: each holder on another device than the first holder's gets a copy of its
    own (placing one tensor on two devices would move it twice). Holders on one device keep sharing it."""
    for tie in ties:
        stage_of = {h: next(s for s in tie.stages if h.layer in stages[s]._modules) for h in tie.holders}
        base = devices[stage_of[tie.holders[0]]]
        copies: Dict[torch.device, nn.Parameter] = {}
        for holder in tie.holders[1:]:
            s = stage_of[holder]
            if devices[s] == base:
                continue
            param = holder.get(stages[s])
            if devices[s] not in copies:
                copies[devices[s]] = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
            holder.set(stages[s], copies[devices[s]])


def retie(stages: Sequence[Optional[nn.Module]], ties: Sequence[Tie]) -> List[List[nn.Parameter]]:
    """After the stages are placed (and materialised, which makes new tensors): holders on one device share one
    tensor again, and the copies of other devices take the values of the first local holder. Returns, per
    tie, its distinct local tensors (one per device), the first holder's first."""
    result = []
    for tie in ties:
        found = [(h, stages[s]) for s in tie.stages for h in tie.holders
                 if stages[s] is not None and h.layer in stages[s]._modules]  # type: ignore[union-attr]
        found.sort(key=lambda pair: tie.holders.index(pair[0]))
        per_device: Dict[torch.device, nn.Parameter] = {}
        for holder, stage in found:
            assert stage is not None
            param = holder.get(stage)
            kept = per_device.setdefault(param.device, param)
            if kept is not param:
                holder.set(stage, kept)
        copies = list(per_device.values())
        with torch.no_grad():
            for copy in copies[1:]:
                copy.copy_(copies[0])
        result.append(copies)
    return result


def shared_stages(stages: Sequence[Optional[nn.Module]], ties: Sequence[Tie]) -> List[List[int]]:
    """After :func:`retie`: for each tensor that several stages share (a tie's holders on one device), the stages."""
    result = []
    for tie in ties:
        by_tensor: Dict[int, List[int]] = {}
        for s in tie.stages:
            stage = stages[s]
            if stage is None:
                continue
            for holder in tie.holders:
                if holder.layer in stage._modules:
                    held = by_tensor.setdefault(id(holder.get(stage)), [])
                    if s not in held:
                        held.append(s)
        result += [held for held in by_tensor.values() if len(held) > 1]
    return result


class TiedCopies(StageHooks):
    """In one process: at the end of every training step, each copy of a tied parameter (one per device) gets
    the sum of every copy's gradient of the step (see [Note: tied parameters])."""

    def __init__(self, groups: Sequence[Sequence[nn.Parameter]]) -> None:
        self.groups = [list(g) for g in groups if len(g) > 1]
        self._saved: Dict[int, Optional[Tensor]] = {}

    def before_step(self, step: Step) -> None:
        # The copies' gradients of this step alone, apart from what .grad held before (summed once, below).
        self._saved = {}
        for group in self.groups:
            for copy in group:
                self._saved[id(copy)] = copy.grad
                copy.grad = None

    def after_step(self, step: Step) -> None:
        for group in self.groups:
            grads = [c.grad for c in group if c.grad is not None]
            total = None
            if grads:
                total = grads[0].clone()
                for g in grads[1:]:
                    total.add_(g.to(total.device))
            for copy in group:
                copy.grad = _added(self._saved.pop(id(copy), None), total, copy.device)

    def abort(self, step: Step) -> None:
        for group in self.groups:  # a failed step's gradients are unspecified: keep what was there before
            for copy in group:
                if id(copy) in self._saved:
                    copy.grad = self._saved.pop(id(copy))


def _added(before: Optional[Tensor], step: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    """``before + step`` (either may be None) on ``device``, into ``before`` where it exists."""
    if step is None:
        return before
    if before is None:
        return step.to(device, copy=True)
    return before.add_(step.to(device))


def _positions(group: Sequence[nn.Parameter], stage_params: Sequence[Sequence[Tensor]]) -> List[Tuple[int, int]]:
    """Where the copies of ``group`` are among the stages' parameters: (stage, index) pairs."""
    ids = {id(copy) for copy in group}
    return [(s, k) for s, params in enumerate(stage_params) for k, p in enumerate(params) if id(p) in ids]


def need_all_copies(
    groups: Sequence[Sequence[nn.Parameter]], stage_params: Sequence[Sequence[Tensor]], needed: List[List[bool]]
) -> None:
    """GPipe's backward: where the caller's backward needs one copy's gradient, it needs every copy's (their sum)."""
    for group in groups:
        places = _positions(group, stage_params)
        if any(needed[s][k] for s, k in places):
            for s, k in places:
                needed[s][k] = True


def sum_copies(
    groups: Sequence[Sequence[nn.Parameter]],
    stage_params: Sequence[Sequence[Tensor]],
    grads: List[List[Optional[Tensor]]],
) -> None:
    """GPipe's backward: the gradient returned for each copy of a tied parameter becomes the sum of every copy's,
    once per copy (the first place it appears: the engine accumulates each returned gradient)."""
    for group in groups:
        places = _positions(group, stage_params)
        found = [grads[s][k] for s, k in places if grads[s][k] is not None]
        total: Optional[Tensor] = None
        for grad in found:
            assert grad is not None
            total = grad.clone() if total is None else total.add_(grad.to(total.device))
        seen: List[int] = []
        for s, k in places:
            param = stage_params[s][k]
            first = id(param) not in seen
            seen.append(id(param))
            if not first or total is None:
                grads[s][k] = None
            else:  # each copy its own tensor (the engine may make it the copy's .grad)
                grads[s][k] = total if len(seen) == 1 else total.to(param.device, copy=True)
