"""Stages sharded over a mesh's ``'dp'`` dimension with FSDP2 (``data_parallel='shard'``), driven by the lifecycle.

[Note: FSDP2 in a pipeline] Each stage of a rank is ``fully_shard``-ed over
``'dp'``: its parameters, gradients and optimizer state are sharded (DTensors),
and gathered for the step. FSDP2 by itself would gather, reduce and reshard
around every forward and backward, that is per micro-batch. Here the stage
lifecycle (see [Note: stage lifecycle]) drives it instead:

- the pipeline is made: each stage's FSDP2 state is initialised (FSDP2 would
  do it at the stage's first forward, which a failed first step may never
  reach on some ranks: they would then owe collectives they cannot issue);
- the step starts: each stage's parameters are gathered once (``unshard``),
  and FSDP is told that no backward is the last and none reduces or reshards;
- a stage's last backward is done: its reduce-scatter starts (FSDP's
  ``post_backward`` with gradient sync on), in one fixed order of stages on
  every replica, while other stages' backward goes on;
- the step ends: FSDP's end-of-backward callback waits for the reductions
  and sets the sharded gradients; the parameters are resharded.

The order of these calls matters (getting FSDP's last callback wrong once
corrupted gradients in PyTorch's own pipelining, pytorch#144535): the
reduce-scatter and the final callback of a stage come once per step, after
all its micro-batches' backward, before anything reads the gradients. The
reduction is a sum (the loss already weighs each micro-batch by its share of
every replica's samples), and unused parameters reduce zeros, so every
replica issues the same collectives. A failed step (after every rank
committed to it) still gathers, reduces and reshards every stage, so no peer
waits for a collective that never comes; its gradients are unspecified.
Forward-only steps gather and reshard too.
"""
import time
from typing import Any, Dict, List, Optional, Sequence, Set

import torch
from torch import nn

from torchpipe import trace
from torchpipe.runtime.step import StageHooks, Step

__all__ = ["shard_stages", "ShardedStages", "supported"]


def _fully_shard() -> Any:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 has it under _composable, or not at all
        try:
            from torch.distributed._composable.fsdp import fully_shard  # type: ignore[attr-defined]
        except ImportError:
            return None
    return fully_shard


def supported() -> bool:
    """Whether this PyTorch has FSDP2's ``fully_shard``."""
    return _fully_shard() is not None


def shard_stages(stages: Dict[int, nn.Module], dp_mesh: Any) -> Dict[int, Any]:
    """``fully_shard``-s each of this rank's stages over ``dp_mesh``; the stages, now FSDP modules.

    Raises:
        ValueError: this PyTorch has no FSDP2, or two stages of this rank share a parameter (a tie): FSDP2
            would shard it twice.
    """
    fully_shard = _fully_shard()
    if fully_shard is None:
        raise ValueError(
            f"data_parallel='shard' needs FSDP2 (torch.distributed.fsdp.fully_shard), which torch "
            f"{torch.__version__} lacks; upgrade PyTorch or use data_parallel='replicate'"
        )
    owners: Dict[int, int] = {}
    for s, stage in stages.items():
        for param in stage.parameters():
            if owners.setdefault(id(param), s) != s:
                raise ValueError(
                    f"stages {owners[id(param)]} and {s} of one rank share a parameter of shape "
                    f"{tuple(param.shape)} (tied weights), which data_parallel='shard' cannot shard twice; use "
                    "data_parallel='replicate', or a balance or schedule that puts the holders on different ranks"
                )
    sharded: Dict[int, Any] = {}
    for s, stage in stages.items():
        module = fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False)
        module.set_gradient_divide_factor(1.0)  # a sum: see [Note: FSDP2 in a pipeline]
        # FSDP2 initialises a module's state at its first forward; a rank whose first step fails before its
        # stage ever ran one would have none, and its abort would issue no reduce-scatter while its peers
        # issue theirs and wait forever. Every stage is initialised here, the same on every rank.
        lazy_init = getattr(_root_state(module), "_lazy_init", None)
        if callable(lazy_init):
            lazy_init()
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied one)
        if hasattr(module, "set_reduce_scatter_unused_params"):
            module.set_reduce_scatter_unused_params(True)
        sharded[s] = module
    return sharded


class ShardedStages(StageHooks):
    """Drives FSDP2 stages once per step (see [Note: FSDP2 in a pipeline]).

    Args:
        stages: this rank's stages, FSDP modules, by stage index.
    """

    #: Forward-only steps gather the parameters too (a collective): this hook runs for them as well.
    without_grad = True

    def __init__(self, stages: Dict[int, Any]) -> None:
        self.stages = stages
        self.gather_order = sorted(stages)
        self.reduce_order = sorted(stages, reverse=True)  # later stages end their backward first
        self._sequence: Optional[int] = None
        self._gathered: List[int] = []
        self._reduced: List[int] = []
        self._finalized: List[int] = []
        self._resharded: List[int] = []
        #: When each stage's reduce-scatter started (for the timeline's 'reduce' spans).
        self._started: Dict[int, float] = {}
        self._done: Set[int] = set()
        self._training = False

    def _begin(self, step: Step) -> None:
        if self._sequence != step.sequence or step.sequence is None:
            self._sequence = step.sequence
            self._gathered = []
            self._reduced = []
            self._finalized = []
            self._resharded = []
            self._started = {}
            self._done = set()
            self._training = step.grad_enabled

    def before_step(self, step: Step) -> None:
        self._begin(step)
        for s in self.gather_order:
            self._gather(s)

    def _gather(self, s: int) -> None:
        module = self.stages[s]
        if self._training:
            module.set_is_last_backward(False)
            module.set_requires_gradient_sync(False)
            module.set_reshard_after_backward(False)
        module.unshard()
        self._gathered.append(s)

    def after_last_backward(self, step: Step, stage: int) -> None:
        self._done.add(stage)
        while len(self._reduced) < len(self.reduce_order) and self.reduce_order[len(self._reduced)] in self._done:
            self._reduce(self.reduce_order[len(self._reduced)])

    def _reduce(self, s: int) -> None:
        module = self.stages[s]
        module.set_is_last_backward(True)
        module.set_requires_gradient_sync(True)
        module.set_reshard_after_backward(True)
        self._started[s] = time.perf_counter()
        for state in _states(module):
            for group in _groups(state):
                group.post_backward()
        self._reduced.append(s)

    def after_step(self, step: Step) -> None:
        self._finish()

    def _finish(self) -> None:
        """What is left of the step's collectives, each once (after a failure too: see ``abort``)."""
        if self._training:
            for s in self.reduce_order[len(self._reduced) :]:  # stages without a backward in this step
                self._reduce(s)
            for s in self.reduce_order[len(self._finalized) :]:  # waits for the reductions, sets the gradients
                self._finalized.append(s)
                _root_state(self.stages[s])._root_post_backward_final_callback()
                trace.record("reduce", s, 0, self._started.get(s, time.perf_counter()), time.perf_counter())
        for s in self.gather_order[len(self._resharded) :]:
            self._resharded.append(s)
            self.stages[s].reshard()

    def abort(self, step: Step) -> None:
        self._begin(step)
        try:
            for s in self.gather_order[len(self._gathered) :]:
                self._gather(s)
            self._finish()
        except RuntimeError:  # a dead peer: the job must restart; there is nothing left to keep in step
            pass


def _root_state(module: Any) -> Any:
    return _fully_shard().state(module)


def _states(module: Any) -> Sequence[Any]:
    return list(_root_state(module)._state_ctx.all_states)


def _groups(state: Any) -> Sequence[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)  # torch < 2.9: one group per state
    return [group] if group is not None else []
