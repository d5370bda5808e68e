"""The executor: runs each worker's list of actions for one step, and ends the step as one.

Each worker runs its actions in order on its own thread (a worker thread in
one process); actions of workers marked inline run on the caller's thread (see
[Note: backward threads]). The first action to fail aborts the step's
transport: every action waiting for a message gives up, and no worker starts
another action, so the step ends at once everywhere. The executor waits for
every worker to stop (no task of a failed or interrupted step runs on, writing
gradients, after the caller has moved on) and raises the first failure with
its own type and message.
"""
import functools
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import List, Sequence

from torchpipe import waits
from torchpipe.runtime.driver import drive
from torchpipe.runtime.step import Step
from torchpipe.runtime.transport import Aborted
from torchpipe.schedule import Action, Schedule

__all__ = ["execute"]


def execute(step: Step, schedule: Schedule, inline: Sequence[Action] = ()) -> None:
    """Runs every action of ``schedule`` for ``step``; ``inline`` actions on the calling thread, in that order.

    Raises:
        BaseException: the first action's failure (with its type, message and
            traceback), after every worker has stopped; or what interrupted
            the caller's wait (``KeyboardInterrupt``), likewise.
    """
    inline_workers = {step.stages.stage_workers[a.stage] for a in inline}
    futures: List[Future[None]] = []
    failures: List[BaseException] = []
    try:
        pending = [(w, actions) for w, actions in enumerate(schedule.workers) if actions and w not in inline_workers]
        if pending:
            workers = step.stages.workers()
            threads = [workers[w].thread for w, _ in pending]
            # Said before the tasks are handed over: a worker's wait that would close a circle through this
            # thread then fails, not this one (see [Note: waits]).
            with waits.waiting(f"the workers of {step.stages.label}", threads):
                for w, actions in pending:
                    futures.append(workers[w].submit(functools.partial(drive, step, actions)))
                _drive_inline(step, inline, failures)
                wait_futures(futures)
        else:
            _drive_inline(step, inline, failures)
    except BaseException:
        # Interrupted while waiting (KeyboardInterrupt, say), or a worker could not take the task: stop every
        # worker, and let the tasks already running end, before the caller moves on.
        step.transport.abort()
        _wait_for(futures)
        futures.clear()
        raise
    errors = failures + [f.exception() for f in futures]
    futures.clear()
    failures.clear()
    root = next((e for e in errors if e is not None and not isinstance(e, Aborted)), None)
    if root is None:
        root = next((e for e in errors if e is not None), None)
    errors.clear()
    if root is not None:
        # [Note: failed steps] Raise without leaving the exception in this frame's locals: its traceback
        # holds this frame, and a cycle through it would keep the step's tensors until the garbage collector
        # runs; without it they are freed as soon as the caller drops the exception.
        try:
            raise root
        finally:
            root = None


def _drive_inline(step: Step, inline: Sequence[Action], failures: List[BaseException]) -> None:
    """Runs the ``inline`` actions on this thread; a failure is kept in ``failures``, raised once every worker
    has stopped."""
    if inline:
        try:
            drive(step, inline)
        except BaseException as exc:  # noqa: B036 - raised by execute, once every worker has stopped
            failures.append(exc)


def _wait_for(futures: Sequence["Future[None]"]) -> None:
    """Waits for ``futures``; a second interruption gives up waiting."""
    try:
        wait_futures(futures)
    except BaseException:  # noqa: B036 - the caller re-raises the first interruption
        pass
