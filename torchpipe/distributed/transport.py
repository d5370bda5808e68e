"""The transport of one step between the ranks of a multi-process pipeline: point-to-point over c10d.

One :class:`DistributedTransport` per step and rank speaks the protocol the
notes of its neighbours define: which messages cross, in which order, under
which tags and through which groups ([Note: message order], [Note: a group
for each direction] in ``routes.py``), in which layout and packed how
([Note: expected layouts], [Note: packed messages] in ``packing.py``), who
takes them off the wire ([Note: receiving threads] in ``receiving.py``), and
how a failure ends the step on every rank ([Note: abort messages] in
``failure.py``). What it remembers between steps is its channel's
:class:`~torchpipe.distributed.memory.TransportMemory`.
"""
import collections
import datetime
import functools
import threading
import time
from typing import Any, Deque, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, cast

import torch
from torch import Tensor

from torchpipe import trace
from torchpipe.distributed import dtensors, wire
from torchpipe.distributed.channel import BUSY_POLL_SECONDS, POLL_SECONDS, Channel, PipelineError
from torchpipe.distributed.failure import PeerFailed, aborts_owed, peer_failure
from torchpipe.distributed.memory import memory_of
from torchpipe.distributed.packing import layout_of, packed, wait_all
from torchpipe.distributed.receiving import ReceivingThread
from torchpipe.distributed.routes import AHEAD, groups, message_orders, tag
from torchpipe.runtime.release import releasable, release, storage
from torchpipe.runtime.transport import Edge, EdgeKind, Mailbox, Message
from torchpipe.schedule import Action, Schedule

__all__ = ["DistributedTransport", "message_orders", "AHEAD"]


class _Posted(NamedTuple):
    """A message's receives as posted: the header's buffer (a packed message's whole buffer) and its work, the
    layout guessed, the tensors' buffers and works (unpacked), or the guessed tensors on the buffer's memory
    (packed: made as the receive is posted, off the way of the stage that takes the message)."""

    header: Tensor
    work: Any
    expected: wire.Layout
    tensors: List[Tuple[Tensor, Any]]
    views: List[Tensor]


class _Incoming:
    """What one peer sends this rank in a step, as it comes off the wire, in order (see [Note: message
    order]): the receives posted, and how many messages have been received."""

    #: Set once the receiving thread has taken the first message (or failed to): its job's end.
    first: threading.Event

    def __init__(self, edges: List[Edge], index: Dict[Edge, int], thread: ReceivingThread) -> None:
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
        self.memory = memory = memory_of(channel)
        #: Per message received whose layout was not the expected one, the seconds from its header to its
        #: tensors (its relayout: [Note: expected layouts]), appended by whichever thread took it (the receiving
        #: threads start below).
        self.relayouts: List[float] = []
        routes = memory.routes(schedule, sends)
        #: Per peer, what this rank sends it, in order, and how many of them it has sent.
        self._outgoing = routes.outgoing
        self._index = routes.sent_at
        self._sent = {peer: 0 for peer in self._outgoing}
        #: Sends in flight: the peer, the works, and the tensors they read (kept alive until they end).
        self._pending: List[Tuple[int, List[Any], List[Tensor]]] = []
        #: Outputs to free once the sends that read them (as they are, not a copy) are over.
        self._releases: List[Tuple[List[Any], List[Tensor]]] = []
        #: Whether messages travel packed (see [Note: packed messages]): where tensors and headers share gloo,
        #: which is also where receives may be posted AHEAD (over NCCL, one). The same on every rank.
        self._packed = channel.device.type != "cuda"
        self._ahead = AHEAD if self._packed else 1
        #: Per peer that sends this rank messages, what it sends; its receiving thread takes the first.
        self._incoming: Dict[int, _Incoming] = {}
        for peer, (edges, index) in routes.incoming.items():
            incoming = self._incoming[peer] = _Incoming(edges, index, memory.receiving.of(peer))
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
        # A DTensor crosses as its local shard, its placements in the header (see distributed/dtensors.py).
        parts = [(None, None) if t is None else dtensors.split(t.detach() if t.requires_grad else t)
                 for t in message.tensors]
        tensors = [None if t is None else t.contiguous() for t, _ in parts]
        if edge.kind is EdgeKind.SKIP and not message.tensors:
            header = wire.encode(wire.Kind.NOT_STASHED)
        else:
            header = wire.encode(wire.Kind.DATA, tensors, message.requires_grad, message.atomic,
                                 [sharding for _, sharding in parts])
        present = [t for t in tensors if t is not None]
        layout = layout_of(present)
        key = (self.rank, peer, edge)
        with trace.span("copy", edge.source, edge.microbatch) if present else trace.NOTHING:
            try:
                works, kept = self._post_send(
                    peer, k, header, self.memory.layouts.get(key, ()), layout, present, self.devices[edge.source],
                    edge,
                )
            except RuntimeError as exc:
                self._peer_died(peer, f"sent its {edge}", exc)
        self.memory.layouts[key] = layout
        self._sweep()
        self._pending.append((peer, works, kept))

    def release(self, edge: Edge, outputs: Sequence[Tensor], others: Sequence[Tensor]) -> None:
        """Frees what nothing reads again of the outputs just sent on ``edge`` (see [Note: released outputs]):
        at once where the message was a copy of them (packed), else once the sends that read them are over."""
        if self.stage_workers[edge.target] == self.rank:
            return  # the mailbox holds the outputs themselves
        freed = releasable(outputs, others)
        if not freed:
            return
        peer, works, kept = self._pending[-1]
        read = {storage(t) for t in kept}
        if any(storage(t) in read for t in freed):
            self._releases.append((works, freed))  # sent as they are: freed by _sweep
        else:
            release(freed)

    def _sweep(self) -> None:
        """Lets go of the sends that are over (their messages' buffers) and frees the outputs they read."""
        if self._releases:
            waiting: List[Tuple[List[Any], List[Tensor]]] = []
            for works, freed in self._releases:
                if all(w.is_completed() for w in works):
                    release(freed)
                else:
                    waiting.append((works, freed))
            self._releases = waiting
        over: List[Tuple[int, List[Any], List[Tensor]]] = []
        pending: List[Tuple[int, List[Any], List[Tensor]]] = []
        for entry in self._pending:
            (over if all(w.is_completed() for w in entry[1]) else pending).append(entry)
        if not over:
            return
        self._pending = pending
        for peer, works, _ in over:
            for work in works:
                try:
                    work.wait()  # over: raises only if it failed
                except RuntimeError as exc:
                    self._peer_died(peer, "sent a message", exc)

    def _post_send(
        self, peer: int, k: int, header: Tensor, expected: wire.Layout, layout: wire.Layout, tensors: List[Tensor],
        device: torch.device, edge: Optional[Edge] = None,
    ) -> Tuple[List[Any], List[Tensor]]:
        """Sends message ``k``'s header and tensors to ``peer`` (see [Note: expected layouts]); the works, and
        the tensors to keep alive until they end."""
        control, data = groups(self.channel, self.rank, peer)
        if self._packed:  # one buffer: the header, then the tensors (see [Note: packed messages])
            if layout == expected and edge is not None:
                box = packed(self.memory.outboxes, peer, edge, header, tensors, layout)
                sent = [box.buffer]
            else:
                box = None
                sent = [wire.pack(header, None, expected)]
            works = [control.send(sent, peer, tag(self.sequence, k, 0))]
            if box is not None:
                box.work = works[0]
            if layout != expected:
                sent += tensors
                works += [data.send([tensor], peer, tag(self.sequence, k, 1)) for tensor in tensors]
            return works, sent
        sent = [header]
        works = [control.send([header], peer, tag(self.sequence, k, 0))]
        if layout != expected:  # the peer posted receives of the old layout: fill them first
            sent += [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in expected]
        sent += tensors
        for tensor in sent[1:]:
            works.append(data.send([tensor], peer, tag(self.sequence, k, 1)))
        return works, sent

    def _peer_died(self, peer: int, doing: str, error: BaseException) -> None:
        """Records that ``peer``'s connection failed and raises :class:`PipelineError`."""
        message = f"rank {peer} died or closed its connection while rank {self.rank} {doing}: {error}"
        self.channel.fail(self.sequence, message)
        self._aborted = True
        raise PipelineError(self.channel.failure(self.sequence) or message)

    def recv(self, edge: Edge) -> Message:
        peer = self.stage_workers[edge.source]
        incoming = self._incoming.get(peer)  # None: a message between this rank's own stages
        self._sweep()  # what was sent before this wait and is over: freed before the message's tensors come
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
        for _, freed in self._releases:
            release(freed)
        self._releases.clear()
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
            for j in aborts_owed(k, len(edges), self._ahead):
                edge = edges[j]
                expected = self.memory.layouts.get((self.rank, peer, edge), ())
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

    @property
    def most_posted(self) -> int:
        """The most bytes the receives posted ahead hold at once in a step of these messages once their layouts
        are known (see [Note: held bytes]): per peer, the largest run of messages posted while the one before
        them is taken (:data:`AHEAD` over gloo, one over NCCL), summed over the peers; each message as its
        last layout packs (its header and tensors, to alignment)."""
        most = 0
        for peer, incoming in self._incoming.items():
            sizes = [wire.packed_bytes(self.memory.layouts.get((peer, self.rank, edge), ())) for edge in incoming.edges]
            window = min(self._ahead, len(sizes))
            most += max((sum(sizes[k:k + window]) for k in range(len(sizes) - window + 1)), default=0)
        return most

    # --- receiving ---------------------------------------------------------------------------------------

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
                wait_all(guessed)
                for later in incoming.posted:  # aborts too, on their way
                    later.work.wait()
                    wait_all(later.tensors)
                incoming.posted.clear()
                incoming.stopped = True
                self._put_failure(PeerFailed(f"rank {peer} stopped its step", died=False))
                return None
            key = (peer, self.rank, edge)
            layout = decoded.layout
            if layout == expected:
                received = posted.views if self._packed else wait_all(guessed)
            else:  # what came were fillers (see [Note: expected layouts])
                header_came = time.perf_counter()
                wait_all(guessed)
                received = wait_all(self._post_receives(peer, k, layout, self.devices[edge.target]))
                self.relayouts.append(time.perf_counter() - header_came)
            self.memory.layouts[key] = layout
            if decoded.kind is wire.Kind.NOT_STASHED:
                message = Message([], (), True)
            else:
                values = iter(received)
                tensors = [None if meta is None else next(values) for meta in decoded.tensors]
                for j, sharding in enumerate(decoded.shardings):
                    if sharding is not None:
                        tensors[j] = dtensors.rebuild(cast(Tensor, tensors[j]), sharding, self.channel.tp_mesh)
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
        what = incoming.edges[0].kind.value if incoming.edges else "messages"
        self._put_failure(peer_failure(self.rank, peer, what, error))

    def _post_message(self, peer: int, k: int, edge: Edge) -> "_Posted":
        """Posts the receives of message ``k`` from ``peer``: its header's, and its tensors' of the layout the
        message had the last time it crossed (see [Note: expected layouts])."""
        expected = self.memory.layouts.get((peer, self.rank, edge), ())
        control = groups(self.channel, peer, self.rank)[0]
        if self._packed:
            buffer = torch.empty(wire.packed_bytes(expected), dtype=torch.uint8)
            work = control.recv([buffer], peer, tag(self.sequence, k, 0))
            return _Posted(buffer, work, expected, [], wire.unpack(buffer, expected))
        header = torch.empty(wire.HEADER_LENGTH, dtype=torch.int64)
        header_work = control.recv([header], peer, tag(self.sequence, k, 0))
        tensors = self._post_receives(peer, k, expected, self.devices[edge.target])
        return _Posted(header, header_work, expected, tensors, [])

    def _post_receives(
        self, peer: int, k: int, layout: wire.Layout, device: torch.device
    ) -> List[Tuple[Tensor, Any]]:
        """Posts the receives of message ``k``'s tensors, of ``layout``; each buffer with its work."""
        posted = []
        data = groups(self.channel, peer, self.rank)[1]
        for dtype, shape in layout:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            posted.append((tensor, data.recv([tensor], peer, tag(self.sequence, k, 1))))
        return posted

    def _put_failure(self, failure: PeerFailed) -> None:
        if failure.died:  # news: record it now, so that ranks waiting in the store (not for messages) learn it too
            self.channel.fail(self.sequence, failure.message)

        def error() -> BaseException:
            self._aborted = True
            if failure.died:
                self.channel.fail(self.sequence, failure.message)
            return PipelineError(self.channel.failure(self.sequence) or failure.message)

        self.mailbox.fail(error)
