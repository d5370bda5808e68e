"""Restarts under torchrun: every key a job writes into the store is unique to the attempt that wrote it.

[Note: attempts] ``torchrun --max-restarts N`` restarts every rank of a job
when one fails, and the new ranks meet again in the store the agent hosts at
``MASTER_ADDR:MASTER_PORT``: the same store as the dead attempt's, still
holding every key the dead ranks wrote. ``torch.distributed.init_process_group``
on that store (``env://``, which in torch 2.13 connects to the agent's store
without a prefix of the attempt: its comment says "we create a new TCPStore
for every retry", while the agent keeps one for the whole job) reads the dead
ranks' addresses: the new attempt fails to connect ("Connection refused") or
hangs in its first collective (pytorch/pytorch#167288). The same goes for any process group made over that store,
``torchpipe.Pipeline``'s own included.

So :func:`init_process_group` makes the default group on a prefix of the
store that is the attempt's alone (``attempt<TORCHELASTIC_RESTART_COUNT>/``),
and :func:`attempt_prefix` keys torchpipe's own groups and control plane by
attempt too, whichever way the default group was made.
"""
import datetime
import os
from typing import Any, Optional

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

__all__ = ["init_process_group", "attempt", "attempt_prefix", "under_torchrun"]

#: What torchrun sets in each rank's environment: the attempt's number (0, 1, …) and the store's address.
_TORCHRUN = ("TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def under_torchrun() -> bool:
    """Whether this process is a rank that torchrun (torch.distributed.elastic) started."""
    return all(os.environ.get(name) for name in _TORCHRUN)


def attempt() -> int:
    """The number of the restart attempt this process belongs to: ``TORCHELASTIC_RESTART_COUNT`` under
    torchrun (0 for the first attempt, 1 after the first restart, …), else 0."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"TORCHELASTIC_RESTART_COUNT must be an integer, got {value!r}") from None


def attempt_prefix() -> str:
    """The prefix of every key torchpipe writes into a store: unique to the restart attempt."""
    return f"attempt{attempt()}/"


def init_process_group(backend: Optional[str] = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` that survives torchrun's restarts.

    Under torchrun (``TORCHELASTIC_RESTART_COUNT``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` in the environment), the default process group is made on
    ``PrefixStore(f"attempt{restart_count}", TCPStore(MASTER_ADDR, MASTER_PORT))``,
    whose keys are ``attempt<n>/...``, on a client of the store torchrun's
    agent hosts (or, where the agent hosts none, as under older PyTorch's c10d
    rendezvous, of the store rank 0 hosts): a restarted attempt never reads a
    key of a dead one (see [Note: attempts]). Elsewhere, or when ``init_method`` or ``store`` is
    given, it is ``torch.distributed.init_process_group(backend, **kwargs)``.

    Args:
        backend: as for ``torch.distributed.init_process_group`` (None: its
            default, gloo for CPU tensors and NCCL for CUDA ones where
            available).
        kwargs: ``timeout``, ``rank``, ``world_size``, ``device_id``,
            ``pg_options``, … as for ``torch.distributed.init_process_group``;
            ``timeout`` is the store's too.

    Example::

        import torchpipe.distributed
        torchpipe.distributed.init_process_group("gloo")   # under torchrun --max-restarts 3
        pipe = torchpipe.Pipeline(model, balance, group=torch.distributed.group.WORLD, ...)
    """
    if not under_torchrun() or "init_method" in kwargs or "store" in kwargs:
        dist.init_process_group(backend, **kwargs)
        return
    rank = int(kwargs.pop("rank", os.environ["RANK"]))
    world_size = int(kwargs.pop("world_size", os.environ["WORLD_SIZE"]))
    timeout = kwargs.get("timeout")
    if timeout is None:
        timeout = datetime.timedelta(minutes=30)  # torch.distributed's default_pg_timeout
    # The agent hosts the store where TORCHELASTIC_USE_AGENT_STORE=True (the static rendezvous, and the c10d one
    # where the agent shares its rendezvous store); otherwise (a c10d rendezvous in older PyTorch) rank 0 hosts a
    # store of its own at MASTER_PORT, anew at every attempt, and the prefix costs nothing.
    hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0
    store = TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size if hosts else None,
        is_master=hosts, timeout=timeout, wait_for_workers=False,
    )
    # PrefixStore puts a "/" between its prefix and each key.
    dist.init_process_group(backend, store=PrefixStore(f"attempt{attempt()}", store), rank=rank,
                            world_size=world_size, **kwargs)
