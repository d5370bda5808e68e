"""The driver: runs one worker's actions of a step in order, and tells the stages where they are in the step.

[Note: stage lifecycle] A stage hears three things about a training step,
all derived from the schedule, never guessed: the step starts (before any
action, on every worker and rank), its last backward of the step is done
(right after the action the plan names, on the worker that ran it: the last
``B``, or the last ``W`` of a split backward), and the step ended (after
every action, before the step returns). Stage hooks (:class:`~torchpipe.runtime.step.StageHooks`)
hang on these: data parallelism starts a stage's gradient reduction after its
last backward, while the backward of other stages still runs, and waits for
it at the end; tied parameters sum their copies' gradients there. A failed
step calls :meth:`StageHooks.abort` instead of the end, on every worker and
rank, so a hook can still do what its peers expect of it (a collective they
already started) and leave nothing half done. Each hook's ``abort`` owes each
collective of the step exactly once, whatever the hook did before the failure
came (one more would pair with the peer's of the next step and hang it), and
every hook's ``abort`` runs even if another's raises.

One driver runs every step, whatever the transport: in one process the
executor runs each worker's list on its thread with :func:`drive`; across
processes a rank runs its own list with :func:`drive` on the calling thread.
"""
import contextlib
from typing import Generator, Optional, Sequence

from torchpipe.runtime import actions as act
from torchpipe.runtime.step import Step
from torchpipe.runtime.transport import Aborted
from torchpipe.schedule import Action

__all__ = ["Progress", "drive", "lifecycle", "begin", "end", "abort"]


class Progress:
    """The action a driver is running (for failure messages): None before the first and after the last."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: Optional[Action] = None


def drive(step: Step, actions: Sequence[Action], progress: Optional[Progress] = None) -> None:
    """Runs ``actions`` of ``step`` in order on the calling thread, calling the stage hooks after each stage's
    last backward.

    Raises:
        Aborted: another action of the step failed first.
        BaseException: what an action raised; the step's transport is aborted first, so every waiting
            action of the step ends.
    """
    transport = step.transport
    lasts = step.plan.last_backward if step.hooks else {}
    try:
        for action in actions:
            if transport.aborted:
                raise Aborted(f"stopped before {action}: another action of the step failed")
            if progress is not None:
                progress.current = action
            act.run(step, action)
            if action in lasts:
                for hook in step.hooks:
                    hook.after_last_backward(step, action.stage)
        if progress is not None:
            progress.current = None
    except BaseException:
        transport.abort()
        raise


def begin(step: Step) -> None:
    """The step starts: every hook's ``before_step``."""
    for hook in step.hooks:
        hook.before_step(step)


def end(step: Step) -> None:
    """The step's actions all ran: every hook's ``after_step``."""
    for hook in step.hooks:
        hook.after_step(step)


def abort(step: Step) -> None:
    """The step failed: every hook's ``abort``, also a hook whose ``before_step`` did not run (it must still do
    what its peers expect of it in this step), and also after another hook's ``abort`` raised (then the first
    such error is raised at the end)."""
    error: Optional[BaseException] = None
    for hook in step.hooks:
        try:
            hook.abort(step)
        except BaseException as exc:  # noqa: B036 - raised below, once every hook has done its share
            error = error or exc
    if error is not None:
        raise error


@contextlib.contextmanager
def lifecycle(step: Step) -> Generator[None, None, None]:
    """:func:`begin` on entry, :func:`end` when the block ends well, :func:`abort` when anything raises (then
    re-raises). Across processes the step records its failure in the store first, so it calls them itself."""
    if not step.hooks:
        yield
        return
    try:
        begin(step)
        yield
        end(step)
    except BaseException:
        abort(step)
        raise
