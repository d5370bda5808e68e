"""The transport between stages: typed edges, the messages they carry, and the in-process mailbox.

[Note: transports] The stages' actions never know whether the next stage is a
thread or a process: they ``send`` and ``recv`` messages named by an
:class:`Edge` (what the message is, for which micro-batch, from which stage to
which). In one process, :class:`LocalTransport` hands tensors over through a
mailbox, copied between devices on copy streams; across processes the same
protocol runs over ``torch.distributed`` (:mod:`torchpipe.distributed`). Either
transport makes every waiting ``recv`` end when any action fails (``abort``),
which is what keeps "nothing hangs" true.
"""
import enum
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple

from torch import Tensor

from torchpipe import trace, transfer
from torchpipe.runtime.release import releasable, release
from torchpipe.runtime.stages import Stages
from torchpipe.schedule import Action, Kind
from torchpipe.skip.layout import SkipLayout
from torchpipe.skip.namespace import Namespace
from torchpipe.stream import CPU_EVENT, AbstractEvent, AbstractStream

__all__ = ["EdgeKind", "Edge", "Message", "Transport", "Mailbox", "LocalTransport", "Aborted", "sends"]


class EdgeKind(str, enum.Enum):
    """What a message carries."""

    #: A stage's output, to the next stage.
    ACTIVATION = "activation"
    #: The gradient of a stage's input, to the previous stage (or of the output, from the caller).
    GRADIENT = "gradient"
    #: A tensor a skippable layer stashed, straight to the stage that pops it.
    SKIP = "skip"
    #: The gradient of a popped skip tensor, straight back to the stage that stashed it.
    SKIP_GRADIENT = "skip-gradient"


@dataclass(frozen=True)
class Edge:
    """The name of one message: its kind, micro-batch, source and target stages, and skip name if any."""

    kind: EdgeKind
    microbatch: int
    source: int
    target: int
    skip: Optional[Tuple[Namespace, str]] = None

    def __str__(self) -> str:
        what = self.kind.value if self.skip is None else f"{self.kind.value} {self.skip[1]!r} ({self.skip[0]})"
        return f"{what} of micro-batch {self.microbatch} from stage {self.source} to stage {self.target}"


class Message(NamedTuple):
    """Tensors handed from one stage to another.

    ``requires_grad`` says which tensors the receiver's leaves should require
    grad for; ``atomic`` whether the stage returned a single tensor (not a
    tuple); ``event`` marks the end of the copy on CUDA. A skip message with no
    tensor at all (``tensors == []``) says the layer did not stash it this time.
    """

    tensors: List[Optional[Tensor]]
    requires_grad: Tuple[bool, ...] = ()
    atomic: bool = False
    event: AbstractEvent = CPU_EVENT


class Aborted(Exception):
    """Raised in an action that waited for a message another, failed, action was to send."""


def sends(action: Action, stages: int, layout: SkipLayout) -> Tuple[Edge, ...]:
    """The messages ``action`` sends, in the order it sends them: the one order both transports follow.

    A forward sends the skips it stashed for later stages (in the layout's
    order), then its output to the next stage; a backward (or the input half of
    a split one) sends the gradients of the skips it popped back to their
    stashing stages, then its input's gradient to the previous stage. Across
    processes the receiving rank posts its receives in this order (see
    [Note: message order] in ``distributed/routes.py``).
    """
    s, i = action.stage, action.microbatch
    edges: List[Edge] = []
    if action.kind is Kind.FORWARD:
        for ns, name in layout.stashes_for_later[s]:
            edges.append(Edge(EdgeKind.SKIP, i, s, layout.route(ns, name).pop, (ns, name)))
        if s + 1 < stages:
            edges.append(Edge(EdgeKind.ACTIVATION, i, s, s + 1))
    elif action.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
        for ns, name in layout.pops_from_before[s]:
            edges.append(Edge(EdgeKind.SKIP_GRADIENT, i, s, layout.route(ns, name).stash, (ns, name)))
        if s > 0:
            edges.append(Edge(EdgeKind.GRADIENT, i, s, s - 1))
    return tuple(edges)


class Transport(Protocol):
    """How the actions of one step exchange messages (see [Note: transports])."""

    @property
    def aborted(self) -> bool: ...

    def send(self, edge: Edge, message: Message) -> None: ...

    def recv(self, edge: Edge) -> Message: ...

    def release(self, edge: Edge, outputs: Sequence[Tensor], others: Sequence[Tensor]) -> None:
        """After ``edge``'s message of stage ``outputs`` was sent: frees the data of the outputs that nothing
        reads again (``others``: what else the action sent), where the message was a copy (see [Note:
        released outputs] in ``runtime/release.py``)."""

    def abort(self) -> None: ...


class Mailbox:
    """Messages left for the actions of one step, by edge; a ``take`` waits for its message or a failure.

    Both transports keep their messages here: in one process every message,
    across processes those between stages of this rank and those the
    receiving threads took off the wire. ``abort`` wakes every wait with
    :class:`Aborted`; ``fail`` with the error it is given (a peer that failed).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._slots: Dict[Edge, Message] = {}
        self._aborted = False
        self._failure: Optional[Callable[[], BaseException]] = None

    @property
    def aborted(self) -> bool:
        return self._aborted

    def put(self, edge: Edge, message: Message) -> None:
        with self._cond:
            self._slots[edge] = message
            self._cond.notify_all()

    def take(
        self, edge: Edge, *, poll: Optional[Callable[[], None]] = None, interval: Optional[float] = None
    ) -> Message:
        """The message of ``edge``, once it is there.

        Raises:
            BaseException: what ``fail`` was given, or what ``poll`` (called
                every ``interval`` seconds while waiting) raises.
            Aborted: the step was aborted while waiting.
        """
        with self._cond:
            while True:
                message = self._slots.pop(edge, None)
                if message is not None:
                    return message
                if self._failure is not None:
                    self._aborted = True
                    raise self._failure()
                if self._aborted:
                    raise Aborted(f"another action of the step failed while this one waited for the {edge}")
                self._cond.wait(interval)
                if poll is not None:
                    poll()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def fail(self, error: Callable[[], BaseException]) -> None:
        """Makes every wait raise ``error()`` (the first failure given wins)."""
        with self._cond:
            if self._failure is None:
                self._failure = error
            self._cond.notify_all()


class LocalTransport:
    """The messages of one step between the stages of one process: a mailbox, and copies between devices.

    ``send`` starts the copy to the target stage's device (on the copy streams,
    on CUDA) and leaves the message; ``recv`` waits for it, then makes the
    target's stream wait for the copy.
    """

    def __init__(self, stages: Stages, streams: List[AbstractStream]) -> None:
        self.stages = stages
        self.streams = streams
        self.mailbox = Mailbox()

    @property
    def aborted(self) -> bool:
        return self.mailbox.aborted

    def send(self, edge: Edge, message: Message) -> None:
        stages = self.stages
        # The caller hands the output's gradients to the last stage as if from a stage after it.
        source = min(edge.source, stages.count - 1)
        source_device, target_device = stages.devices[source], stages.devices[edge.target]
        # A real copy (between devices) is a task of its own on the timeline; on CUDA it shows the time to
        # queue the copy, which then runs on the copy streams.
        copying = trace.span("copy", source, edge.microbatch) if source_device != target_device else trace.NOTHING
        with copying:
            streams = stages.copy_streams()
            tensors, event = transfer.send(
                message.tensors,
                target_device,
                source_stream=self.streams[source],
                source_copy_stream=streams[source],
                target_copy_stream=streams[edge.target],
            )
        transfer.log_transfer(
            edge.kind.value, edge.source, edge.target, edge.microbatch, tensors, source_device, target_device,
            None if edge.skip is None else edge.skip[1],
        )
        self.mailbox.put(edge, message._replace(tensors=tensors, event=event))

    def recv(self, edge: Edge) -> Message:
        message = self.mailbox.take(edge)
        tensors = transfer.receive(message.tensors, message.event, self.streams[edge.target])
        return message._replace(tensors=tensors)

    def release(self, edge: Edge, outputs: Sequence[Tensor], others: Sequence[Tensor]) -> None:
        # On one device the message is the outputs themselves. From a GPU to another device it is a copy,
        # queued on the source's copy stream, on which the send recorded the outputs: the caching allocator
        # reuses their memory only once that copy is over, so the outputs may go now (see [Note: released
        # outputs]). A copy from host memory may still read it, unrecorded: kept.
        source, target = self.stages.devices[edge.source], self.stages.devices[edge.target]
        if source != target and source.type == "cuda":
            release(releasable(outputs, others))

    def abort(self) -> None:
        self.mailbox.abort()
