"""How a message's tensors travel: in the layout both ends remember, packed into one buffer over gloo.

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
"""
from typing import Any, Dict, List, Sequence, Tuple

from torch import Tensor

from torchpipe.distributed import wire
from torchpipe.runtime.transport import Edge

__all__ = ["Outbox", "KEPT_BYTES", "layout_of", "wait_all", "packed"]

#: The largest packed message whose buffer is kept for the same message of the next step (see [Note: packed
#: messages]): the small ones, whose cost is the allocation and the calls more than the copy. The buffers kept are
#: at most one step's messages of this size.
KEPT_BYTES = 1 << 17


def layout_of(tensors: Sequence[Tensor]) -> wire.Layout:
    """The dtype and shape of each tensor."""
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def wait_all(posted: List[Tuple[Tensor, Any]]) -> List[Tensor]:
    """The buffers of ``posted`` receives (buffer, work), once they are all received."""
    for _, work in posted:
        work.wait()
    return [tensor for tensor, _ in posted]


class Outbox:
    """A packed message's buffer, with its header and views of its tensors' places, and the send that last
    read it."""

    __slots__ = ("buffer", "header", "views", "work")

    def __init__(self, buffer: Tensor, header: Tensor, views: List[Tensor]) -> None:
        self.buffer = buffer
        self.header = header
        self.views = views
        self.work: Any = None


def packed(
    boxes: Dict[Tuple[int, Edge], Outbox], peer: int, edge: Edge, header: Tensor, tensors: List[Tensor],
    layout: wire.Layout,
) -> Outbox:
    """The packed buffer of ``edge``'s message to ``peer`` (see [Note: packed messages]): the last step's from
    ``boxes``, refilled, where it had the same header and its send is over; else a new one, kept in ``boxes``
    for the next step if it is small."""
    box = boxes.get((peer, edge))
    # The header is wire.encode's, one object per header: the same object, the same layout.
    if box is not None and box.header is header and box.work is not None and box.work.is_completed():
        for view, tensor in zip(box.views, tensors):
            view.copy_(tensor)
        return box
    buffer = wire.pack(header, tensors, layout)
    box = Outbox(buffer, header, wire.unpack(buffer, layout))
    if buffer.numel() <= KEPT_BYTES:
        boxes[(peer, edge)] = box
    else:
        boxes.pop((peer, edge), None)
    return box
