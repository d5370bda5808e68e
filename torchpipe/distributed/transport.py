"""The transport of one step between the ranks of a multi-process pipeline: point-to-point over c10d.

[Note: message order] Every rank knows the whole schedule, so it knows which
messages each other rank will send it in a step, and in which order: a rank
sends, action by action down its list, a forward's skips (in the layout's
order) then its activation, and a backward's skip gradients then its input
gradient. For each peer this rank posts the receives of exactly those
messages in exactly that order (a header, then the tensors it announces),
:data:`AHEAD` messages ahead of the one it waits for (one over NCCL), and
takes them off the wire in that order into the step's mailbox, where the
stage's action takes each. Each message has tags of its own (its position in
the pair's order), and both sides issue a pair's operations in the same
order, as NCCL needs.

Who waits for a message: a receive over gloo cannot be waited for with a
time limit (gloo's timeout breaks the whole group) nor asked whether it is
done, so a wait for a peer that may never send must be a thread's, while the
stage polls the store for failures. That is the peer's first message of the
step, which a receiving thread takes (the peer may have failed before it
began the step: a rank whose wait for the step's start timed out, or that
could not make its transport). Once it has come,
the peer is in the step, and for every receive posted it sends the message,
or an abort in its place (see [Note: abort messages]), or its death closes
the connection: the stage's own thread takes the rest off the wire when its
actions need them. A hop between threads less per message: each was two
wake-ups on busy cores, 0.2 to 0.4 ms in the timeline of a two-rank step on
two cores. The receiving thread also posts the first :data:`AHEAD` receives,
while the stage makes its step ready: the stage's thread doing it (and
taking the first message itself) made a two-rank step 1 to 2.5 ms slower.
After a failure the receiving thread again takes what the peers still send
(:meth:`DistributedTransport.fail`). The threads live as long as the
pipeline (one per peer), each step handing them its jobs: a thread started
and joined per step cost the step 0.25 to 0.6 ms on two busy cores.

Posting ahead is what makes a message cheap: gloo moves a message only once
its receive is posted, so a receive posted after its send costs the pair
another trip between the ranks. The window is fixed, so the buffers
allocated ahead stay few whatever the number of micro-batches (at most
:data:`AHEAD` messages' tensors per peer).

[Note: expected layouts] Waiting for a header before posting the receives
of its tensors would cost every message a second trip between the ranks. So
both ends of a pair remember, per message (the edge), the layout (dtype and
shape of each tensor) it had the last time it crossed, and the receiver posts
the tensors' receives of that layout together with the header's. The header
still says what the message really is: when the layout changed (another
batch size, an uneven last micro-batch, a skip not stashed this time), the
sender first sends tensors of the remembered layout, which the receiver
drops, then the real ones, which it receives into new buffers of the
header's layout. A stale shape is never used; both ends update their memory
from the same message, so they stay in step.

[Note: packed messages] Where the tensors travel over gloo, as the header
does (on CPU), a message is one buffer: its header, then its tensors' bytes,
each at an aligned offset (:func:`wire.pack`); the receiver posts one
receive of the remembered layout's size and takes the tensors on its memory,
no copies (made as the receive is posted, on the thread that posts it). One send
and one receive per message instead of one per tensor more: each gloo
operation costs the two processes' threads a round of wake-ups, which on a
machine with few cores is most of a small message's cost. The sender keeps
each small message's buffer and refills it at the next step (a copy per
tensor in place of an allocation and a concatenation), once its send is over
and while its header is the same (header and layout: the same). When
the layout changed, the packed buffer carries only the header (and unused
bytes of the old size) and the tensors follow one by one, as in [Note:
expected layouts]. Over NCCL the header goes over gloo and the tensors over
NCCL, separately.

[Note: a group for each direction] A pair of ranks sends messages both
ways (activations to the next stage, gradients back). The messages to a
higher rank go through the channel's ``up`` groups (``control`` and
``data``), those to a lower rank through ``down``, a gloo group of their own
(CUDA tensors through the one NCCL group, in order, either way). Through one group,
both directions shared one connection, one lock of gloo's pair and one gloo
thread in each process, which takes the arriving messages and the notices of
the peer's posted receives. On the last stage's rank of a tiny two-rank
`1f1b` step, the gradient sends took 47% of the stage thread's busy samples
(`py-spy --native`: waiting for the pair's lock, writing "ready to send"
notices where its own gloo thread had not yet read the peer's "receive
posted" one; pipelining's sends 11%), and gloo's threads 1.9 to 2.3 ms of CPU
a step. With a group for each direction: 13%, and 0.6 to 0.7 ms; the step
0.9 to 1.2 ms faster with a core per rank, 1.5 to 1.9 ms with the cores
shared (in one pair of processes, switched every 25 steps). The cost: a
second gloo group per pipeline (its connections, made as the pipeline is,
and its thread).

[Note: abort messages] When a rank's step fails (or it learns from the store
that another rank's did), it sends each peer, in place of the messages it
still owed it, as many headers that say "abort" as the peer has posted
receives for (:data:`AHEAD`, or fewer at the end of the step), each with
tensors of its message's remembered layout. The peer, at the first abort
(on its stage's thread or its receiving thread), takes the others (they are
on their way) and receives nothing more from it; everything sent before was
received. So after a failure seen by every rank
no receive is left pending, and the pipeline's process groups are as good as
new for the next step. Only a rank that died (or a receive that met an
error it does not expect, a bug) leaves its pairs out of step: the peers'
receives fail at once, or the step fails naming the error, and the job has
to be restarted.
"""
import collections
import datetime
import functools
import queue
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, cast

import torch
from torch import Tensor

from torchpipe import trace
from torchpipe.distributed import wire
from torchpipe.distributed.channel import BUSY_POLL_SECONDS, POLL_SECONDS, Channel, PipelineError
from torchpipe.runtime.transport import Edge, EdgeKind, Mailbox, Message
from torchpipe.schedule import Action, Schedule

__all__ = ["DistributedTransport", "message_orders", "AHEAD"]

#: How many messages a receiving thread keeps its receives posted for: the one it waits for and those after
#: it (see [Note: message order]); a failed rank sends that many aborts. Over NCCL, one: NCCL pairs a
#: pair's operations by their order, not their tags, and a message whose layout changed posts its real
#: receives after its header came, so nothing may be posted between.
AHEAD = 8

#: Tags: a step's messages between a pair are numbered from 0; each takes two tags (header, tensors).
_TAGS_PER_STEP = 1 << 20  # x2 tags per message, x512 steps: below 2**31


def message_orders(
    schedule: Schedule, sends: Mapping[Action, Tuple[Edge, ...]]
) -> Dict[Tuple[int, int], List[Edge]]:
    """For each (sending worker, receiving worker) pair of different workers, its messages in order, from what
    each action sends (the plan's :func:`~torchpipe.runtime.transport.sends`)."""
    orders: Dict[Tuple[int, int], List[Edge]] = {}
    for w, actions in enumerate(schedule.workers):
        for action in actions:
            for edge in sends[action]:
                target = schedule.stage_workers[edge.target]
                if target != w:
                    orders.setdefault((w, target), []).append(edge)
    return orders


class _Routes(NamedTuple):
    """A schedule's messages as one rank sees them (see [Note: message order]): per peer it sends to, the
    messages in order and each one's position; per peer it receives from, the same."""

    outgoing: Dict[int, List[Edge]]
    sent_at: Dict[int, Dict[Edge, int]]
    incoming: Dict[int, Tuple[List[Edge], Dict[Edge, int]]]


def _routes(channel: Channel, schedule: Schedule, sends: Mapping[Action, Tuple[Edge, ...]]) -> _Routes:
    """``schedule``'s routes on ``channel``'s rank, made once per schedule (every step of a shape has the same;
    making them was a tenth of a millisecond a step)."""
    cached = channel.routes.get(id(schedule))
    if cached is not None and cached[0] is schedule:
        return cast(_Routes, cached[1])
    orders = message_orders(schedule, sends)
    outgoing = {peer: edges for (source, peer), edges in orders.items() if source == channel.rank}
    incoming = {peer: edges for (peer, target), edges in orders.items() if target == channel.rank}
    routes = _Routes(
        outgoing,
        {peer: {edge: k for k, edge in enumerate(edges)} for peer, edges in outgoing.items()},
        {peer: (edges, {edge: k for k, edge in enumerate(edges)}) for peer, edges in incoming.items()},
    )
    if len(channel.routes) >= 16:  # schedules a tuner replaced, or shapes not seen for long
        channel.routes.clear()
    channel.routes[id(schedule)] = (schedule, routes)  # the schedule kept: its id is not reused meanwhile
    return routes


class _Posted(NamedTuple):
    """A message's receives as posted: the header's buffer (a packed message's whole buffer) and its work, the
    layout guessed, the tensors' buffers and works (unpacked), or the guessed tensors on the buffer's memory
    (packed: made as the receive is posted, off the way of the stage that takes the message)."""

    header: Tensor
    work: Any
    expected: wire.Layout
    tensors: List[Tuple[Tensor, Any]]
    views: List[Tensor]


def _layout(tensors: Sequence[Tensor]) -> wire.Layout:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def _wait_all(posted: List[Tuple[Tensor, Any]]) -> List[Tensor]:
    """The buffers of ``posted`` receives, once they are all received."""
    for _, work in posted:
        work.wait()
    return [tensor for tensor, _ in posted]


#: The largest packed message whose buffer is kept for the same message of the next step (see [Note: packed
#: messages]): the small ones, whose cost is the allocation and the calls more than the copy. The buffers kept are
#: at most one step's messages of this size.
_KEPT_BYTES = 1 << 17


class _Outbox:
    """A packed message's buffer, with its header and views of its tensors' places, and the send that last
    read it."""

    __slots__ = ("buffer", "header", "views", "work")

    def __init__(self, buffer: Tensor, header: Tensor, views: List[Tensor]) -> None:
        self.buffer = buffer
        self.header = header
        self.views = views
        self.work: Any = None


class _ReceivingThread:
    """A daemon thread that receives one peer's messages for one pipeline, step after step (see [Note: message
    order]). Its jobs run in turn."""

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


#: Each channel's receiving threads, by peer; closed when the channel goes.
_receiving: "weakref.WeakKeyDictionary[Channel, Dict[int, _ReceivingThread]]" = weakref.WeakKeyDictionary()
_receiving_lock = threading.Lock()


def _receiving_thread(channel: Channel, peer: int) -> _ReceivingThread:
    """``channel``'s receiving thread for ``peer``; a new one where the last is still busy with an earlier step
    (after a failure, a receive its peer never answered: see :meth:`DistributedTransport.fail`)."""
    with _receiving_lock:
        threads = _receiving.get(channel)
        if threads is None:
            threads = _receiving[channel] = {}
            weakref.finalize(channel, _close_all, threads)
        thread = threads.get(peer)
        if thread is None or thread.busy:
            if thread is not None:
                thread.close()  # it ends if its job ever does
            thread = threads[peer] = _ReceivingThread(f"torchpipe-recv-{peer}-to-{channel.rank}")
        return thread


def _close_all(threads: Dict[int, _ReceivingThread]) -> None:
    for thread in threads.values():
        thread.close()


class _PeerFailed:
    """Left in the mailbox by a receiving thread whose peer failed or died (``died``: the failure is news, to
    record in the store; else the peer recorded it)."""

    def __init__(self, message: str, died: bool) -> None:
        self.message = message
        self.died = died


class _Incoming:
    """What one peer sends this rank in a step, as it comes off the wire, in order (see [Note: message
    order]): the receives posted, and how many messages have been received."""

    #: Set once the receiving thread has taken the first message (or failed to): its job's end.
    first: threading.Event

    def __init__(self, edges: List[Edge], index: Dict[Edge, int], thread: _ReceivingThread) -> None:
        self.edges = edges
        self.index = index
        #: The receives posted for the next messages, in order.
        self.posted: Deque[_Posted] = collections.deque()
        #: The number of messages received (left in the mailbox).
        self.received = 0
        #: Whether nothing more comes: the peer aborted, or its connection failed.
        self.stopped = False
        #: The thread that takes the first message (and, after a failure, drains the rest).
        self.thread = thread


class DistributedTransport:
    """The messages of one step on this rank: local ones through a mailbox, the others over c10d.

    Args:
        channel: this rank's channel (process groups, store).
        sequence: the step's number (the same on every rank).
        schedule: the step's whole schedule.
        sends: what each action of the schedule sends, in order (the step's plan's).
        devices: the device of each stage this rank runs (others: unused).
    """

    def __init__(
        self,
        channel: Channel,
        sequence: int,
        schedule: Schedule,
        sends: Mapping[Action, Tuple[Edge, ...]],
        devices: Sequence[torch.device],
    ) -> None:
        self.channel = channel
        self.sequence = sequence
        self.stage_workers = schedule.stage_workers
        self.devices = list(devices)
        self.rank = channel.rank
        self.mailbox = Mailbox()
        self._aborted = False
        self._failed = False
        routes = _routes(channel, schedule, sends)
        base = (sequence % 512) * _TAGS_PER_STEP * 2
        self._base = base
        #: Per peer, what this rank sends it, in order, and how many of them it has sent.
        self._outgoing = routes.outgoing
        self._index = routes.sent_at
        self._sent = {peer: 0 for peer in self._outgoing}
        #: Sends in flight: the peer, the works, and the tensors they read (kept alive until they end).
        self._pending: List[Tuple[int, List[Any], List[Tensor]]] = []
        #: Whether messages travel packed (see [Note: packed messages]): where tensors and headers share gloo,
        #: which is also where receives may be posted AHEAD (over NCCL, one). The same on every rank.
        self._packed = channel.device.type != "cuda"
        self._ahead = AHEAD if self._packed else 1
        #: Per peer that sends this rank messages, what it sends; its receiving thread takes the first.
        self._incoming: Dict[int, _Incoming] = {}
        for peer, (edges, index) in routes.incoming.items():
            incoming = self._incoming[peer] = _Incoming(edges, index, _receiving_thread(channel, peer))
            incoming.first = incoming.thread.start(functools.partial(self._receive_first, peer, incoming))
        #: The ends of the receiving threads' jobs: the first messages', then, after a failure, the drains'.
        self._jobs = [incoming.first for incoming in self._incoming.values()]
        # The step's start looked at the store (or will, waiting for it): the first look for a failure waits.
        self._last_poll = time.monotonic()

    # --- the Transport protocol --------------------------------------------------------------------------

    @property
    def aborted(self) -> bool:
        if self._aborted or self.mailbox.aborted:
            return True
        self._poll_failure(BUSY_POLL_SECONDS)  # between actions: see BUSY_POLL_SECONDS
        return self._aborted

    def _poll_failure(self, interval: float = POLL_SECONDS) -> None:
        """Looks in the store for another rank's failure, at most every ``interval`` seconds (a look costs a round
        trip to the store, too much for every action or message)."""
        now = time.monotonic()
        if now - self._last_poll >= interval:
            self._last_poll = now
            if self.channel.failure(self.sequence) is not None:
                self._aborted = True

    def send(self, edge: Edge, message: Message) -> None:
        peer = self.stage_workers[edge.target]
        if peer == self.rank:
            self.mailbox.put(edge, message)
            return
        k = self._index[peer][edge]
        assert k == self._sent[peer], f"{edge} is sent out of the schedule's order ({k} != {self._sent[peer]})"
        self._sent[peer] += 1
        # The stages send detached tensors; a tensor that requires grad is detached here (a .contiguous() of it
        # would be recorded by autograd).
        tensors = [None if t is None else (t.detach() if t.requires_grad else t).contiguous() for t in message.tensors]
        if edge.kind is EdgeKind.SKIP and not message.tensors:
            header = wire.encode(wire.Kind.NOT_STASHED)
        else:
            header = wire.encode(wire.Kind.DATA, tensors, message.requires_grad, message.atomic)
        present = [t for t in tensors if t is not None]
        layout = _layout(present)
        key = (self.rank, peer, edge)
        with trace.span("copy", edge.source, edge.microbatch) if present else trace.NOTHING:
            try:
                works, kept = self._post_send(
                    peer, k, header, self.channel.layouts.get(key, ()), layout, present, self.devices[edge.source],
                    edge,
                )
            except RuntimeError as exc:
                self._peer_died(peer, f"sent its {edge}", exc)
        self.channel.layouts[key] = layout
        self._pending.append((peer, works, kept))

    def _post_send(
        self, peer: int, k: int, header: Tensor, expected: wire.Layout, layout: wire.Layout, tensors: List[Tensor],
        device: torch.device, edge: Optional[Edge] = None,
    ) -> Tuple[List[Any], List[Tensor]]:
        """Sends message ``k``'s header and tensors to ``peer`` (see [Note: expected layouts]); the works, and
        the tensors to keep alive until they end."""
        control, data = self._groups(self.rank, peer)
        if self._packed:  # one buffer: the header, then the tensors (see [Note: packed messages])
            if layout == expected and edge is not None:
                box = self._pack(peer, edge, header, tensors, layout)
                sent = [box.buffer]
            else:
                box = None
                sent = [wire.pack(header, None, expected)]
            works = [control.send(sent, peer, self._tag(k, 0))]
            if box is not None:
                box.work = works[0]
            if layout != expected:
                sent += tensors
                works += [data.send([tensor], peer, self._tag(k, 1)) for tensor in tensors]
            return works, sent
        sent = [header]
        works = [control.send([header], peer, self._tag(k, 0))]
        if layout != expected:  # the peer posted receives of the old layout: fill them first
            sent += [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in expected]
        sent += tensors
        for tensor in sent[1:]:
            works.append(data.send([tensor], peer, self._tag(k, 1)))
        return works, sent

    def _pack(self, peer: int, edge: Edge, header: Tensor, tensors: List[Tensor], layout: wire.Layout) -> "_Outbox":
        """The packed buffer of ``edge``'s message (see [Note: packed messages]): the last step's, refilled, where
        it had the same header and its send is over; else a new one, kept for the next step if it is small."""
        boxes: Dict[Tuple[int, Edge], _Outbox] = self.channel.outboxes
        box = boxes.get((peer, edge))
        # The header is wire.encode's, one object per header: the same object, the same layout.
        if box is not None and box.header is header and box.work is not None and box.work.is_completed():
            for view, tensor in zip(box.views, tensors):
                view.copy_(tensor)
            return box
        buffer = wire.pack(header, tensors, layout)
        box = _Outbox(buffer, header, wire.unpack(buffer, layout))
        if buffer.numel() <= _KEPT_BYTES:
            boxes[(peer, edge)] = box
        else:
            boxes.pop((peer, edge), None)
        return box

    def _peer_died(self, peer: int, doing: str, error: BaseException) -> None:
        """Records that ``peer``'s connection failed and raises :class:`PipelineError`."""
        message = f"rank {peer} died or closed its connection while rank {self.rank} {doing}: {error}"
        self.channel.fail(self.sequence, message)
        self._aborted = True
        raise PipelineError(self.channel.failure(self.sequence) or message)

    def recv(self, edge: Edge) -> Message:
        peer = self.stage_workers[edge.source]
        incoming = self._incoming.get(peer)  # None: a message between this rank's own stages
        # Message k > 0 not received yet: the stage's thread takes it off the wire, once the first has come
        # through the receiving thread (see [Note: message order]); message 0 the mailbox waits for.
        k = incoming.index[edge] if incoming is not None else 0
        if incoming is not None and k >= max(incoming.received, 1):
            while not incoming.first.wait(POLL_SECONDS):
                self._check_store()
            # The peer is in the step: what it owes comes, or an abort in its place, or its connection fails.
            while not incoming.stopped and incoming.received <= k:
                message = self._take_next(peer, incoming, keep=incoming.received == k)
                if message is not None:  # this action's own: no trip through the mailbox
                    return message
        return self.mailbox.take(edge, poll=self._check_store, interval=POLL_SECONDS)

    def _check_store(self) -> None:
        """While a receive waits: raises :class:`PipelineError` if another rank's failure is in the store."""
        self._poll_failure()
        if self._aborted:
            self.mailbox.abort()
            self.channel.raise_failure(self.sequence)

    def abort(self) -> None:
        self.mailbox.abort()

    # --- the end of a step -----------------------------------------------------------------------------

    def finish(self) -> None:
        """After this rank's last action: waits for its sends and its receiving threads."""
        for peer, works, _ in self._pending:
            for work in works:
                try:
                    work.wait()
                except RuntimeError as exc:
                    self._peer_died(peer, "waited for its sends to end", exc)
        self._pending.clear()
        for ended in self._jobs:
            ended.wait()

    def fail(self) -> None:
        """After a failure: tells each peer not to wait for what it still expects (see [Note: abort messages]),
        and lets the receiving threads end."""
        if self._failed:
            return
        self._failed = True
        self.abort()
        for peer, edges in self._outgoing.items():
            k = self._sent[peer]
            self._sent[peer] = len(edges)
            # The peer has posted the receives of messages k to k + ahead - 1 (see [Note: abort messages]).
            for j in range(k, min(k + self._ahead, len(edges))):
                edge = edges[j]
                expected = self.channel.layouts.get((self.rank, peer, edge), ())
                try:
                    works, kept = self._post_send(
                        peer, j, wire.encode(wire.Kind.ABORT), expected, (), [], self.devices[edge.source]
                    )
                    self._pending.append((peer, works, kept))
                except RuntimeError:  # the peer died: it expects nothing any more
                    break
        # What the peers still send (their messages or aborts) is taken off the wire, on the receiving threads:
        # a peer that never started the step never sends, and only a thread can wait for it without end.
        for peer, incoming in self._incoming.items():
            self._jobs.append(incoming.thread.start(functools.partial(self._drain, peer, incoming)))
        deadline = time.monotonic() + 10.0
        for _, works, _ in self._pending:
            for work in works:
                # A send completes when the peer receives it. A peer that failed before it made its transport
                # (its wait for the step's start timed out, say) never will: give up on it after a while.
                try:
                    work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
                except RuntimeError:  # a dead peer, or the time is up
                    pass
        self._pending.clear()
        for ended in self._jobs:
            ended.wait(max(0.0, deadline - time.monotonic()))

    # --- receiving ---------------------------------------------------------------------------------------

    def _groups(self, source: int, target: int) -> Tuple[Any, Any]:
        """The process groups (for the header, for the tensors) of a message from rank ``source`` to rank
        ``target``: one pair of groups for each direction (see [Note: a group for each direction])."""
        return self.channel.up if source < target else self.channel.down

    def _tag(self, k: int, part: int) -> int:
        return self._base + 2 * k + part

    def _receive_first(self, peer: int, incoming: _Incoming) -> None:
        """The receiving thread's job for ``peer`` in a step: posts the receives of its first :data:`AHEAD`
        messages and takes the first off the wire (see [Note: message order])."""
        if self.channel.device.type == "cuda":
            torch.cuda.set_device(self.channel.device)  # this thread's current device, for NCCL's receives
        try:
            for k in range(min(self._ahead, len(incoming.edges))):
                incoming.posted.append(self._post_message(peer, k, incoming.edges[k]))
        except Exception as exc:
            self._stop(peer, incoming, exc)
            return
        self._take_next(peer, incoming)

    def _drain(self, peer: int, incoming: _Incoming) -> None:
        """After this rank's failure, on the receiving thread: takes what ``peer`` still sends off the wire, up to
        its abort (see [Note: abort messages])."""
        while not incoming.stopped and incoming.received < len(incoming.edges):
            self._take_next(peer, incoming)

    def _take_next(self, peer: int, incoming: _Incoming, keep: bool = False) -> Optional[Message]:
        """Waits for ``peer``'s next message and leaves it in the mailbox (with ``keep``, returns it instead);
        posts the receives of the message :data:`AHEAD` after it. After an abort or an error, leaves the failure
        in the mailbox instead (and returns None)."""
        k = incoming.received
        edge = incoming.edges[k]
        try:
            posted = incoming.posted.popleft()
            header, expected, guessed = posted.header, posted.expected, posted.tensors
            posted.work.wait()
            decoded = wire.decode(header)  # a packed message starts with its header
            if decoded.kind is wire.Kind.ABORT:
                _wait_all(guessed)
                for later in incoming.posted:  # aborts too, on their way
                    later.work.wait()
                    _wait_all(later.tensors)
                incoming.posted.clear()
                incoming.stopped = True
                self._put_failure(_PeerFailed(f"rank {peer} stopped its step", died=False))
                return None
            key = (peer, self.rank, edge)
            layout = decoded.layout
            if layout == expected:
                received = posted.views if self._packed else _wait_all(guessed)
            else:  # what came were fillers (see [Note: expected layouts])
                _wait_all(guessed)
                received = _wait_all(self._post_receives(peer, k, layout, self.devices[edge.target]))
            self.channel.layouts[key] = layout
            if decoded.kind is wire.Kind.NOT_STASHED:
                message = Message([], (), True)
            else:
                values = iter(received)
                tensors = [None if meta is None else next(values) for meta in decoded.tensors]
                message = Message(tensors, decoded.requires_grad, decoded.atomic)
            if not keep:
                self.mailbox.put(edge, message)
            incoming.received = k + 1
            # Only now the next message's receives: over NCCL nothing may be posted between this message's
            # fillers and its real tensors.
            if k + self._ahead < len(incoming.edges):
                incoming.posted.append(self._post_message(peer, k + self._ahead, incoming.edges[k + self._ahead]))
            return message if keep else None
        except Exception as exc:
            self._stop(peer, incoming, exc)
            return None
        except BaseException:  # KeyboardInterrupt on the stage's thread: where this peer's messages are is lost
            incoming.stopped = True
            raise

    def _stop(self, peer: int, incoming: _Incoming, error: Exception) -> None:
        """Nothing more is taken from ``peer`` after ``error``: leaves the failure in the mailbox."""
        incoming.stopped = True
        if isinstance(error, RuntimeError):
            what = incoming.edges[0].kind.value if incoming.edges else "messages"
            failure = _PeerFailed(
                f"rank {peer} died or closed its connection while rank {self.rank} waited for its {what}: {error}",
                died=True,
            )
        elif isinstance(error, ValueError):  # a header that is not one: the ranks run different schedules
            failure = _PeerFailed(f"rank {self.rank}, receiving from rank {peer}: {error}", died=True)
        else:  # a bug here: the step must still end, on every rank, and say why
            failure = _PeerFailed(
                f"rank {self.rank} failed to receive from rank {peer}: {type(error).__name__}: {error}", died=True
            )
        self._put_failure(failure)

    def _post_message(self, peer: int, k: int, edge: Edge) -> "_Posted":
        """Posts the receives of message ``k`` from ``peer``: its header's, and its tensors' of the layout the
        message had the last time it crossed (see [Note: expected layouts])."""
        expected = self.channel.layouts.get((peer, self.rank, edge), ())
        control = self._groups(peer, self.rank)[0]
        if self._packed:
            buffer = torch.empty(wire.packed_bytes(expected), dtype=torch.uint8)
            work = control.recv([buffer], peer, self._tag(k, 0))
            return _Posted(buffer, work, expected, [], wire.unpack(buffer, expected))
        header = torch.empty(wire.HEADER_LENGTH, dtype=torch.int64)
        header_work = control.recv([header], peer, self._tag(k, 0))
        tensors = self._post_receives(peer, k, expected, self.devices[edge.target])
        return _Posted(header, header_work, expected, tensors, [])

    def _post_receives(
        self, peer: int, k: int, layout: wire.Layout, device: torch.device
    ) -> List[Tuple[Tensor, Any]]:
        """Posts the receives of message ``k``'s tensors, of ``layout``; each buffer with its work."""
        posted = []
        data = self._groups(peer, self.rank)[1]
        for dtype, shape in layout:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            posted.append((tensor, data.recv([tensor], peer, self._tag(k, 1))))
        return posted

    def _put_failure(self, failure: _PeerFailed) -> None:
        if failure.died:  # news: record it now, so that ranks waiting in the store (not for messages) learn it too
            self.channel.fail(self.sequence, failure.message)

        def error() -> BaseException:
            self._aborted = True
            if failure.died:
                self.channel.fail(self.sequence, failure.message)
            return PipelineError(self.channel.failure(self.sequence) or failure.message)

        self.mailbox.fail(error)
