"""A multi-process Pipeline's setting up: the channel to the other ranks, which checks that every rank was given
the same; then what a rank's stages share with other ranks: replicas and tp ranks that start equal, tied copies
that start equal, and the hooks that reduce their gradients at the end of every step."""
import datetime
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from torchpipe.distributed.agree import verify_agreement
from torchpipe.distributed.channel import Channel
from torchpipe.distributed.mesh import MeshLayout
from torchpipe.distributed.placements import GradientPlacements
from torchpipe.distributed.reduce import GradientReducer, TiedGroup
from torchpipe.distributed.shard import ShardedStages, shard_stages
from torchpipe.distributed.tensor_parallel import replicated
from torchpipe.partition import resolve_devices
from torchpipe.runtime import Runner
from torchpipe.runtime.ties import Tie
from torchpipe.types import Device

__all__ = ["open_channel", "connect_stages"]


def open_channel(
    group: Any, devices: Optional[Sequence[Device]], mesh: Optional[MeshLayout], module: nn.Sequential,
    arguments: Mapping[str, Any], *, workers: int, stages: int, interleaved: bool,
) -> Channel:
    """This rank's channel to the others of ``group``, on its device (``devices[0]``, else ``cuda:LOCAL_RANK``
    with CUDA, else the CPU), once every rank has shown it was given the same ``arguments`` and ``module`` (see
    [Note: ranks agree]) and that the group has one rank per worker of the schedule."""
    if devices is not None:
        device = resolve_devices(devices, 1)[0]
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and the caching allocator follow the current device
    channel = Channel(
        group, device, timeout=datetime.timedelta(minutes=30),
        mesh_ranks=None if mesh is None else mesh.ranks,
        replica=0 if mesh is None else mesh.replica,
        replicas=1 if mesh is None else mesh.replicas,
        lane=0 if mesh is None else mesh.lane,
        lanes=1 if mesh is None else mesh.lanes,
    )
    channel.tp_mesh = None if mesh is None else mesh.tp_mesh
    verify_agreement(channel, module, dict(arguments))
    if channel.size != workers:
        raise ValueError(
            f"the schedule has {workers} workers but the process group has {channel.size} ranks; "
            f"a Pipeline across processes runs one worker per rank ({stages} stages: "
            + ("a multiple, at least 2, of the ranks)" if interleaved else "one per rank)")
        )
    return channel


def connect_stages(
    runner: Runner,
    channel: Channel,
    ties: Sequence[Tie],
    copies: Sequence[Sequence[nn.Parameter]],
    mesh: Optional[MeshLayout],
) -> None:
    """Called by every rank, in the same order (it makes process groups): makes this rank's stages start as the
    first replica's (their tensors that tensor parallelism left whole: as the first tp rank's) and its tied
    copies as the first holder's, and installs the gradient reductions (see [Note: reductions])."""
    stages: Dict[int, nn.Module] = {s: stage for s, stage in enumerate(runner.stages.modules) if stage is not None}
    if mesh is not None and mesh.tp_mesh is not None:  # see [Note: tensor parallel stages]
        runner.hooks.append(GradientPlacements(stages))
    if mesh is not None and mesh.lanes > 1:
        # A stage's tp ranks run collectives in every forward and backward: every rank commits to each step
        # before any runs (see Channel.commit), so that a step one rank refuses never starts on its tp peers.
        channel.collectives = channel.collectives_without_grad = True
        lanes = channel.subgroup(f"tp/{mesh.replica}/{channel.rank}", list(range(mesh.lanes)), mesh.lane)
        _broadcast(lanes, [t for t in _tensors(stages.values()) if replicated(t)])
    replicas: Any = None
    if mesh is not None and mesh.replicas > 1:
        channel.collectives = True
        replicas = channel.subgroup(f"dp/{mesh.lane}/{channel.rank}", list(range(mesh.replicas)), mesh.replica)
        _broadcast(replicas, _tensors(stages.values()))  # like DDP: every replica starts as the first
    tied: List[Tuple[Tie, Any]] = []
    for k, (tie, held) in enumerate(zip(ties, copies)):
        holders: List[int] = []
        for s in tie.stages:
            if runner.stages.stage_workers[s] not in holders:
                holders.append(runner.stages.stage_workers[s])  # the first holder's rank first
        if len(holders) < 2:
            continue
        channel.collectives = True  # on every rank, whether it holds the tie or not
        if channel.rank not in holders:
            continue
        group = channel.subgroup(f"tie/{channel.of(channel.replica)}/{k}", holders, channel.rank)
        _broadcast(group, [held[0]])  # the copies start as the first holder's (see [Note: tied parameters])
        tied.append((tie, group))
    if mesh is not None and mesh.mode == "shard":
        channel.collectives = channel.collectives_without_grad = True
        runner.hooks.append(ShardedStages(shard_stages(stages, mesh.dp_mesh)))  # see [Note: FSDP2 in a pipeline]
        replicas = None  # FSDP2 reduces over the replicas
    # The tied parameters as the stages hold them now (sharding replaces them with DTensors).
    groups = [TiedGroup(_held(tie, stages), group) for tie, group in tied]
    if replicas is not None or groups:
        order = sorted(stages, reverse=True)  # later stages end their backward first
        runner.hooks.append(GradientReducer(channel, stages, order, replicas, groups))


def _held(tie: Tie, stages: Dict[int, nn.Module]) -> nn.Parameter:
    """This rank's tensor of ``tie`` (its local holders share one: one device per rank)."""
    for s in tie.stages:
        stage = stages.get(s)
        for holder in tie.holders:
            if stage is not None and holder.layer in stage._modules:
                return holder.get(stage)
    raise AssertionError(f"no holder of the tie of {tie.keys} on this rank")


def _tensors(stages: Any) -> List[Tensor]:
    """The parameters and buffers of ``stages``, each once, in order."""
    seen: Dict[int, Tensor] = {}
    for stage in stages:
        for tensor in list(stage.parameters()) + list(stage.buffers()):
            seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def _broadcast(group: Any, tensors: Sequence[Tensor]) -> None:
    """Sets ``tensors`` on every member of ``group`` to the first member's."""
    with torch.no_grad():
        works = [group.broadcast([t.data if not hasattr(t, "to_local") else t.to_local()]) for t in tensors]
        for work in works:
            work.wait()
