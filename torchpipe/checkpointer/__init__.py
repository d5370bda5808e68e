"""Checkpoints a job resumes from after a failure: saved every N steps in the background, each marked complete only
once every rank has written it, with the RNG states and the caller's ``extra`` of every rank.

[Note: complete checkpoints] Each saved step has a directory of its own,
``<directory>/step-<n>``: the model's and the optimizer's state through
``torch.distributed.checkpoint`` (DCP: keys of the plain module, the
optimizer's state flattened, so a checkpoint loads under any layout), and one
file per rank (``rank-<r>.pickle``: its RNG states and ``extra``). A save runs
in four moves:

1. every rank waits for its previous save (one in flight at a time), then the
   first rank clears the step's directory (and the incomplete ones a dead
   attempt left behind) while the others wait for it (a collective);
2. each rank writes its own file, and hands DCP its state: ``async_save``
   copies the tensors to CPU memory and returns, and a thread writes them;
3. as its write ends, each rank counts itself in the store (one atomic
   ``add``); the rank that counts last knows every rank's files are written,
   and writes the mark, ``torchpipe-complete.json`` (written to a temporary
   name, flushed to disk, then renamed: there or not, never half), then
   removes the oldest complete checkpoints beyond ``keep``;
4. the next save (or :meth:`Checkpointer.close`) waits for this one.

:meth:`Checkpointer.restore` takes the newest directory with a mark: a crash
at any moment leaves either a mark on a whole checkpoint or no mark, and a
directory without a mark is ignored (and removed by the next save).

DCP's collectives run on a gloo process group of the checkpointer's own, on
DCP's writing thread, apart from the caller's: so the caller's collectives
and the pipeline's messages go on meanwhile.
"""
import inspect
import itertools
import json
import os
import pickle
import shutil
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import PrefixStore

from torchpipe.checkpointer.files import MARK, check_directory, listing, sync_directory, write
from torchpipe.checkpointer.state import (
    flat_keys,
    mismatch,
    put_grads,
    rng_states,
    set_rng_states,
    without_grads,
)
from torchpipe.distributed.restart import attempt_prefix

__all__ = ["Checkpointer", "MARK"]

#: DCP's warning at a save or load without a process group (see Checkpointer.__init__).
_ONE_PROCESS = r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to (save|load)"

_instances: Dict[Tuple[int, ...], "itertools.count[int]"] = {}
_instances_lock = threading.Lock()


def _dcp() -> Tuple[Any, Any, Any, Any, Any]:
    """DCP's save, async save (None where missing), load, and ``get_state_dict``/``set_state_dict`` with the
    options that flatten the optimizer's state; a clear error on a PyTorch that lacks them."""
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    except ImportError as exc:
        raise RuntimeError(
            f"torchpipe.Checkpointer needs torch.distributed.checkpoint.state_dict (get_state_dict, set_state_dict), "
            f"which torch {torch.__version__} lacks ({exc}); upgrade PyTorch"
        ) from None
    try:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
    except TypeError:
        raise RuntimeError(
            f"torchpipe.Checkpointer needs StateDictOptions(flatten_optimizer_state_dict=True), which torch "
            f"{torch.__version__} lacks (without it, ranks that hold other parameters lose their param groups' "
            "hyper-parameters); upgrade PyTorch"
        ) from None
    if not hasattr(dcp, "save") or not hasattr(dcp, "load"):
        raise RuntimeError(f"torchpipe.Checkpointer needs torch.distributed.checkpoint.save and load, which torch "
                           f"{torch.__version__} lacks; upgrade PyTorch")

    def get(module: nn.Module, optimizer: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        model_state, optim_state = get_state_dict(module, optimizer, options=options)
        return dict(model_state), dict(optim_state)

    def set_(module: nn.Module, optimizer: Any, model_state: Dict[str, Any], optim_state: Dict[str, Any]) -> None:
        set_state_dict(module, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=options)

    return dcp, getattr(dcp, "async_save", None), get, set_, FileSystemReader


class Checkpointer:
    """Saves a training job every ``every`` steps and resumes it from its newest complete checkpoint.

    Under ``torchrun --max-restarts N`` a job that loses a rank is restarted
    and goes on from its last complete checkpoint: only the steps since then
    are done again (at most ``every``), and the resumed run draws the random
    numbers and reaches the weights the uninterrupted run would.

    Args:
        directory: where the checkpoints go, one directory per saved step
            (``step-<n>``); made if missing. Every rank passes the same one
            (on a file system every rank sees, across hosts).
        pipe: the :class:`~torchpipe.Pipeline` (or any module) whose state is
            saved: with ``group=`` or ``mesh=``, every rank of its group (of
            the whole mesh) saves and restores together; in one process, the
            process alone.
        optimizer: the optimizer of ``pipe``'s parameters on this rank.
        every: save at the steps that are multiples of ``every`` (at least 1).
        keep: how many of the newest complete checkpoints to keep (at least
            1); older ones are removed.
        group: the process group whose ranks save together, where not those of
            ``pipe`` (a module that is not a multi-process Pipeline, trained
            by several ranks that each hold a part of it).

    Raises:
        ValueError: ``every < 1`` or ``keep < 1``, or a file where the
            directory should be: on every rank, before any step.
        OSError: the directory cannot be made or written (on any rank: every
            rank raises).
        RuntimeError: a PyTorch without ``torch.distributed.checkpoint``'s
            ``get_state_dict`` and ``flatten_optimizer_state_dict``.

    Example::

        ckpt = torchpipe.Checkpointer("ckpt/", pipe, optimizer, every=50, keep=3)
        start = ckpt.restore()                      # 0 without a complete checkpoint
        for step in range(start, total_steps):
            loss = pipe.step(*batch(step))
            optimizer.step(); optimizer.zero_grad()
            ckpt.step(step + 1, extra={"data": loader_state})
        ckpt.close()

    All ranks call every method, in the same order, with the same step.
    """

    def __init__(
        self,
        directory: Union[str, "os.PathLike[str]"],
        pipe: nn.Module,
        optimizer: torch.optim.Optimizer,
        every: int = 100,
        keep: int = 3,
        *,
        group: Any = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer of at least 1 (save every so many steps), got {every!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer of at least 1 (the newest complete checkpoints kept), "
                             f"got {keep!r}")
        self._dcp, self._async_save, self._get_state, self._set_state, self._reader = _dcp()
        self.directory = Path(directory)
        self.pipe = pipe
        self.optimizer = optimizer
        self.every = every
        self.keep = keep
        #: After :meth:`restore`: this rank's ``extra`` as it was saved (None: no checkpoint, or none saved by a
        #: rank of this number).
        self.extra: Any = None
        #: The step the last :meth:`restore` went on from (None before; 0: no complete checkpoint).
        self.restored: Optional[int] = None
        ranks = _ranks(pipe, group)
        #: The global ranks that save together (None: this process alone).
        self.ranks = ranks
        self._group: Any = None
        self._store: Any = None
        self.rank = 0
        if ranks is not None:
            self.rank = ranks.index(dist.get_rank())
            # DCP's collectives run on its writing thread: on a group of their own, apart from the caller's.
            try:
                self._group = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
            except TypeError:  # a PyTorch without use_local_synchronization: every rank of the world makes it
                self._group = dist.new_group(list(ranks), backend="gloo")
            with _instances_lock:
                number = next(_instances.setdefault(ranks, itertools.count()))
            prefix = f"torchpipe/{attempt_prefix()}checkpointer/{'-'.join(map(str, ranks))}/{number}/"
            self._store = PrefixStore(prefix, dist.distributed_c10d._get_default_store())
        else:
            # DCP warns at every save and load in one process that it "assumes the intent" is one process; here
            # it is the intent (no_dist=True). The save warns on DCP's own thread, where a catch_warnings around
            # the call cannot reach (nor safely could): so a filter, once, for these messages alone.
            warnings.filterwarnings("ignore", message=_ONE_PROCESS, category=UserWarning)
        self._raise_everywhere(check_directory(self.directory))
        # Directories without a mark, left by a dead attempt (nothing writes while a checkpointer is made): the
        # next save removes them.
        self._stale: List[Path] = [p for _, p, complete in listing(self.directory) if not complete]
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="torchpipe-checkpointer")
        self._pending: Optional[Future[None]] = None
        self._saves = 0
        self._last: Optional[int] = None
        self._closed = False

    # --- the public methods ---------------------------------------------------------------------------

    def restore(self) -> int:
        """Loads the newest complete checkpoint into the pipeline and the optimizer, and this rank's RNG states
        and ``extra`` (into :attr:`extra`); returns the step it was saved at (the step to go on from), or 0 when
        there is no complete checkpoint (then nothing changes).

        The checkpoint may come from another layout (balance, world size,
        ``group=`` or ``mesh=``, ``'replicate'`` or ``'shard'``, one process):
        DCP reshards it by name. A rank whose number the saving job did not
        have gets no RNG states and ``extra`` None.

        Raises:
            ValueError: the checkpoint is not of this model: keys this
                pipeline holds that it lacks, keys of the model it has that no
                rank here holds, or shapes that differ (every one listed, on
                every rank); nothing is loaded.
        """
        self._check_open()
        newest = [step for step, _, complete in listing(self.directory) if complete]
        choice: Optional[int] = self._agree(max(newest) if newest else None)[0]  # the first rank's listing, for all
        self.extra = None
        if choice is None:
            self.restored = 0
            return 0
        path = self.directory / f"step-{choice}"
        grads = without_grads(self.optimizer) if not self.optimizer.state else None
        try:
            # With an empty optimizer state, get_state_dict makes one (a step of zero gradients at lr 0), for the
            # checkpoint's to overwrite.
            model_state, optim_state = self._get_state(self.pipe, self.optimizer)
        finally:
            if grads is not None:
                put_grads(self.optimizer, grads)
        state = {"model": model_state, "optim": optim_state}
        metadata = self._reader(str(path)).read_metadata().state_dict_metadata
        self._raise_everywhere(mismatch(state, metadata, self._agree(sorted(flat_keys(state)))), ValueError)
        self._dcp.load(state, checkpoint_id=str(path), **self._where(self._dcp.load))
        self._set_state(self.pipe, self.optimizer, state["model"], state["optim"])
        own = path / f"rank-{self.rank}.pickle"
        if own.exists():
            with open(own, "rb") as file:
                saved = pickle.load(file)
            set_rng_states(saved["rng"])
            self.extra = saved["extra"]
        self._last = self.restored = choice
        return choice

    def step(self, step: int, extra: Any = None) -> bool:
        """Saves the training state as it is after ``step`` steps when ``step`` is a multiple of ``every``;
        returns whether it saved.

        The save is asynchronous where PyTorch has ``torch.distributed.checkpoint.async_save``: the tensors are
        copied to CPU memory and the call returns while a thread writes them; a save still in flight is waited
        for first. ``extra`` (picklable, per rank: a data loader's position, an LR scheduler's state) comes back
        as :attr:`extra` after :meth:`restore`.

        Raises:
            the error of the previous save, if it failed.
        """
        self._check_open()
        if step % self.every or step == self._last:
            return False
        self.wait()
        self._saves += 1
        path = self.directory / f"step-{step}"
        problem: Optional[Tuple[str, str]] = None
        if self.rank == 0:
            problem = self._clear(path)
        self._raise_everywhere(problem)  # the directory is clear before any rank writes into it
        path.mkdir(parents=True, exist_ok=True)
        write(path / f"rank-{self.rank}.pickle",
               pickle.dumps({"rng": rng_states(self.pipe), "extra": extra, "rank": self.rank, "step": step}))
        model_state, optim_state = self._get_state(self.pipe, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        if self._async_save is not None:
            written: Any = self._async_save(state, checkpoint_id=str(path), **self._where(self._async_save))
        else:  # a PyTorch without async_save: written here, the mark still in the background
            self._dcp.save(state, checkpoint_id=str(path), **self._where(self._dcp.save))
            written = None
        self._pending = self._executor.submit(self._finish, written, step, path, self._saves)
        self._last = step
        return True

    def wait(self) -> None:
        """Waits for the save in flight, if any; raises its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Waits for the save in flight and for every rank's (so the mark of the last checkpoint is written);
        the checkpointer takes no more calls. A collective."""
        if self._closed:
            return
        try:
            self.wait()
            self._agree(None)  # every rank's save is marked before any rank (the store's host, say) goes
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            if self._group is not None:
                try:
                    dist.destroy_process_group(self._group)
                except Exception:  # noqa: BLE001 - the default group went first: nothing left to free
                    pass

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # the job is failing: do not wait for peers that may be gone
            self._closed = True
            self._executor.shutdown(wait=False)

    def checkpoints(self) -> List[int]:
        """The steps of the complete checkpoints in the directory, oldest first."""
        return sorted(step for step, _, complete in listing(self.directory) if complete)

    def __repr__(self) -> str:
        return (f"Checkpointer({str(self.directory)!r}, every={self.every}, keep={self.keep}, "
                f"ranks={'this process' if self.ranks is None else len(self.ranks)})")

    # --- inside ------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Checkpointer is closed; make a new one")

    def _where(self, function: Any) -> Dict[str, Any]:
        """The arguments that tell a DCP function which ranks take part: the checkpointer's group, or none
        (``no_dist``, where this PyTorch's function takes it; older ones see a single process by themselves)."""
        if self._group is not None:
            return {"process_group": self._group}
        try:
            takes = "no_dist" in inspect.signature(function).parameters
        except (TypeError, ValueError):
            takes = False
        return {"no_dist": True} if takes else {}

    def _agree(self, value: Any) -> List[Any]:
        """Every rank's ``value``, in rank order (a collective; ``[value]`` in one process)."""
        if self._group is None:
            return [value]
        values: List[Any] = [None] * len(self.ranks or ())
        dist.all_gather_object(values, value, group=self._group)
        return values

    def _raise_everywhere(self, problem: Optional[Tuple[str, str]], kind: Optional[type] = None) -> None:
        """Raises ``problem`` (an error's type name and message; None: none) on every rank, whichever rank found
        it (a collective across ranks)."""
        found = [p for p in self._agree(problem) if p is not None]
        if not found:
            return
        name, message = found[0]
        if len(found) > 1 and any(p != found[0] for p in found):
            message += f" (and {len(found) - 1} other rank(s) found problems too)"
        error = kind or {"ValueError": ValueError, "OSError": OSError, "RuntimeError": RuntimeError}.get(name, OSError)
        raise error(message)

    def _clear(self, path: Path) -> Optional[Tuple[str, str]]:
        """On the first rank, before a save into ``path``: removes what a dead attempt left (directories without a
        mark) and any earlier ``path`` (its mark first); returns the problem, if any, for every rank to raise."""
        for stale in self._stale:
            shutil.rmtree(stale, ignore_errors=True)
        self._stale = []
        try:
            (path / MARK).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            return "OSError", f"cannot remove the mark of the earlier checkpoint {path}: {exc}"
        shutil.rmtree(path, ignore_errors=True)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return "OSError", f"cannot make the checkpoint directory {path}: {exc}"
        return None

    def _finish(self, written: Any, step: int, path: Path, number: int) -> None:
        """On the checkpointer's thread: waits for this rank's write; the rank that finishes last marks the
        checkpoint complete and removes the oldest beyond ``keep`` (see [Note: complete checkpoints])."""
        if written is not None:
            result = getattr(written, "upload_completion", written)  # AsyncSaveResponse (torch 2.9+) or Future
            result.result()
        if self._store is not None:
            key = f"saved/{number}"
            if int(self._store.add(key, 1)) < len(self.ranks or ()):
                return
            try:
                self._store.delete_key(key)
            except RuntimeError:  # a store without delete_key: the key stays
                pass
        tmp = path / f".{MARK}.tmp"
        write(tmp, json.dumps({"step": step, "ranks": 1 if self.ranks is None else len(self.ranks),
                                "torch": torch.__version__}).encode())
        os.replace(tmp, path / MARK)
        sync_directory(path)
        complete = [(s, p) for s, p, done in listing(self.directory) if done]
        for _, old in sorted(complete)[:-self.keep]:
            try:
                (old / MARK).unlink()  # no longer complete, even if the removal stops half way
            except OSError:
                continue
            shutil.rmtree(old, ignore_errors=True)


def _ranks(pipe: nn.Module, group: Any) -> Optional[Tuple[int, ...]]:
    """The global ranks that save together: ``group``'s, else those of ``pipe``'s multi-process pipeline (the
    whole mesh's), else None (one process)."""
    if group is not None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("group= needs torch.distributed to be initialised")
        return tuple(dist.get_process_group_ranks(group))
    channel = getattr(pipe, "_channel", None)
    if channel is None:
        return None
    return tuple(channel.mesh_ranks)
