"""State dicts across processes: every rank's layers, gathered on the first stage's rank with the plain keys."""
import io
from typing import Any, Dict

import torch

from torchpipe.distributed.channel import Channel

__all__ = ["gather_state", "gather_bytes"]


def gather_bytes(channel: Channel, payload: bytes, destination: int) -> Dict[int, bytes]:
    """Every rank's ``payload`` on rank ``destination`` (by rank; an empty dict elsewhere). A collective."""
    sequence = channel.next_sequence()
    tag = (sequence % 512) * 4  # this collective's tags, apart from the steps' (which use the high bits)
    control = channel.control
    if channel.rank != destination:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
        control.send([torch.tensor([data.numel()], dtype=torch.int64)], destination, tag).wait()
        if data.numel():
            control.send([data], destination, tag + 1).wait()
        channel.done(sequence)
        return {}
    gathered = {destination: payload}
    for rank in range(channel.size):
        if rank == destination:
            continue
        size = torch.empty(1, dtype=torch.int64)
        control.recv([size], rank, tag).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        if data.numel():
            control.recv([data], rank, tag + 1).wait()
        gathered[rank] = data.numpy().tobytes()
    channel.done(sequence)
    return gathered


def gather_state(channel: Channel, state: Dict[str, Any], destination: int) -> Dict[str, Any]:
    """The whole module's state dict on rank ``destination`` (each rank's layers, plain keys); ``{}`` elsewhere."""
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}, buffer)
    parts = gather_bytes(channel, buffer.getvalue(), destination)
    if channel.rank != destination:
        return {}
    merged: Dict[str, Any] = {}
    for rank in sorted(parts):
        merged.update(torch.load(io.BytesIO(parts[rank]), weights_only=True))
    return merged
