"""The runner: a pipeline's stages on their devices and workers, and the plans it executes for them.

One runner serves both :class:`torchpipe.GPipe` and :class:`torchpipe.Pipeline`.
GPipe runs its schedule in two phases, because the user's ``loss.backward()``
sits between them (:meth:`Runner.run_forward`, :meth:`Runner.run_backward`);
Pipeline runs its whole schedule in one (:meth:`Runner.run`).

[Note: backward threads] ``PipelineFunction.backward`` runs on the autograd
engine's thread for the output's device and waits for the workers. A worker's
backward of a CUDA graph is executed by that GPU's engine thread; if that is
the thread blocked in ``PipelineFunction.backward``, nothing moves. So in
GPipe's backward phase the actions of workers on the output's CUDA device run
inline, on the calling thread, in the order of a unit-time simulation; every
other worker runs on its thread. A Pipeline step is driven from the user's
thread, not the engine's, so all its workers run on their threads.
"""
import itertools
import threading
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from torchpipe import waits
from torchpipe.microbatch import Batch
from torchpipe.runtime.driver import StageHooks, lifecycle
from torchpipe.runtime.executor import execute
from torchpipe.runtime.step import Plan, Step
from torchpipe.runtime.transport import Edge, EdgeKind, Message
from torchpipe.schedule import Kind, Schedule, simulate, validate, with_recomputation
from torchpipe.skip.layout import SkipLayout
from torchpipe.stream import AbstractStream, new_stream
from torchpipe.worker import WorkerGroup, fork_generation

__all__ = ["Runner"]

#: Numbers the runners of this process, so that messages tell pipelines apart.
_numbers = itertools.count(1)

BACKWARD_PHASE = (Kind.RECOMPUTE, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)


class Runner:
    """Runs steps over a fixed list of stages, one worker thread per worker of the schedule.

    Args:
        stages: the stages' modules, in order (None for the stages of other ranks).
        devices: the device of each stage.
        schedule: the schedule (forwards and backwards) for a number of micro-batches.
        stage_workers: the worker of each stage.
        worker_devices: the device of each worker.
        skip_layout: where each skip connection starts and ends.
        inline_backward: run GPipe's backward-phase actions of workers on the
            output's CUDA device on the calling thread (see [Note: backward threads]).
        noun: what messages call a stage (GPipe says ``'partition'``).
        name: what messages call the pipeline (``'GPipe(balance=[2, 2])'``); a number
            is added that tells pipelines apart.
    """

    def __init__(
        self,
        stages: Sequence[Optional[nn.Module]],
        devices: Sequence[torch.device],
        schedule: Callable[[int], Schedule],
        stage_workers: Sequence[int],
        worker_devices: Sequence[torch.device],
        skip_layout: SkipLayout,
        *,
        inline_backward: bool = False,
        noun: str = "stage",
        name: str = "a pipeline",
    ) -> None:
        self.stages = list(stages)
        self.noun = noun
        #: The pipeline as messages name it: ``name`` and a number of its own (see [Note: waits]).
        self.label = f"{name} #{next(_numbers)}"
        self.devices = list(devices)
        self.stages_count = len(self.stages)
        self.schedule = schedule
        self.stage_workers = list(stage_workers)
        self.worker_devices = list(worker_devices)
        self.skip_layout = skip_layout
        self.inline_backward = inline_backward
        #: What runs at the points of each training step's lifecycle (see [Note: stage lifecycle]).
        self.hooks: List[StageHooks] = []
        #: Per stage: the locks of its parameters that a stage of another worker shares, in one global order
        #: (GPipe's backward holds them, see [Note: tied parameters]).
        self.shared_locks: List[List[threading.Lock]] = [[] for _ in self.stages]
        #: Per tied parameter with copies on several devices of this process: the copies.
        self.tied_copies: List[List[nn.Parameter]] = []
        out = self.devices[-1] if self.devices else None
        #: [Note: backward threads] workers whose backward-phase actions run on the caller's (engine) thread.
        self.inline: FrozenSet[int] = frozenset(
            w for w, d in enumerate(self.worker_devices)
            if inline_backward and out is not None and out.type == "cuda" and d == out
        )
        self._plans: Dict[Tuple[int, int], Plan] = {}
        self._workers: Optional[WorkerGroup] = None
        self._copy_streams: Optional[List[AbstractStream]] = None
        self._generation = -1
        self._renew()

    def share(self, ties: Sequence[Sequence[int]]) -> None:
        """Locks for the parameters that several workers' stages share: ``ties[k]`` lists the stages that hold
        shared parameter ``k`` (one tensor on one device)."""
        self._shared = [list(stages) for stages in ties]
        self.shared_locks = [[] for _ in self.stages]
        for stages in self._shared:
            if len({self.stage_workers[s] for s in stages}) > 1:
                lock = threading.Lock()
                for s in stages:
                    self.shared_locks[s].append(lock)

    def _renew(self) -> None:
        """Fresh locks (and, on first use, workers): at construction, and in a process forked from ours."""
        self._generation = fork_generation()
        self._lock = threading.Lock()
        self._phase_lock = threading.Lock()
        self._phase_owner: Optional[threading.Thread] = None
        self._workers = None
        self.share(getattr(self, "_shared", []))

    def _check_fork(self) -> None:
        if self._generation != fork_generation():  # see [Note: fork]
            self._renew()

    def __getstate__(self) -> Dict[str, Any]:
        # Copies (deepcopy, pickle) get their own workers, streams and locks.
        state = self.__dict__.copy()
        for name in ("_lock", "_phase_lock", "_phase_owner", "_workers", "_copy_streams", "_plans", "shared_locks"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._plans = {}
        self._copy_streams = None
        self._renew()

    # --- plans and resources ----------------------------------------------------------------------------

    def plan(self, microbatches: int, checkpoint_stop: int) -> Plan:
        """The :class:`Plan` for a step of this shape (computed on first use, then reused)."""
        key = (microbatches, checkpoint_stop)
        plan = self._plans.get(key)
        if plan is None:
            base = self.schedule(microbatches)
            schedule = with_recomputation(base, lambda s, i: i < checkpoint_stop)
            validate(schedule)  # every schedule is checked (and simulated) before it first runs
            inline: Tuple[Any, ...] = ()
            if self.inline:
                timing = simulate(schedule.only(BACKWARD_PHASE), {kind: 1.0 for kind in Kind})
                inline = tuple(a for a in timing.order() if self.stage_workers[a.stage] in self.inline)
            plan = self._plans[key] = Plan.of(schedule, inline, self.skip_layout)
        return plan

    def forget_plans(self) -> None:
        """Drops the cached plans: the schedule function's answer changed (a zero-bubble placement, decided)."""
        self._plans = {}

    def workers(self) -> WorkerGroup:
        """The worker threads, made on first use (so that the caller's thread settings apply)."""
        self._check_fork()
        with self._lock:
            if self._workers is None or not self._workers.alive:
                self._workers = WorkerGroup(self.worker_devices, "stage")
            return self._workers

    def copy_streams(self) -> List[AbstractStream]:
        """One copy stream per stage's device (CPU stand-ins on CPU)."""
        if self._copy_streams is None:
            self._copy_streams = [new_stream(d) for d in self.devices]
        return self._copy_streams

    def layer_names(self, stage: int) -> str:
        module = self.stages[stage]
        names = list(module._modules) if module is not None else []
        if not names:
            return "none"
        return f"{names[0]}..{names[-1]}" if len(names) > 1 else names[0]

    # --- phases ----------------------------------------------------------------------------------------

    def _execute(self, step: Step, schedule: Schedule, inline: Sequence[Any] = ()) -> None:
        self._check_fork()
        # One phase at a time per pipeline: two threads driving the same module would otherwise interleave
        # their action lists on the shared workers, and could wait on each other.
        if not self._phase_lock.acquire(blocking=False):
            with waits.waiting(f"the running phase of {self.label}", self._phase_owners) as check:
                while not self._phase_lock.acquire(timeout=waits.RECHECK):
                    check()
        self._phase_owner = threading.current_thread()
        try:
            execute(step, schedule, inline)
        finally:
            self._phase_owner = None
            self._phase_lock.release()

    def _phase_owners(self) -> List[threading.Thread]:
        """The thread that runs this pipeline's phase now (none between phases)."""
        owner = self._phase_owner
        return [owner] if owner is not None else []

    def run_forward(self, step: Step) -> List[Batch]:
        """Runs every forward action of ``step``; returns the last stage's output per micro-batch."""
        self._execute(step, step.plan.forward)
        step.batches = None
        if step.watch_inputs:
            # Micro-batches are views of one input and share its version counter: an in-place first layer
            # bumps it in every forward. What counts is a change after the last one.
            for state in step.states.values():
                if state.versions is not None:
                    state.versions = [(t, t._version) for t, _ in state.versions]
        return step.take_results() if step.loss is None else []

    def run_backward(self, step: Step, grads: Sequence[List[Optional[Tensor]]]) -> List[List[Optional[Tensor]]]:
        """Runs every recompute and backward action, given each micro-batch's output gradients.

        Returns the gradient of each micro-batch's input tensors (None where
        the input does not require grad).
        """
        last = self.stages_count - 1
        for i, grad in enumerate(grads):
            step.transport.send(Edge(EdgeKind.GRADIENT, i, self.stages_count, last), Message(list(grad)))
        self._execute(step, step.plan.backward, step.plan.inline)
        grads_in, step.input_grads = step.input_grads, [None] * step.microbatches
        missing = [i for i, g in enumerate(grads_in) if g is None]
        assert not missing, f"the backward of micro-batches {missing} did not finish"
        return [g for g in grads_in if g is not None]

    def run(self, step: Step) -> None:
        """Runs the whole schedule of ``step`` in one phase (a Pipeline training step), with the stage hooks."""
        with lifecycle(step):
            self._execute(step, step.plan.schedule)
        step.batches = None
