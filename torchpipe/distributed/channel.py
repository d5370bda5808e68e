"""The channel of a multi-process pipeline on one rank: its process groups and its control plane in the store.

A multi-process :class:`torchpipe.Pipeline` does not use the caller's process
group for its messages: it makes process groups of its own over the same
ranks and the same store (gloo for headers and CPU tensors, NCCL for CUDA
tensors), so that nothing it sends can mix with the caller's collectives.

[Note: control plane] What the ranks must agree on besides the tensors goes
through the ``torch.distributed`` store. A rank waits for a key with a read
that blocks in the store until the key is there, on a connection of the
channel's own (no polling: it wakes as soon as the key is written, and spares
the store's host, one of the ranks at work, a trip every few hundred
microseconds); a failure writes a mark into every such key not yet written,
so every blocked rank wakes and reads the failure (a wait that outlives the
pipeline's timeout fails as well):

- ``start/<n>/<replica>``: the first stage's rank of each replica publishes
  step ``n``'s shape (the micro-batch sizes, and whether it trains) and every
  other rank waits for it (for every replica's, when replicas weigh their
  losses by the total number of samples); like a failure's mark, it is
  written only where nothing was: a start that comes after a failure was
  recorded (a rank's wait for it timed out) is refused, and its rank learns
  the failure instead of running the step alone;
- ``weight/<n>/<replica>``: with ``loss_weight`` on a mesh, the last stage's
  rank of each replica publishes the total weight of its micro-batches, and
  reads every replica's before its first backward (see [Note: token weights]);
- ``failed/<n>``: the first rank whose step fails writes who failed, in which
  action, and why, then marks every key of the step a rank may be blocked on
  (start, done, fate); a rank waiting for a message polls it, so every rank
  ends the step within a poll interval (a rank busy with its actions looks
  between them, more rarely: ``BUSY_POLL_SECONDS``; a rank that dies is
  noticed by its neighbours, whose receives fail, and they write it; between
  steps, by its neighbours on a ring of connections, see [Note: liveness] in
  liveness.py);
- ``ready/<n>`` and ``fate/<n>``: before a step with collectives between
  replicas (or between the holders of a tied parameter), the ranks agree that
  every one of them will run it (:meth:`Channel.commit`);
- ``done/<n>/<rank>``: each rank's step is over, with what it tells every
  rank (the last stage's rank: its replica's loss); a rank returns only when
  every rank is done (or one failed), so a step ends the same way everywhere;
- ``left/<rank>``: the last step (or collective call) each rank other than
  the store's host is through with (see [Note: leaving the store]).

Every key is under ``torchpipe/attempt<n>/<the mesh's ranks>/<the pipeline's number>/``: unique to the
pipeline and to torchrun's restart attempt (see [Note: attempts] in torchpipe/distributed/restart.py).

A multi-process pipeline of a mesh's replica shares the store's keys (and so
its failures and ends of steps) with every replica, and has process groups
of its own for its stages' messages. With a ``'tp'`` dimension each replica
has one pipeline per tp rank (a lane): ``<replica>`` in the keys above is
then ``<replica>.<lane>``, and each lane's ranks publish and read their own.

Keys of old steps are deleted as steps go (``left/<rank>``, one per rank, is overwritten).
"""
import datetime
import itertools
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

from torchpipe.distributed import liveness
from torchpipe.distributed.restart import attempt_prefix

try:
    from torch._C._distributed_c10d import ProcessGroupNCCL
except ImportError:  # a build without NCCL (this CPU one): CUDA pipelines across processes need it
    ProcessGroupNCCL = None  # type: ignore[assignment, misc]

__all__ = ["Channel", "PipelineError", "POLL_SECONDS", "BUSY_POLL_SECONDS"]

#: How often a rank waiting for a message looks at the store for a failure.
POLL_SECONDS = 0.02
#: How often a rank that is busy with its actions (not waiting) looks: it learns a failure sooner only to stop
#: computing sooner (its peers' abort messages and the step's end tell it anyway), and every look is a trip to
#: the store's host, which serves every rank of the job.
BUSY_POLL_SECONDS = 0.5
#: What a failure writes into the keys of its step that ranks may be blocked on (see [Note: control plane]):
#: never a value the ranks publish (those are hexadecimal floats, "commit" or "abort").
_FAILED = b"failed"
#: How long rank 0 waits for the other ranks to be through with the store after a step (see [Note: leaving the store]).
_LEAVE_SECONDS = 10.0
#: The same after a failed step (a dead rank never says it left).
_LEAVE_FAILED_SECONDS = 3.0

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

    def __init__(
        self,
        group: Any,
        device: torch.device,
        timeout: datetime.timedelta,
        *,
        mesh_ranks: Optional[Sequence[int]] = None,
        replica: int = 0,
        replicas: int = 1,
        lane: int = 0,
        lanes: int = 1,
    ) -> None:
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
        #: Every rank whose steps succeed or fail together: the pipeline's, or the whole mesh's (all replicas).
        self.mesh_ranks = tuple(mesh_ranks) if mesh_ranks is not None else self.global_ranks
        self.index = self.mesh_ranks.index(dist.get_rank())
        self.count = len(self.mesh_ranks)
        #: This pipeline's replica (its index along a mesh's 'dp' dimension) and the number of replicas.
        self.replica = replica
        self.replicas = replicas
        #: This pipeline's lane (its index along a mesh's 'tp' dimension: one pipeline per tp rank of each
        #: replica, see [Note: tensor parallel stages]) and the number of lanes. The control plane's per-replica
        #: keys are per lane: each lane's ranks publish and read their own lane's.
        self.lane = lane
        self.lanes = lanes
        with _instances_lock:
            number = next(_instances.setdefault(self.mesh_ranks, itertools.count()))
        # Keyed by restart attempt too: a job that torchrun restarted meets in the store its dead attempt wrote
        # (see [Note: attempts] in torchpipe/distributed/restart.py).
        self.prefix = f"torchpipe/{attempt_prefix()}{'-'.join(map(str, self.mesh_ranks))}/{number}/"
        self.store: Any = PrefixStore(self.prefix, _default_store())
        self.device = device
        self.timeout = timeout
        #: Where a rank waits for keys: a read that blocks holds its connection (see [Note: control plane]).
        self.waits: Any = _own_connection(self.store, timeout)
        #: The groups of messages to a higher rank: gloo for headers and CPU tensors (``control``), and for CUDA
        #: tensors NCCL (``data``; the same gloo group on CPU).
        self.up: Tuple[Any, Any] = self._groups(f"pipeline/{self.of(replica)}", self.rank, self.size)
        self.control, self.data = self.up
        down = self._gloo(f"pipeline/{self.of(replica)}/down", self.rank, self.size)
        #: The same for messages to a lower rank: a gloo group of their own (see [Note: a group for each
        #: direction] in torchpipe/distributed/routes.py); CUDA tensors go through the one NCCL group.
        self.down: Tuple[Any, Any] = (down, self.data if self.device.type == "cuda" else down)
        self.sequence = 0
        # Rank 0's wait for the others to leave the store polls it, more rarely as it goes on, at most this far
        # apart. More ranks poll one store: each polls less often.
        self._longest_pause = min(0.005, 0.0005 * max(1, self.count // 2))
        #: The keys this rank set for each recent step, deleted as it leaves the step two later (see _leave).
        self._mine: Dict[int, List[str]] = {}
        #: Whether training steps start collectives between ranks (data-parallel or tied-copy reductions): then
        #: every rank commits to each step first (see :meth:`commit`). The same on every rank.
        self.collectives = False
        #: Whether steps without backward start collectives too (FSDP2 gathers the parameters of every step).
        self.collectives_without_grad = False
        #: The 'tp' sub-mesh of a tensor-parallel pipeline, on which DTensors received from other stages are
        #: rebuilt (None without one: see torchpipe/distributed/dtensors.py).
        self.tp_mesh: Any = None
        # A rank that ends between steps fails this pipeline everywhere (see [Note: liveness]).
        liveness.watch(self, timeout)

    def _groups(self, name: str, rank: int, size: int) -> Tuple[Any, Any]:
        """Process groups of this pipeline's own, named ``name`` (every member passes the same name): gloo for
        headers and CPU tensors, and NCCL for CUDA tensors (the gloo group again on CPU)."""
        control = self._gloo(name + "/control", rank, size)
        if self.device.type != "cuda":
            return control, control
        if ProcessGroupNCCL is None:
            raise RuntimeError("a CUDA pipeline across processes needs PyTorch built with NCCL; this one is not")
        options = ProcessGroupNCCL.Options()
        return control, ProcessGroupNCCL(PrefixStore(name + "/data", self.store), rank, size, options)

    def _gloo(self, name: str, rank: int, size: int) -> Any:
        """A gloo process group of this pipeline's own, named ``name`` (every member passes the same name)."""
        return ProcessGroupGloo(PrefixStore(name, self.store), rank, size, self.timeout)

    def subgroup(self, name: str, members: Sequence[Any], me: Any) -> Any:
        """A process group of this pipeline's own among ``members`` (made by them alone, each passing the same
        ``name`` and ``members``, and itself as ``me``): NCCL for CUDA tensors, gloo on CPU."""
        return self._groups(name, list(members).index(me), len(members))[1]

    def of(self, replica: int, lane: Optional[int] = None) -> str:
        """The name of ``replica``'s pipeline of ``lane`` (default: this rank's) in keys and group names: the
        replica's index, and the lane's where there are several."""
        return f"{replica}" if self.lanes == 1 else f"{replica}.{self.lane if lane is None else lane}"

    @property
    def who(self) -> str:
        """This rank, as failure messages name it: its rank in the pipeline, and its replica's and lane's index
        on a mesh."""
        where = [f"replica {self.replica}"] if self.replicas > 1 else []
        where += [f"tp rank {self.lane}"] if self.lanes > 1 else []
        return f"{self.rank}" + (f" of {', '.join(where)}" if where else "")

    def next_sequence(self) -> int:
        """The number of the next step (or other collective call) of this pipeline; the same on every rank."""
        self.sequence += 1
        return self.sequence

    def _forget(self, sequence: int) -> None:
        """Deletes the keys this rank set for step ``sequence`` and before (see :meth:`_leave`)."""
        # list(dict) is one step for the interpreter: a receiving thread may record a failure meanwhile.
        for old in [n for n in list(self._mine) if n <= sequence]:
            for key in self._mine.pop(old, []):
                try:
                    self.store.delete_key(key)
                except RuntimeError:  # the host went (a job's end), or a store without delete: keys stay
                    return

    def _set(self, sequence: int, key: str, value: str) -> None:
        """Sets ``key`` of step ``sequence``, to be deleted when the step is old."""
        self.store.set(key, value)
        self._mine.setdefault(sequence, []).append(key)

    # --- failures ---------------------------------------------------------------------------------------

    def fail(self, sequence: int, message: str) -> None:
        """Records the step's failure, unless another rank's was recorded first, and wakes every rank blocked on a
        key of the step."""
        # compare_set keeps the first failure: later ones (echoes of it) do not overwrite it. The record first: a
        # rank that wakes to a mark reads it.
        self._decide(f"failed/{sequence}", message)
        self._decide(f"fate/{sequence}", "abort")  # no-op after a commit (see commit)
        # The marks go only where nothing was written yet: a start published or a rank's done stand.
        marked = [f"{key}/{sequence}/{self.of(r, lane)}" for key in ("start", "weight") for r in range(self.replicas)
                  for lane in range(self.lanes)]
        marked += [f"{key}/{sequence}/{r}" for key in ("done", "exchange") for r in range(self.count)]
        for key in marked:
            self._decide(key, _FAILED.decode())
        self._mine.setdefault(sequence, []).extend([f"failed/{sequence}", f"fate/{sequence}", *marked])

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
        """Publishes ``values`` under ``key`` for step ``sequence``, for this replica's ranks (and the others'),
        unless the step failed first.

        A rank whose wait for the key outlived the pipeline's timeout marked it failed and left the step: a value
        written over the mark would start the step for this rank alone, whose messages nobody would then take
        (their sends left pending, the pairs out of step).

        Raises:
            PipelineError: a failure of the step was recorded before.
        """
        name = f"{key}/{sequence}/{self.of(self.replica)}"
        value = _format(values)
        self._mine.setdefault(sequence, []).append(name)
        try:
            written = bytes(self.store.compare_set(name, "", value))  # the first value stands, as for a failure
        except RuntimeError as exc:  # the store's host died
            raise PipelineError(f"rank {self.who} could not publish the {key} of step {sequence}: {exc}") from None
        if written != value.encode():
            raise PipelineError(self.failure(sequence) or "another rank's step failed")

    def published(self, sequence: int, key: str) -> Optional[List[float]]:
        """What this replica's rank published under ``key`` for step ``sequence``, without waiting: None where
        nothing was, or a failure marked the key first."""
        name = f"{key}/{sequence}/{self.of(self.replica)}"
        try:
            if not self.store.check([name]):
                return None
            value = bytes(self.store.get(name))
        except RuntimeError:  # the store's host died: nobody goes on with the step
            return None
        return None if value == _FAILED else _parse(value)

    def _read(self, sequence: int, names: List[str], what: str) -> List[bytes]:
        """The values under ``names`` of step ``sequence``, read once all are in the store (blocking there: see
        [Note: control plane]).

        Raises:
            PipelineError: a failure was recorded in place of one of them; or the wait outlived the
                pipeline's timeout, or the store cannot be reached (recorded as this rank's failure).
        """
        try:
            values = [bytes(value) for value in self.waits.multi_get(names)]
        except RuntimeError as exc:  # the timeout (the store's own error), or the store's host died
            message = f"rank {self.who} waited for {what} of step {sequence} in vain: {exc}"
            self.fail(sequence, message)
            raise PipelineError(self.failure(sequence) or message) from None
        if _FAILED in values:
            raise PipelineError(self.failure(sequence) or "another rank's step failed")
        return values

    def wait_for(self, sequence: int, key: str, replica: Optional[int] = None, lane: Optional[int] = None
                 ) -> List[float]:
        """The values published under ``key`` for step ``sequence`` by a rank of ``replica``'s pipeline of
        ``lane`` (default: this rank's), once they are there (or a failure)."""
        replica = self.replica if replica is None else replica
        # What is there is taken even if the step failed since: a rank that published the step's start and then
        # failed at once has sent, or will send, abort messages to this one, whose step must then start and
        # take them (see [Note: abort messages]).
        (value,) = self._read(sequence, [f"{key}/{sequence}/{self.of(replica, lane)}"],
                              f"the {key} of replica {self.of(replica, lane)}")
        return _parse(value)

    def wait_for_replicas(self, sequence: int, key: str) -> List[List[float]]:
        """The values every replica (of this rank's lane) published under ``key`` for step ``sequence``, in
        replica order, read in one trip once all are there (or a failure)."""
        names = [f"{key}/{sequence}/{self.of(r)}" for r in range(self.replicas)]
        return [_parse(value) for value in self._read(sequence, names, f"every replica's {key}")]

    def exchange(self, values: Sequence[float]) -> List[List[float]]:
        """Every rank's ``values`` (of every replica), in the mesh's rank order; a collective, through the
        store (exact: floats as hexadecimal text)."""
        return [_parse(text.encode("ascii")) for text in self.exchange_text(_format(values))]

    def exchange_text(self, text: str, key: str = "exchange") -> List[str]:
        """Every rank's ``text`` (of every replica), in the mesh's rank order; a collective, through the store.

        ``key``: other than ``'exchange'``, a collective of the pipeline's construction, once per key and
        before any step: it takes no step number (step 0's keys), so steps are numbered from 1 as they are
        taken (see [Note: ranks agree] in torchpipe/distributed/agree.py)."""
        sequence = self.next_sequence() if key == "exchange" else 0
        self._set(sequence, f"{key}/{sequence}/{self.index}", text)
        names = [f"{key}/{sequence}/{r}" for r in range(self.count)]
        every = [value.decode("utf-8") for value in self._read(sequence, names, "every rank's values")]
        self._leave(sequence)
        return every

    def commit(self, sequence: int) -> None:
        """Returns once every rank (of every replica) will run step ``sequence``; raises if one failed first.

        Collectives between ranks (data-parallel reductions, tied copies' sums)
        may start only when every rank will issue them: a rank that had failed
        before would never issue its share, and its peers would wait forever
        (or pair the next step's collectives with this one's). So the ranks
        agree on the step's fate first, in the store, atomically: the last rank
        to arrive decides "commit", a failure recorded before decides "abort"
        (:meth:`fail`), whichever comes first. After a commit, a failure ends
        the step on every rank all the same, and each still issues the
        collectives it owes (see [Note: stage lifecycle]).

        Raises:
            PipelineError: a rank failed before every rank arrived.
        """
        fate = f"fate/{sequence}"
        if self.index == 0:
            self._mine.setdefault(sequence, []).extend([f"ready/{sequence}", fate])
        if int(self.store.add(f"ready/{sequence}", 1)) == self.count:
            self._decide(fate, "commit")
        if self._read(sequence, [fate], "every rank's commitment") != [b"commit"]:
            raise PipelineError(self.failure(sequence) or "another rank's step failed")

    def _decide(self, key: str, value: str) -> None:
        try:
            self.store.compare_set(key, "", value)  # the first decision stands
        except RuntimeError:  # the store's host died: the waits will say so
            pass

    def done(self, sequence: int, values: Sequence[float] = (), read: bool = False) -> List[List[float]]:
        """Marks this rank's step over, with ``values`` for every rank to read, and waits until every rank's is
        (raising if one failed meanwhile).

        Returns, with ``read``, every rank's values (of every replica, in the mesh's rank order), read before
        this rank is through with the store for the step (see [Note: leaving the store]); else ``[]``.
        """
        self._set(sequence, f"done/{sequence}/{self.index}", _format(values))
        names = [f"done/{sequence}/{r}" for r in range(self.count)]
        # A rank whose step fails never says it is done: a failure marks its key instead. Once every rank has
        # said so, the step succeeded, whatever a failure recorded since says.
        every = self._read(sequence, names, "every rank's end")
        self._leave(sequence)
        return [_parse(value) for value in every] if read else []

    def leave_failed(self, sequence: int) -> None:
        """After a failed step, once this rank has read the failure: see [Note: leaving the store]."""
        try:
            self._leave(sequence, _LEAVE_FAILED_SECONDS)
        except RuntimeError:  # the store's host died: nothing to leave
            pass

    def _leave(self, sequence: int, seconds: float = _LEAVE_SECONDS) -> None:
        # [Note: leaving the store]
        # The store lives in the process of global rank 0 (init_method tcp:// or env://; under torchrun,
        # in the agent). A rank that leaves its last step and exits takes the store with it: a rank still
        # polling for the step's last keys would then fail a step that succeeded, or, after a failed step,
        # find "the store cannot be reached" instead of the failure's record. So every other rank says
        # when it has read all it needs of the step (the number of the last step it is through with, under
        # one key of its own, overwritten: nothing to delete), and rank 0 waits for that before it returns.
        # A rank that dies in between is not waited for long: a step that succeeded stays so, and the next
        # one will find the dead rank.
        #
        # Leaving is also when a rank forgets the keys it set two steps ago (where it forgot the keys of three
        # steps ago at the next step's start before): every rank is through with them (each has since passed
        # a later step's end, or published its part of a later collective call, which it does after
        # reading). The store's host does so while the others read this step's last keys, the others once
        # rank 0 may go: off the way between this step's end and the next one's start, where in a lone
        # pipeline the other ranks wait for rank 0 (the first stage's, whose backward ends a training step
        # last). A deletion that fails (the host went) leaves nothing to delete.
        if dist.get_rank() != 0:
            self.store.set(f"left/{self.index}", str(sequence))
            self._forget(sequence - 2)
            return
        self._forget(sequence - 2)
        keys = [f"left/{r}" for r in range(self.count) if r != self.index]
        deadline = time.monotonic() + seconds
        pause = 0.0002
        while time.monotonic() < deadline:
            try:
                # add(key, 0) reads a number in one trip (and makes a key not yet there, as 0).
                if all(int(self.store.add(key, 0)) >= sequence for key in keys):
                    return
            except RuntimeError:  # pragma: no cover - rank 0 hosts the store: it is there
                return
            time.sleep(pause)
            pause = min(pause * 2, self._longest_pause)


def _own_connection(store: Any, timeout: datetime.timedelta) -> Any:
    """A connection to ``store`` for the channel's waits, with the pipeline's timeout: a clone of it (a read that
    blocks holds its connection, which no other thread of the process then waits behind), or ``store`` itself
    where this PyTorch cannot clone one (its timeout then stays the store's)."""
    try:
        own = store.clone()
    except (AttributeError, RuntimeError):  # torch without Store.clone, or a store that cannot be cloned
        return store
    own.set_timeout(timeout)
    return own


def _format(values: Sequence[float]) -> str:
    """``values`` as the store keeps them: hexadecimal floats, exact, as text (the store's typed API takes text)."""
    return " ".join(float(v).hex() for v in values)


def _parse(value: Any) -> List[float]:
    """Values as :meth:`Channel.publish` wrote them."""
    return [float.fromhex(v) for v in bytes(value).decode("ascii").split()]
