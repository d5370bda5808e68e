"""The threads that take a peer's first message of a step off the wire (and, after a failure, the rest).

[Note: receiving threads] A receive over gloo cannot be waited for with a
time limit (gloo's timeout breaks the whole group) nor asked whether it is
done, so a wait for a peer that may never send must be a thread's, while the
stage polls the store for failures. That is the peer's first message of the
step, which a receiving thread takes (the peer may have failed before it
began the step: a rank whose wait for the step's start timed out, or that
could not make its transport). Once it has come, the peer is in the step,
and for every receive posted it sends the message, or an abort in its place
(see [Note: abort messages]), or its death closes the connection: the
stage's own thread takes the rest off the wire when its actions need them,
a handoff between threads less per message. The receiving thread also posts the
first :data:`~torchpipe.distributed.routes.AHEAD` receives while the stage
makes its step ready. After a failure the receiving thread again takes what
the peers still send (:meth:`DistributedTransport.fail
<torchpipe.distributed.transport.DistributedTransport.fail>`). The threads
live as long as the pipeline (one per peer), each step handing them its jobs:
a thread started and joined per step costs more than the hand-over.
"""
import functools
import queue
import threading
from typing import Callable, Dict, Optional

__all__ = ["ReceivingThread", "ReceivingThreads"]


class ReceivingThread:
    """A daemon thread that receives one peer's messages for one pipeline, step after step (see [Note: receiving
    threads]). Its jobs run in turn."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Optional[Callable[[], None]]] = queue.SimpleQueue()
        #: Set once the last job handed to the thread has ended.
        self._ended: Optional[threading.Event] = None
        threading.Thread(target=self._run, name=name, daemon=True).start()

    @property
    def busy(self) -> bool:
        """Whether a job handed to the thread has not ended yet."""
        return self._ended is not None and not self._ended.is_set()

    def start(self, job: Callable[[], None]) -> threading.Event:
        """Runs ``job`` on the thread; the event is set once it has ended."""
        ended = self._ended = threading.Event()
        self._jobs.put(functools.partial(_run_job, job, ended))
        return ended

    def close(self) -> None:
        """Ends the thread once its jobs are done."""
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()
            del job  # the step's transport and buffers: not kept while the thread waits for the next step


def _run_job(job: Callable[[], None], ended: threading.Event) -> None:
    try:
        job()
    finally:
        ended.set()


class ReceivingThreads:
    """One pipeline's receiving threads on one rank, by peer; closed with it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._threads: Dict[int, ReceivingThread] = {}
        self._lock = threading.Lock()

    def of(self, peer: int) -> ReceivingThread:
        """The thread for ``peer``; a new one where the last is still busy with an earlier step (after a failure,
        a receive its peer never answered: see :meth:`DistributedTransport.fail
        <torchpipe.distributed.transport.DistributedTransport.fail>`)."""
        with self._lock:
            thread = self._threads.get(peer)
            if thread is None or thread.busy:
                if thread is not None:
                    thread.close()  # it ends if its job ever does
                thread = self._threads[peer] = ReceivingThread(f"torchpipe-recv-{peer}-to-{self.rank}")
            return thread

    def close(self) -> None:
        """Ends every thread once its jobs are done."""
        with self._lock:
            for thread in self._threads.values():
                thread.close()
            self._threads.clear()
