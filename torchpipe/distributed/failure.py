"""How a step's failure travels between ranks: records in the store, abort messages on the wire.

[Note: abort messages] When a rank's step fails (or it learns from the store
that another rank's did), it sends each peer, in place of the messages it
still owed it, as many headers that say "abort" as the peer has posted
receives for (:data:`~torchpipe.distributed.routes.AHEAD`, or fewer at the
end of the step), each with tensors of its message's remembered layout. The
peer, at the first abort (on its stage's thread or its receiving thread),
takes the others (they are on their way) and receives nothing more from it;
everything sent before was received. So after a failure seen by every rank
no receive is left pending, and the pipeline's process groups are as good as
new for the next step. Only a rank that died (or a receive that met an
error it does not expect, a bug) leaves its pairs out of step: the peers'
receives fail at once, or the step fails naming the error, and the job has
to be restarted.

A failure's record in the store (see [Note: control plane] in
``channel.py``) names the rank, the action and the error (:func:`error_text`);
the first record of a step stands. A rank whose own action failed raises its
error; every other rank a :class:`~torchpipe.distributed.channel.PipelineError`
with the record.
"""
from typing import List

__all__ = ["PeerFailed", "peer_failure", "error_text", "aborts_owed"]


def error_text(error: BaseException) -> str:
    """An error as a failure's record names it: its type, then its message if it has one (a KeyboardInterrupt
    has none)."""
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


class PeerFailed:
    """Left in the mailbox by a receiving thread whose peer failed or died (``died``: the failure is news, to
    record in the store; else the peer recorded it)."""

    def __init__(self, message: str, died: bool) -> None:
        self.message = message
        self.died = died


def peer_failure(rank: int, peer: int, what: str, error: Exception) -> PeerFailed:
    """What this ``rank`` records when receiving ``what`` from ``peer`` met ``error``."""
    if isinstance(error, RuntimeError):
        return PeerFailed(f"rank {peer} died or closed its connection while rank {rank} waited for its {what}: "
                          f"{error}", died=True)
    if isinstance(error, ValueError):  # a header that is not one: the ranks run different schedules
        return PeerFailed(f"rank {rank}, receiving from rank {peer}: {error}", died=True)
    # A bug here: the step must still end, on every rank, and say why.
    return PeerFailed(f"rank {rank} failed to receive from rank {peer}: {error_text(error)}", died=True)


def aborts_owed(sent: int, count: int, ahead: int) -> List[int]:
    """The messages a failed rank answers with aborts: the peer posted the receives of messages ``sent`` to
    ``sent + ahead - 1`` (of ``count``)."""
    return list(range(sent, min(sent + ahead, count)))
