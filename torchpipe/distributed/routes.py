"""Which messages a rank sends and receives in a step, in which order, under which tags and through which groups.

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
order, as NCCL needs. Who takes each message off the wire: [Note: receiving
threads] in ``receiving.py``.

Posting ahead is what makes a message cheap: gloo moves a message only once
its receive is posted, so a receive posted after its send costs the pair
another trip between the ranks. The window is fixed, so the buffers
allocated ahead stay few whatever the number of micro-batches (at most
:data:`AHEAD` messages' tensors per peer).

[Note: a group for each direction] A pair of ranks sends messages both
ways (activations to the next stage, gradients back). The messages to a
higher rank go through the channel's ``up`` groups (``control`` and
``data``), those to a lower rank through ``down``, a gloo group of their own
(CUDA tensors through the one NCCL group, in order, either way). In one
group the two directions would share one connection, one lock of gloo's pair
and one gloo thread in each process, which takes the arriving messages and
the notices of the peer's posted receives: the last stage's gradient sends
would wait for the pair's lock behind the activations coming in. A group for
each direction costs a second gloo group per pipeline (its connections, made
as the pipeline is, and its thread).
"""
from typing import Any, Dict, List, Mapping, NamedTuple, Tuple

from torchpipe.distributed.channel import Channel
from torchpipe.runtime.transport import Edge
from torchpipe.schedule import Action, Schedule

__all__ = ["AHEAD", "Routes", "message_orders", "routes_of", "tag", "groups"]

#: How many messages a rank keeps its receives posted for, per peer: the one it waits for and those after
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


class Routes(NamedTuple):
    """A schedule's messages as one rank sees them (see [Note: message order]): per peer it sends to, the
    messages in order and each one's position; per peer it receives from, the same."""

    outgoing: Dict[int, List[Edge]]
    sent_at: Dict[int, Dict[Edge, int]]
    incoming: Dict[int, Tuple[List[Edge], Dict[Edge, int]]]


def routes_of(rank: int, schedule: Schedule, sends: Mapping[Action, Tuple[Edge, ...]]) -> Routes:
    """``schedule``'s routes on ``rank``."""
    orders = message_orders(schedule, sends)
    outgoing = {peer: edges for (source, peer), edges in orders.items() if source == rank}
    incoming = {peer: edges for (peer, target), edges in orders.items() if target == rank}
    return Routes(
        outgoing,
        {peer: {edge: k for k, edge in enumerate(edges)} for peer, edges in outgoing.items()},
        {peer: (edges, {edge: k for k, edge in enumerate(edges)}) for peer, edges in incoming.items()},
    )


def tag(sequence: int, k: int, part: int) -> int:
    """The tag of part ``part`` (0: the header, 1: the tensors) of message ``k`` of a pair in step
    ``sequence`` (steps far enough apart share tags)."""
    return (sequence % 512) * _TAGS_PER_STEP * 2 + 2 * k + part


def groups(channel: Channel, source: int, target: int) -> Tuple[Any, Any]:
    """The process groups (for the header, for the tensors) of a message from rank ``source`` to rank
    ``target``: one pair of groups for each direction (see [Note: a group for each direction])."""
    return channel.up if source < target else channel.down
