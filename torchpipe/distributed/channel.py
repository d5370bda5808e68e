"""The channel of a multi-process pipeline on one rank: its process groups and its control plane in the store.

A multi-process :class:`torchpipe.Pipeline` does not use the caller's process
group for its messages: it makes process groups of its own over the same
ranks and the same store (gloo for headers and CPU tensors, NCCL for CUDA
tensors), so that nothing it sends can mix with the caller's collectives.

[Note: control plane] What the ranks must agree on besides the tensors goes
through the ``torch.distributed`` store, where every wait is a short poll that
also looks for a failure:

- ``start/<n>``: the first stage's rank publishes step ``n``'s shape (the
  micro-batch sizes, and whether it trains) and every other rank waits for it;
- ``failed/<n>``: the first rank whose step fails writes who failed, in which
  action, and why; every wait of every rank checks it, so every rank ends the
  step within a poll interval (a rank that dies is noticed by its neighbours,
  whose receives fail, and they write it);
- ``done/<n>/<rank>``: each rank's step is over; a rank returns only when
  every rank is done (or one failed), so a step ends the same way everywhere;
- ``loss/<n>``: the loss, from the last stage's rank to every rank.

Keys of old steps are deleted as steps go.
"""
import datetime
import itertools
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

try:
    from torch._C._distributed_c10d import ProcessGroupNCCL
except ImportError:  # a build without NCCL (this CPU one): CUDA pipelines across processes need it
    ProcessGroupNCCL = None  # type: ignore[assignment, misc]

__all__ = ["Channel", "PipelineError", "POLL_SECONDS"]

#: How often a waiting rank looks at the store for a failure.
POLL_SECONDS = 0.02
#: How long rank 0 waits for the other ranks to be through with the store after a step (see [Note: leaving the store]).
_LEAVE_SECONDS = 10.0

_instances: Dict[Tuple[int, ...], "itertools.count[int]"] = {}
_instances_lock = threading.Lock()


class PipelineError(RuntimeError):
    """Another rank of a multi-process pipeline failed; the message names the rank, the action and the error."""


def _default_store() -> Any:
    # The store the default process group was made with; torch.distributed does not export it.
    return dist.distributed_c10d._get_default_store()


class Channel:
    """The process groups and the control plane of one multi-process pipeline on this rank.

    Made collectively: every rank of ``group`` makes its pipelines in the same
    order (each gets the same number on every rank).

    Args:
        group: the caller's process group (its ranks are the pipeline's workers).
        device: this rank's device.
        timeout: the timeout of the pipeline's own process groups (a wait on
            a dead peer ends sooner, when its connection closes).
    """

    def __init__(self, group: Any, device: torch.device, timeout: datetime.timedelta) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "Pipeline(group=...) needs torch.distributed to be initialised: call "
                "torch.distributed.init_process_group() first (torchrun sets the environment for it)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the group it passed to Pipeline(group=...)")
        self.global_ranks = tuple(dist.get_process_group_ranks(group))
        with _instances_lock:
            number = next(_instances.setdefault(self.global_ranks, itertools.count()))
        self.prefix = f"torchpipe/{'-'.join(map(str, self.global_ranks))}/{number}/"
        self.store: Any = PrefixStore(self.prefix, _default_store())
        self.device = device
        #: Headers and CPU tensors (gloo); CUDA tensors go through ``data`` (NCCL), or the same group on CPU.
        self.control: Any = ProcessGroupGloo(PrefixStore("control", self.store), self.rank, self.size, timeout)
        if device.type == "cuda":
            if ProcessGroupNCCL is None:
                raise RuntimeError("a CUDA pipeline across processes needs PyTorch built with NCCL; this one is not")
            options = ProcessGroupNCCL.Options()
            self.data: Any = ProcessGroupNCCL(PrefixStore("data", self.store), self.rank, self.size, options)
        else:
            self.data = self.control
        self.sequence = 0
        #: The layout of each message the last time it crossed, by (source rank, target rank, edge) (see
        #: [Note: expected layouts] in torchpipe/distributed/transport.py).
        self.layouts: Dict[Tuple[int, int, Any], Tuple[Tuple[torch.dtype, Tuple[int, ...]], ...]] = {}

    def next_sequence(self) -> int:
        """The number of the next step (or other collective call) of this pipeline; the same on every rank."""
        self.sequence += 1
        old = self.sequence - 3
        if old > 0:  # forget old steps' keys (this rank's own)
            for key in (f"start/{old}", f"loss/{old}", f"failed/{old}", f"done/{old}/{self.rank}",
                        f"left/{old}/{self.rank}"):
                try:
                    self.store.delete_key(key)
                except RuntimeError:  # pragma: no cover - a store without delete: keys stay
                    break
        return self.sequence

    # --- failures ---------------------------------------------------------------------------------------

    def fail(self, sequence: int, message: str) -> None:
        """Records the step's failure, unless another rank's was recorded first."""
        key = f"failed/{sequence}"
        try:
            # compare_set keeps the first failure: later ones (echoes of it) do not overwrite it.
            self.store.compare_set(key, "", message)
        except RuntimeError:  # the store's host died: nothing to record in
            pass

    def failure(self, sequence: int) -> Optional[str]:
        """The recorded failure of step ``sequence``, if any."""
        key = f"failed/{sequence}"
        try:
            if not self.store.check([key]):
                return None
            return bytes(self.store.get(key)).decode("utf-8", "replace")
        except RuntimeError as exc:  # the store's host (the rank that started the job) died
            return f"the torch.distributed store cannot be reached ({exc}); the rank that hosts it may have died"

    def raise_failure(self, sequence: int) -> None:
        message = self.failure(sequence)
        if message is not None:
            raise PipelineError(message)

    # --- the control plane ------------------------------------------------------------------------------

    def publish(self, sequence: int, key: str, values: Sequence[float]) -> None:
        # Floats as hexadecimal text: exact, and the store's typed API takes text.
        self.store.set(f"{key}/{sequence}", " ".join(float(v).hex() for v in values))

    def _wait(self, sequence: int, keys: List[str]) -> None:
        """Waits until ``keys`` are in the store, looking for a failure of step ``sequence`` as it waits.

        It looks often at first, then every few milliseconds (the store's own
        timed wait would do, but logs a warning each time it times out).
        """
        pause = 0.0002
        while True:
            self.raise_failure(sequence)
            try:
                if self.store.check(keys):
                    return
            except RuntimeError as exc:
                raise PipelineError(f"the torch.distributed store cannot be reached ({exc})") from None
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def wait_for(self, sequence: int, key: str) -> List[float]:
        """The values published under ``key`` for step ``sequence``, once they are there (or a failure)."""
        name = f"{key}/{sequence}"
        self._wait(sequence, [name])
        return _parse(self.store.get(name))

    def done(self, sequence: int, read: Sequence[str] = ()) -> Dict[str, List[float]]:
        """Marks this rank's step over and waits until every rank's is (raising if one failed meanwhile).

        Returns the values published under the keys ``read``, read before this
        rank is through with the store for the step (see [Note: leaving the store]).
        """
        self.store.set(f"done/{sequence}/{self.rank}", "1")
        names = [f"{key}/{sequence}" for key in read]
        self._wait(sequence, [f"done/{sequence}/{r}" for r in range(self.size)] + names)
        try:
            values = {key: _parse(self.store.get(name)) for key, name in zip(read, names)}
        except RuntimeError as exc:
            raise PipelineError(f"the torch.distributed store cannot be reached ({exc})") from None
        self._leave(sequence)
        return values

    def _leave(self, sequence: int) -> None:
        # [Note: leaving the store]
        # The store lives in the process of global rank 0 (init_method tcp:// or env://; under torchrun,
        # in the agent). A rank that leaves its last step and exits takes the store with it: a rank still
        # polling for the step's last keys would then fail a step that succeeded. So every other rank
        # says when it has read all it needs of the step, and rank 0 waits for that before it returns.
        # A rank that dies in between is not waited for long: the step itself succeeded, and the next
        # one will find the dead rank.
        if self.rank != 0:
            self.store.set(f"left/{sequence}/{self.rank}", "1")
            return
        keys = [f"left/{sequence}/{r}" for r in range(1, self.size)]
        deadline = time.monotonic() + _LEAVE_SECONDS
        pause = 0.0002
        while time.monotonic() < deadline:
            try:
                if self.store.check(keys):
                    return
            except RuntimeError:  # pragma: no cover - rank 0 hosts the store: it is there
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.005)


def _parse(value: Any) -> List[float]:
    """Values as :meth:`Channel.publish` wrote them."""
    return [float.fromhex(v) for v in bytes(value).decode("ascii").split()]
