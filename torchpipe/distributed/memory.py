"""What a rank's transport remembers of its pipeline from step to step: layouts, outboxes, routes, threads."""
import threading
import weakref
from typing import Dict, Mapping, Tuple

from torchpipe.distributed import wire
from torchpipe.distributed.channel import Channel
from torchpipe.distributed.packing import Outbox
from torchpipe.distributed.receiving import ReceivingThreads
from torchpipe.distributed.routes import Routes, routes_of
from torchpipe.runtime.transport import Edge
from torchpipe.schedule import Action, Schedule

__all__ = ["TransportMemory", "memory_of"]


class TransportMemory:
    """The transport's memory of one pipeline on one rank, kept as long as its channel."""

    def __init__(self, rank: int) -> None:
        #: The layout of each message the last time it crossed, by (source rank, target rank, edge) (see
        #: [Note: expected layouts]).
        self.layouts: Dict[Tuple[int, int, Edge], wire.Layout] = {}
        #: The packed buffer of each small message this rank sends, by (target rank, edge), refilled step after
        #: step (see [Note: packed messages]).
        self.outboxes: Dict[Tuple[int, Edge], Outbox] = {}
        #: The receiving thread of each peer (see [Note: receiving threads]).
        self.receiving = ReceivingThreads(rank)
        self._rank = rank
        self._routes: Dict[int, Tuple[Schedule, Routes]] = {}

    def routes(self, schedule: Schedule, sends: Mapping[Action, Tuple[Edge, ...]]) -> Routes:
        """``schedule``'s routes on this rank, made once per schedule (every step of a shape has the same)."""
        cached = self._routes.get(id(schedule))
        if cached is not None and cached[0] is schedule:
            return cached[1]
        routes = routes_of(self._rank, schedule, sends)
        if len(self._routes) >= 16:  # schedules a tuner replaced, or shapes not seen for long
            self._routes.clear()
        self._routes[id(schedule)] = (schedule, routes)  # the schedule kept: its id is not reused meanwhile
        return routes


_memories: "weakref.WeakKeyDictionary[Channel, TransportMemory]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def memory_of(channel: Channel) -> TransportMemory:
    """``channel``'s transport memory (its receiving threads end when the channel goes)."""
    with _lock:
        memory = _memories.get(channel)
        if memory is None:
            memory = _memories[channel] = TransportMemory(channel.rank)
            weakref.finalize(channel, memory.receiving.close)
        return memory
