"""The transport of one step between the ranks of a multi-process pipeline: point-to-point over c10d.

[Note: message order] Every rank knows the whole schedule, so it knows which
messages each other rank will send it in a step, and in which order: a rank
sends, action by action down its list, a forward's skips (in the layout's
order) then its activation, and a backward's skip gradients then its input
gradient. For each peer a receiving thread posts, ahead of need, the
receives of exactly those messages in exactly that order (a header, then the
tensors it announces), and leaves each message in the step's mailbox, where
the stage's action takes it. Each message has tags of its own (its position
in the pair's order), and both sides issue a pair's operations in the same
order, as NCCL needs.

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

[Note: abort messages] When a rank's step fails (or it learns from the store
that another rank's did), it sends each peer, in place of the next message it
owed it, a header that says "abort" (with tensors of that message's
remembered layout, which the peer posted receives for). The peer's receiving
thread, waiting for exactly that message, ends; everything sent before was received. So after a
failure seen by every rank no receive is left pending, and the pipeline's
process groups are as good as new for the next step. Only a rank that died
leaves its connections closed: its peers' receives fail at once (that is how
its death is noticed), and the job has to be restarted.
"""
import datetime
import threading
import time
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from torchpipe import trace
from torchpipe.distributed import wire
from torchpipe.distributed.channel import POLL_SECONDS, Channel, PipelineError
from torchpipe.runtime.transport import Edge, EdgeKind, Mailbox, Message, sends
from torchpipe.schedule import Schedule
from torchpipe.skip.layout import SkipLayout

__all__ = ["DistributedTransport", "message_orders"]

#: Tags: a step's messages between a pair are numbered from 0; each takes two tags (header, tensors).
_TAGS_PER_STEP = 1 << 20  # x2 tags per message, x512 steps: below 2**31


def message_orders(schedule: Schedule, layout: SkipLayout) -> Dict[Tuple[int, int], List[Edge]]:
    """For each (sending worker, receiving worker) pair of different workers, its messages in order."""
    orders: Dict[Tuple[int, int], List[Edge]] = {}
    for w, actions in enumerate(schedule.workers):
        for action in actions:
            for edge in sends(action, schedule.stages, layout):
                target = schedule.stage_workers[edge.target]
                if target != w:
                    orders.setdefault((w, target), []).append(edge)
    return orders


#: A message's layout: the dtype and shape of each tensor it carries (absent ones left out).
_Layout = Tuple[Tuple[torch.dtype, Tuple[int, ...]], ...]


def _layout(tensors: Sequence[Tensor]) -> _Layout:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def _wait_all(posted: List[Tuple[Tensor, Any]]) -> List[Tensor]:
    """The buffers of ``posted`` receives, once they are all received."""
    for _, work in posted:
        work.wait()
    return [tensor for tensor, _ in posted]


class _PeerFailed:
    """Left in the mailbox by a receiving thread whose peer failed or died (``died``: the failure is news, to
    record in the store; else the peer recorded it)."""

    def __init__(self, message: str, died: bool) -> None:
        self.message = message
        self.died = died


class DistributedTransport:
    """The messages of one step on this rank: local ones through a mailbox, the others over c10d.

    Args:
        channel: this rank's channel (process groups, store).
        sequence: the step's number (the same on every rank).
        schedule: the step's whole schedule.
        layout: the skip layout.
        devices: the device of each stage this rank runs (others: unused).
    """

    def __init__(
        self, channel: Channel, sequence: int, schedule: Schedule, layout: SkipLayout, devices: Sequence[torch.device]
    ) -> None:
        self.channel = channel
        self.sequence = sequence
        self.stage_workers = schedule.stage_workers
        self.devices = list(devices)
        self.rank = channel.rank
        self.mailbox = Mailbox()
        self._aborted = False
        self._failed = False
        orders = message_orders(schedule, layout)
        base = (sequence % 512) * _TAGS_PER_STEP * 2
        self._base = base
        #: Per peer, what this rank sends it, in order, and how many of them it has sent.
        self._outgoing = {peer: edges for (source, peer), edges in orders.items() if source == self.rank}
        self._index = {peer: {edge: k for k, edge in enumerate(edges)} for peer, edges in self._outgoing.items()}
        self._sent = {peer: 0 for peer in self._outgoing}
        #: Sends in flight: the peer, the works, and the tensors they read (kept alive until they end).
        self._pending: List[Tuple[int, List[Any], List[Tensor]]] = []
        self._threads = [
            threading.Thread(
                target=self._receive, args=(peer, edges), name=f"torchpipe-recv-{peer}-to-{self.rank}", daemon=True
            )
            for (peer, target), edges in orders.items()
            if target == self.rank
        ]
        for thread in self._threads:
            thread.start()
        self._last_poll = 0.0

    # --- the Transport protocol --------------------------------------------------------------------------

    @property
    def aborted(self) -> bool:
        if self._aborted or self.mailbox.aborted:
            return True
        self._poll_failure()
        return self._aborted

    def _poll_failure(self) -> None:
        """Looks in the store for another rank's failure, at most every ``POLL_SECONDS`` (a look costs a round
        trip to the store, too much for every action or message)."""
        now = time.monotonic()
        if now - self._last_poll >= POLL_SECONDS:
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
        tensors = [None if t is None else t.detach().contiguous() for t in message.tensors]
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
                    peer, k, header, self.channel.layouts.get(key, ()), layout, present, self.devices[edge.source]
                )
            except RuntimeError as exc:
                self._peer_died(peer, f"sent its {edge}", exc)
        self.channel.layouts[key] = layout
        self._pending.append((peer, works, kept))

    def _post_send(
        self, peer: int, k: int, header: Tensor, expected: "_Layout", layout: "_Layout", tensors: List[Tensor],
        device: torch.device,
    ) -> Tuple[List[Any], List[Tensor]]:
        """Sends message ``k``'s header and tensors to ``peer`` (see [Note: expected layouts]); the works, and
        the tensors to keep alive until they end."""
        sent = [header]
        works = [self.channel.control.send([header], peer, self._tag(k, 0))]
        if layout != expected:  # the peer posted receives of the old layout: fill them first
            sent += [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in expected]
        sent += tensors
        for tensor in sent[1:]:
            works.append(self.channel.data.send([tensor], peer, self._tag(k, 1)))
        return works, sent

    def _peer_died(self, peer: int, doing: str, error: BaseException) -> None:
        """Records that ``peer``'s connection failed and raises :class:`PipelineError`."""
        message = f"rank {peer} died or closed its connection while rank {self.rank} {doing}: {error}"
        self.channel.fail(self.sequence, message)
        self._aborted = True
        raise PipelineError(self.channel.failure(self.sequence) or message)

    def recv(self, edge: Edge) -> Message:
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
        for thread in self._threads:
            thread.join()

    def fail(self) -> None:
        """After a failure: tells each peer not to wait for what it still expects (see [Note: abort messages]),
        and lets the receiving threads end."""
        if self._failed:
            return
        self._failed = True
        self.abort()
        for peer, edges in self._outgoing.items():
            k = self._sent[peer]
            if k < len(edges):
                self._sent[peer] = len(edges)
                edge = edges[k]
                expected = self.channel.layouts.get((self.rank, peer, edge), ())
                try:
                    works, kept = self._post_send(
                        peer, k, wire.encode(wire.Kind.ABORT), expected, (), [], self.devices[edge.source]
                    )
                    self._pending.append((peer, works, kept))
                except RuntimeError:  # the peer died: it expects nothing any more
                    pass
        deadline = time.monotonic() + 10.0
        for _, works, _ in self._pending:
            for work in works:
                # A send completes when the peer receives it. A peer that failed before it made its transport
                # (it disagreed on the step's mode, say) never will: give up on it after a while.
                try:
                    work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
                except RuntimeError:  # a dead peer, or the time is up
                    pass
        self._pending.clear()
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # --- receiving ---------------------------------------------------------------------------------------

    def _tag(self, k: int, part: int) -> int:
        return self._base + 2 * k + part

    def _receive(self, peer: int, edges: List[Edge]) -> None:
        """The receiving thread for ``peer``: posts its messages' receives in order (see [Note: message order])."""
        if self.devices and self.devices[0].type == "cuda":
            torch.cuda.set_device(self.devices[0])  # this thread's current device, for NCCL's receives
        try:
            for k, edge in enumerate(edges):
                key = (peer, self.rank, edge)
                device = self.devices[edge.target]
                header = torch.empty(wire.HEADER_LENGTH, dtype=torch.int64)
                header_work = self.channel.control.recv([header], peer, self._tag(k, 0))
                expected = self.channel.layouts.get(key, ())
                guessed = self._post_receives(peer, k, expected, device)
                header_work.wait()
                decoded = wire.decode(header)
                present = [(dtype, shape) for dtype, _, shape in filter(None, decoded.tensors)]
                layout = tuple(present) if decoded.kind is not wire.Kind.ABORT else expected
                received = _wait_all(guessed)
                if layout != expected:  # what came were fillers (see [Note: expected layouts])
                    received = _wait_all(self._post_receives(peer, k, layout, device))
                if decoded.kind is wire.Kind.ABORT:
                    self._put_failure(_PeerFailed(f"rank {peer} stopped its step", died=False))
                    return
                self.channel.layouts[key] = layout
                if decoded.kind is wire.Kind.NOT_STASHED:
                    self.mailbox.put(edge, Message([], (), True))
                    continue
                values = iter(received)
                tensors = [None if meta is None else next(values) for meta in decoded.tensors]
                flags = tuple(meta is not None and meta[1] for meta in decoded.tensors)
                self.mailbox.put(edge, Message(tensors, flags, decoded.atomic))
        except RuntimeError as exc:
            self._put_failure(_PeerFailed(
                f"rank {peer} died or closed its connection while rank {self.rank} waited for its "
                f"{edges[0].kind.value if edges else 'messages'}: {exc}", died=True,
            ))
        except ValueError as exc:  # a header that is not one: the ranks run different schedules
            self._put_failure(_PeerFailed(f"rank {self.rank}, receiving from rank {peer}: {exc}", died=True))

    def _post_receives(
        self, peer: int, k: int, layout: "_Layout", device: torch.device
    ) -> List[Tuple[Tensor, Any]]:
        """Posts the receives of message ``k``'s tensors, of ``layout``; each buffer with its work."""
        posted = []
        for dtype, shape in layout:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            posted.append((tensor, self.channel.data.recv([tensor], peer, self._tag(k, 1))))
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
