"""The runner: a pipeline's stages on their devices and workers, and the plans it executes for them.

One runner serves both :class:`torchpipe.GPipe` and :class:`torchpipe.Pipeline`:
it holds the pipeline's :class:`~torchpipe.runtime.stages.Stages`, the schedule
and the plans made of it, and makes and runs the steps.
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
import threading
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

from torch import Tensor

from torchpipe import waits
from torchpipe.microbatch import Batch
from torchpipe.runtime.driver import lifecycle
from torchpipe.runtime.executor import execute
from torchpipe.runtime.held import Measured
from torchpipe.runtime.stages import Stages
from torchpipe.runtime.step import Loss, Plan, StageHooks, Step
from torchpipe.runtime.transport import Edge, EdgeKind, LocalTransport, Message, Transport
from torchpipe.schedule import Action, Kind, Schedule, simulate, validate, with_recomputation
from torchpipe.stream import current_stream

__all__ = ["Runner"]

BACKWARD_PHASE = (Kind.RECOMPUTE, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)


class Runner:
    """Runs steps over a pipeline's stages, one worker thread per worker of the schedule.

    Args:
        stages: the stages on their devices and workers.
        schedule: the schedule (forwards and backwards) for a number of micro-batches.
        inline_backward: run GPipe's backward-phase actions of workers on the
            output's CUDA device on the calling thread (see [Note: backward threads]).
    """

    def __init__(self, stages: Stages, schedule: Callable[[int], Schedule], *, inline_backward: bool = False) -> None:
        self.stages = stages
        self.schedule = schedule
        #: What runs at the points of each training step's lifecycle (see [Note: stage lifecycle]).
        self.hooks: List[StageHooks] = []
        out = stages.devices[-1] if stages.devices else None
        #: [Note: backward threads] workers whose backward-phase actions run on the caller's (engine) thread.
        self.inline: FrozenSet[int] = frozenset(
            w for w, d in enumerate(stages.worker_devices)
            if inline_backward and out is not None and out.type == "cuda" and d == out
        )
        self._plans: Dict[Tuple[int, int], Plan] = {}
        self._phase_lock = threading.Lock()
        self._phase_owner: Optional[threading.Thread] = None

    def __getstate__(self) -> Dict[str, object]:
        # Copies (deepcopy, pickle) get their own plans and lock (and, through Stages, workers).
        state = self.__dict__.copy()
        for name in ("_phase_lock", "_phase_owner", "_plans"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: Dict[str, object]) -> None:
        self.__dict__.update(state)
        self._plans = {}
        self._phase_lock = threading.Lock()
        self._phase_owner = None

    # --- plans and steps --------------------------------------------------------------------------------

    def plan(self, microbatches: int, checkpoint_stop: int) -> Plan:
        """The :class:`Plan` for a step of this shape (computed on first use, then reused)."""
        key = (microbatches, checkpoint_stop)
        plan = self._plans.get(key)
        if plan is None:
            base = self.schedule(microbatches)
            schedule = with_recomputation(base, lambda s, i: i < checkpoint_stop)
            validate(schedule)  # every schedule is checked (and simulated) before it first runs
            inline: Tuple[Action, ...] = ()
            if self.inline:
                timing = simulate(schedule.only(BACKWARD_PHASE), {kind: 1.0 for kind in Kind})
                inline = tuple(a for a in timing.order() if self.stages.stage_workers[a.stage] in self.inline)
            plan = self._plans[key] = Plan.of(schedule, inline, self.stages.skip_layout)
        return plan

    def forget_plans(self) -> None:
        """Drops the cached plans: the schedule function's answer changed (a zero-bubble split, decided)."""
        self._plans = {}

    def new_step(
        self, batches: Sequence[Optional[Batch]], *, grad_enabled: bool, training: bool, checkpoint_stop: int,
        loss: Optional[Loss] = None, watch_inputs: bool = False, sequence: Optional[int] = None,
        transport: Optional[Callable[[Plan], Transport]] = None,
    ) -> Step:
        """A step of ``batches`` (micro-batches; None for those of other ranks) on this pipeline's plan for its
        shape; its messages go through ``transport(plan)``, made once the step is (default: this process's
        mailbox)."""
        plan = self.plan(len(batches), checkpoint_stop)
        streams = [current_stream(d) for d in self.stages.devices]
        trains = grad_enabled and loss is not None
        step = Step(
            self.stages, plan, streams, batches,
            hooks=[h for h in self.hooks if trains or h.without_grad], grad_enabled=grad_enabled,
            training=training, checkpoint_stop=checkpoint_stop, loss=loss, watch_inputs=watch_inputs,
            sequence=sequence,
        )
        step.transport = transport(plan) if transport is not None else LocalTransport(self.stages, streams)
        measured = self.stages.measured
        if trains and (measured is None or not measured.complete or measured.schedule is not plan.schedule):
            # See [Note: held bytes]: measured on the first training step, and again for another plan (another
            # shape, or the schedule changed: a zero-bubble split decided).
            local = [(a.stage, a.microbatch) for a in plan.schedule.actions()
                     if a.kind is Kind.FORWARD and self.stages.modules[a.stage] is not None]
            step.memory = self.stages.measured = Measured(local, (len(batches), checkpoint_stop), self.stages.modules,
                                                          self.stages.stage_workers, plan.schedule)
        return step

    # --- phases ----------------------------------------------------------------------------------------

    def _execute(self, step: Step, schedule: Schedule, inline: Sequence[Action] = ()) -> None:
        if self.stages.check_fork():
            self._phase_lock, self._phase_owner = threading.Lock(), None
        # One phase at a time per pipeline: two threads driving the same module would otherwise interleave
        # their action lists on the shared workers, and could wait on each other.
        if not self._phase_lock.acquire(blocking=False):
            with waits.waiting(f"the running phase of {self.stages.label}", self._phase_owners) as check:
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
        count = self.stages.count
        for i, grad in enumerate(grads):
            step.transport.send(Edge(EdgeKind.GRADIENT, i, count, count - 1), Message(list(grad)))
        self._execute(step, step.plan.backward, step.plan.inline)
        grads_in, step.input_grads = step.input_grads, [None] * step.microbatches
        missing = [i for i, g in enumerate(grads_in) if g is None]
        assert not missing, f"the backward of micro-batches {missing} did not finish"
        return [g for g in grads_in if g is not None]

    def run(self, step: Step) -> None:
        """Runs the whole schedule of ``step`` in one phase (a Pipeline training step), with the stage hooks."""
        with lifecycle(step):
            self._execute(step, step.plan.schedule)
        if step.memory is not None:
            step.memory.end(0)  # in one process, no receive is posted ahead
        step.batches = None
