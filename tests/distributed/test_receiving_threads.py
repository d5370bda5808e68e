"""A pipeline's receiving threads: one per peer, kept from step to step (see DistributedTransport)."""
import gc
import threading
import time
from typing import Any, List

from torchpipe.distributed.memory import memory_of


class _Channel:
    """What the receiving threads need of a channel: its rank (a made-up one, so thread names are this test's)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank


def _alive(name: str) -> List[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def _until(condition: Any, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_channel_keeps_one_receiving_thread_per_peer_from_step_to_step() -> None:
    channel = _Channel(1001)
    first = memory_of(channel).receiving.of(1)  # type: ignore[arg-type]
    ran: List[str] = []
    assert first.start(lambda: ran.append("step 1")).wait(5)
    again = memory_of(channel).receiving.of(1)  # type: ignore[arg-type]
    assert again is first
    assert again.start(lambda: ran.append("step 2")).wait(5)
    assert ran == ["step 1", "step 2"]
    assert memory_of(channel).receiving.of(2) is not first  # type: ignore[arg-type]
    assert len(_alive("torchpipe-recv-1-to-1001")) == 1


def test_a_thread_still_busy_with_an_earlier_step_is_replaced_and_then_ends() -> None:
    # After a failed step a receive may stay unanswered (a peer that failed before it sent anything): the next
    # step must not queue behind it.
    channel = _Channel(1002)
    gate = threading.Event()
    stuck = memory_of(channel).receiving.of(1)  # type: ignore[arg-type]
    ended = stuck.start(lambda: None if gate.wait() else None)
    fresh = memory_of(channel).receiving.of(1)  # type: ignore[arg-type]
    assert fresh is not stuck
    assert fresh.start(lambda: None).wait(5)
    assert len(_alive("torchpipe-recv-1-to-1002")) == 2
    gate.set()
    assert ended.wait(5)
    assert _until(lambda: len(_alive("torchpipe-recv-1-to-1002")) == 1)


def test_the_threads_end_when_their_channel_is_gone() -> None:
    channel = _Channel(1003)
    for peer in (0, 1):
        assert memory_of(channel).receiving.of(peer).start(lambda: None).wait(5)  # type: ignore[arg-type]
    del channel
    gc.collect()
    assert _until(lambda: not _alive("torchpipe-recv-0-to-1003") and not _alive("torchpipe-recv-1-to-1003"))
