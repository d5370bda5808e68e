"""CUDA streams and events, with a null CPU stand-in so one code path serves both.

[Note: streams] On CUDA each partition computes on its device's current stream
and tensors cross between partitions on dedicated copy streams; the consumer
waits on an event recorded after the copy, and a tensor used on a stream other
than the one that allocated it is ``record_stream``-ed so the caching allocator
does not hand its memory out early. On CPU every helper here is a no-op, so the
pipeline runs the same code with :data:`CPU_STREAM` and :data:`CPU_EVENT`.
"""
import contextlib
from typing import Any, ContextManager, Optional, Union

import torch

from torchpipe.types import Device

__all__ = [
    "AbstractStream",
    "AbstractEvent",
    "CPU_STREAM",
    "CPU_EVENT",
    "as_device",
    "new_stream",
    "current_stream",
    "use_stream",
    "use_device",
    "record_event",
    "wait_event",
    "wait_stream",
    "record_stream",
    "is_cuda",
]


class CPUStreamType:
    """The stream of a CPU device: work on it is already ordered, so it has nothing to wait for."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "CPU_STREAM"


class CPUEventType:
    """An event on :data:`CPU_STREAM`: always complete."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "CPU_EVENT"


CPU_STREAM = CPUStreamType()
CPU_EVENT = CPUEventType()

AbstractStream = Union[torch.cuda.Stream, CPUStreamType]
AbstractEvent = Union[torch.cuda.Event, CPUEventType]


def as_device(device: Device) -> torch.device:
    """Normalises ``0``, ``'cuda'``, ``'cpu'`` or a ``torch.device`` to a ``torch.device``.

    A bare ``'cuda'`` becomes ``cuda:<current>`` so that equal devices compare equal.
    """
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def is_cuda(stream: AbstractStream) -> bool:
    """Whether ``stream`` is a real CUDA stream."""
    return not isinstance(stream, CPUStreamType)


def new_stream(device: torch.device) -> AbstractStream:
    """A new stream on ``device`` (:data:`CPU_STREAM` for a CPU device)."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def current_stream(device: torch.device) -> AbstractStream:
    """The stream that work on ``device`` is currently queued on."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.current_stream(device)


def use_device(device: torch.device) -> ContextManager[Any]:
    """Makes ``device`` current for CUDA; does nothing for other devices (a do-nothing context manager: every
    action of a pipeline enters one, so no generator is made for it)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def use_stream(stream: AbstractStream) -> ContextManager[Any]:
    """Queues CUDA work issued in the block on ``stream``; does nothing on CPU (as :func:`use_device`)."""
    if not isinstance(stream, torch.cuda.Stream):
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)


def record_event(stream: AbstractStream) -> AbstractEvent:
    """An event marking everything queued on ``stream`` so far."""
    if not isinstance(stream, torch.cuda.Stream):
        return CPU_EVENT
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


def wait_event(stream: AbstractStream, event: Optional[AbstractEvent]) -> None:
    """Makes future work on ``stream`` wait for ``event``."""
    if isinstance(stream, torch.cuda.Stream) and isinstance(event, torch.cuda.Event):
        stream.wait_event(event)


def wait_stream(waiter: AbstractStream, source: AbstractStream) -> None:
    """Makes future work on ``waiter`` wait for everything queued on ``source`` so far."""
    if isinstance(waiter, torch.cuda.Stream) and isinstance(source, torch.cuda.Stream):
        if waiter != source:
            waiter.wait_stream(source)


def record_stream(tensor: torch.Tensor, stream: AbstractStream) -> None:
    """Tells the caching allocator that ``tensor`` is in use on ``stream`` too."""
    if isinstance(stream, torch.cuda.Stream) and tensor.is_cuda:
        tensor.record_stream(stream)
