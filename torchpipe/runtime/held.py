"""What a step holds from a forward to its backward, in bytes, measured on a training step.

[Note: held bytes] A Pipeline's first training step (and the first of each new plan: another number of
micro-batches, a zero-bubble split decided) measures, per (stage, micro-batch) of this rank, the bytes of the
tensors its forward leaves for its backward: what autograd saved (counted through
``torch.autograd.graph.saved_tensors_hooks``), the stage's input leaves and its outputs, each storage once, the
stage's parameters and buffers left out. They are counted when the backward starts, so an output released once
sent (see [Note: released outputs]) counts nothing. A checkpointed micro-batch holds its input's copy and what
selective recomputation kept (see [Note: selective recomputation]); its recomputation's graph, counted the same
way, is held from its ``R`` to its ``B`` only, one micro-batch at a time on a worker. A split backward's ``I``
leaves its ``W`` the gradients ``W`` starts from (see [Note: zero-bubble]), held until ``W``. As the step ends it
counts the gradients it made (of the parameters whose ``.grad`` was None as it began) and takes from the
transport the most bytes its receives posted ahead hold once the messages' layouts are known (across
processes). A backward (its ``B``, or its ``I`` and ``W``) also makes gradients that live only while it runs:
the most of them at once is counted through a hook on each node of the pair's graph (:class:`Temporaries`).
These are the ``sizes``, ``recomputed``, ``deferred``, ``gradients`` and ``temporaries`` of
:func:`~torchpipe.schedule.simulate`, whose ``peak_bytes`` (plus the buffers) predict a schedule's peak: the
bytes a step adds. Not counted: the parameters (held before the step), what an operator's backward allocates
and frees inside itself, and the allocator's slack.
"""
import threading
import time
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    FrozenSet,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
)

import torch
from torch import Tensor, nn

from torchpipe.runtime.release import local
from torchpipe.schedule import Schedule
from torchpipe.schedule.footprint import Footprint

__all__ = ["Holding", "Measured", "MemoryReport", "Temporaries", "kept_tensors", "measuring_time", "report"]


def _storage(tensor: Tensor) -> Optional[Tuple[int, Any]]:
    """``tensor``'s storage as (where, storage); None for one without a storage of its own: a wrapper subclass
    (a collective's result in flight), a meta tensor, a sparse one."""
    inner = local(tensor)
    if type(inner) not in (Tensor, nn.Parameter) or inner.is_meta or inner.layout is not torch.strided:
        return None
    held = inner.untyped_storage()
    return int(held.data_ptr()), held


class Holding:
    """The storages one forward (or recomputation) of a (stage, micro-batch) keeps for its backward."""

    __slots__ = ("storages", "_left_out")

    def __init__(self, left_out: FrozenSet[int]) -> None:
        self.storages: Dict[int, Tuple[Any, int]] = {}
        #: Where the stage's parameters and buffers are: not counted.
        self._left_out = left_out

    def hooks(self) -> ContextManager[Any]:
        """Counts what autograd saves while entered."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: Tensor) -> Tensor:
        self.add([tensor])
        return tensor

    def add(self, tensors: Iterable[Any]) -> None:
        for tensor in tensors:
            if not isinstance(tensor, Tensor):
                continue
            found = _storage(tensor)
            if found is None or found[0] in self._left_out or found[0] == 0:
                continue
            where, storage = found
            # A view counts its own elements, not its base's (a micro-batch of the caller's input).
            seen = local(tensor)
            size = seen.numel() * seen.element_size()
            _, most = self.storages.get(where, (storage, 0))
            self.storages[where] = (storage, max(most, size))

    def bytes(self, besides: Optional["Holding"] = None) -> int:
        """The bytes held (as they are now: a released storage counts nothing), each storage once, less those
        that ``besides`` holds too."""
        skip = besides.storages if besides is not None else {}
        return sum(min(int(storage.nbytes()), size) for where, (storage, size) in self.storages.items()
                   if where not in skip)


def _unpack(tensor: Tensor) -> Tensor:
    return tensor


class Temporaries:
    """The gradients a (stage, micro-batch)'s backward runs make as they go, the most at once (see [Note: held
    bytes]): a hook on each node of its graph counts the storages of the gradients the node made, until the nodes
    they flow to (those the run executes) have run. A gradient for a leaf (a parameter, the stage's input) counts
    only as it is made: a parameter's goes on to ``.grad``, the step's gradients, counted apart; the input's is the
    message to the stage before. The gradients a run starts from (received, or what ``I`` kept for ``W``) are
    counted elsewhere, so not here, nor where they pass on unchanged (a view, a sum's branches).

    The hooks keep no node of their own alive (only the nodes after theirs, which it holds anyway): a graph that a
    failed step leaves with its hooks on is freed as the graph is. The CPU time they take on the calling thread is
    added to :func:`measuring_time`, which a timed action leaves out."""

    __slots__ = ("most", "_handles", "_pending", "_refs", "_live", "_known")

    def __init__(self, roots: Sequence[Tensor]) -> None:
        began = time.thread_time()
        #: The most bytes of gradients made and not yet taken at once, over the runs so far.
        self.most = 0
        self._pending: Dict[int, List[int]] = {}  # node -> the storages flowing to it
        self._refs: Dict[int, List[int]] = {}  # storage -> [bytes, the nodes yet to take it]
        self._live = 0
        self._known: FrozenSet[int] = frozenset()
        self._handles: List[Any] = []
        nodes: List[Any] = []
        index: Dict[Any, int] = {}
        stack: List[Any] = [root.grad_fn for root in roots if root.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or node in index:
                continue
            index[node] = len(nodes)
            nodes.append(node)
            stack += [following for following, _ in node.next_functions]
        for k, node in enumerate(nodes):
            if _is_leaf_node(node):  # a leaf's node may be another stage's too (a tied parameter)
                continue
            following = [(None, -1) if nxt is None or _is_leaf_node(nxt) else (nxt, index[nxt])
                         for nxt, _ in node.next_functions]
            self._handles.append(node.register_hook(self._hook(k, following)))
        _add_measuring_time(time.thread_time() - began)

    def _hook(self, token: int, following: List[Tuple[Any, int]]) -> Any:
        def made(grad_inputs: Sequence[Optional[Tensor]], grad_outputs: Sequence[Optional[Tensor]]) -> None:
            began = time.thread_time()
            new: Dict[int, int] = {}
            kept: List[Tuple[int, int]] = []
            for (nxt, after), grad in zip(following, grad_inputs):
                found = _storage(grad) if isinstance(grad, Tensor) else None
                if found is None or found[0] == 0:
                    continue
                where, storage = found
                if where not in self._refs and where not in self._known:
                    new[where] = int(storage.nbytes())
                if nxt is not None and _will_run(nxt):
                    kept.append((after, where))
            self.most = max(self.most, self._live + sum(new.values()))
            for after, where in kept:
                entry = self._refs.setdefault(where, [new.get(where, 0), 0])
                if entry[1] == 0:
                    self._live += entry[0]
                entry[1] += 1
                self._pending.setdefault(after, []).append(where)
            for where in self._pending.pop(token, []):  # what this node took is freed as it ends
                entry = self._refs[where]
                entry[1] -= 1
                if entry[1] == 0:
                    self._live -= entry[0]
                    del self._refs[where]
            _add_measuring_time(time.thread_time() - began)

        return made

    def run(self, seeds: Iterable[Any]) -> None:
        """Before each backward run, which starts from the gradients ``seeds``: nothing made yet in it."""
        self._pending, self._refs, self._live = {}, {}, 0
        found = (_storage(seed) for seed in seeds if isinstance(seed, Tensor))
        self._known = frozenset(f[0] for f in found if f is not None)

    def remove(self) -> None:
        """The hooks taken off the graph (after its last run)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._pending, self._refs, self._known = {}, {}, frozenset()


#: Whether the engine's running backward will execute a node (asked from within its hooks; None: this PyTorch
#: cannot tell, and every node is taken to run).
_will_execute: Optional[Callable[[Any], bool]] = getattr(torch._C, "_will_engine_execute_node", None)


def _will_run(node: Any) -> bool:
    return True if _will_execute is None else bool(_will_execute(node))


_measuring = threading.local()


def measuring_time() -> float:
    """The CPU seconds this thread has spent counting a backward's temporaries (:class:`Temporaries`)."""
    return float(getattr(_measuring, "seconds", 0.0))


def _add_measuring_time(seconds: float) -> None:
    _measuring.seconds = measuring_time() + seconds


def _is_leaf_node(node: Any) -> bool:
    """Whether ``node`` accumulates into a leaf (a parameter, a stage's input): ``AccumulateGrad``."""
    return hasattr(node, "variable")


def kept_tensors(selective: Any) -> Iterator[Tensor]:
    """The tensors a selective forward kept for its recomputation (in its first context's storage)."""
    stack: List[Any] = [getattr(getattr(selective, "first", None), "storage", None)]
    while stack:
        value = stack.pop()
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, dict):
            stack += list(value.values())
        elif isinstance(value, (list, tuple)):
            stack += list(value)
        elif hasattr(value, "val"):  # a cached output, wrapped
            stack.append(value.val)


class Measured:
    """One training step's measurement on this rank: per (stage, micro-batch), the bytes its forward held until
    its backward, and what its recomputation's graph added (see [Note: held bytes])."""

    def __init__(self, pairs: Sequence[Tuple[int, int]], shape: Tuple[int, int],
                 modules: Sequence[Optional[nn.Module]], stage_workers: Sequence[int], schedule: Schedule) -> None:
        #: The (stage, micro-batch) pairs of this rank the step runs forwards of.
        self.pairs = tuple(pairs)
        #: The schedule the step ran (its plan's: a plan made again is measured again).
        self.schedule = schedule
        #: The step's micro-batches and checkpointed micro-batches (``checkpoint_stop``).
        self.shape = shape
        self.forwards: Dict[Tuple[int, int], Holding] = {}
        self.recomputations: Dict[Tuple[int, int], Holding] = {}
        #: Per pair: the bytes from its ``F`` to its ``B`` (or ``I``), counted at the backward's start.
        self.held: Dict[Tuple[int, int], int] = {}
        #: Per recomputed pair: the bytes its recomputation's graph added, from its ``R`` to its ``B``.
        self.recomputed: Dict[Tuple[int, int], int] = {}
        #: Per pair whose backward is split: the bytes of the gradients its ``W`` starts from, from its ``I``.
        self.deferred: Dict[Tuple[int, int], int] = {}
        #: Per pair: the most bytes of gradients its backward (``B``, or ``I`` and ``W``) made and had not yet
        #: taken at once (:class:`Temporaries`).
        self.temporaries: Dict[Tuple[int, int], int] = {}
        self._watched: Dict[Tuple[int, int], Temporaries] = {}
        #: Per stage of this rank: the bytes of the parameter gradients the step made (set as it ends).
        self.gradients: Dict[int, int] = {}
        #: Per worker of this rank: the most bytes its transport held at once in receives posted ahead (set as
        #: the step ends).
        self.buffers: Dict[int, int] = {}
        self._left_out: Dict[int, FrozenSet[int]] = {}
        self._workers = sorted({stage_workers[s] for s, _ in self.pairs})
        #: Per stage of this rank, its parameters without a gradient as the step starts (each once).
        self._fresh: Dict[int, List[Tensor]] = {}
        seen: Set[int] = set()
        for s in sorted({s for s, _ in self.pairs}):
            module = modules[s]
            if module is None:
                continue
            fresh = self._fresh[s] = []
            for p in module.parameters():
                if p.requires_grad and p.grad is None and id(p) not in seen:
                    seen.add(id(p))
                    fresh.append(p)

    def holding(self, s: int, module: Optional[nn.Module]) -> Holding:
        """A new count for stage ``s``, whose parameters and buffers (found once per step) are left out."""
        left_out = self._left_out.get(s)
        if left_out is None:
            tensors = list(module.parameters()) + list(module.buffers()) if module is not None else []
            found = (_storage(t) for t in tensors)
            left_out = self._left_out[s] = frozenset(f[0] for f in found if f is not None)
        return Holding(left_out)

    @property
    def complete(self) -> bool:
        """Whether every pair's backward started (a step that failed half-way measured only some)."""
        return bool(self.pairs) and all(pair in self.held for pair in self.pairs)

    def finish(self, s: int, i: int) -> None:
        """Counts the pair's bytes as its backward starts."""
        forward = self.forwards.pop((s, i), None)
        if forward is None:
            return
        self.held[(s, i)] = forward.bytes()
        graph = self.recomputations.pop((s, i), None)
        if graph is not None:
            self.recomputed[(s, i)] = graph.bytes(besides=forward)

    def watch(self, s: int, i: int, roots: Sequence[Tensor], seeds: Iterable[Any]) -> None:
        """Before a backward run of the pair (its ``B``; its ``I``, then its ``W``) from the gradients ``seeds``:
        counts the gradients it makes, through hooks on the graph of ``roots`` (put on at its first run)."""
        watched = self._watched.get((s, i))
        if watched is None:
            watched = self._watched[(s, i)] = Temporaries(roots)
        watched.run(seeds)

    def settle(self, s: int, i: int) -> None:
        """After the pair's last backward run: the most its runs made at once, and the hooks off its graph."""
        watched = self._watched.pop((s, i), None)
        if watched is not None:
            watched.remove()
            self.temporaries[(s, i)] = watched.most

    def defer(self, s: int, i: int, seeds: Iterable[Tensor]) -> None:
        """Counts what the pair's ``I`` left for its ``W``: the gradients ``W`` starts from."""
        kept = Holding(frozenset())
        kept.add(seeds)
        self.deferred[(s, i)] = kept.bytes()

    def end(self, buffered: int) -> None:
        """As the step ends: counts the gradients it made, and takes the most bytes its transport held in
        receives posted ahead (``buffered``)."""
        for s, fresh in self._fresh.items():
            made = Holding(frozenset())
            made.add(p.grad for p in fresh)
            self.gradients[s] = made.bytes()
        self._fresh = {}
        self.buffers = {w: int(buffered) for w in self._workers} if buffered else {}

    def footprint(self) -> Optional[Footprint]:
        """The measurement as ``'auto'`` chooses by (None if the step did not finish)."""
        if not self.complete:
            return None
        return Footprint({k: float(v) for k, v in self.held.items()},
                         {k: float(v) for k, v in self.recomputed.items()},
                         {k: float(v) for k, v in self.deferred.items()},
                         {s: float(v) for s, v in self.gradients.items()},
                         {w: float(v) for w, v in self.buffers.items()},
                         {k: float(v) for k, v in self.temporaries.items()})


@dataclass(frozen=True)
class MemoryReport:
    """What :meth:`torchpipe.Pipeline.memory` tells: this rank's stages' measured bytes and the predicted peak of
    the schedule the pipeline runs (see [Note: held bytes])."""

    #: The schedule the prediction is for.
    schedule: str
    #: Per stage of this rank: the bytes each micro-batch held from its forward to its backward (empty: nothing
    #: measured yet).
    held: Dict[int, Tuple[int, ...]] = field(default_factory=dict)
    #: Per stage of this rank: the bytes each micro-batch's recomputation added until its backward (0: none).
    recomputed: Dict[int, Tuple[int, ...]] = field(default_factory=dict)
    #: Per stage of this rank: the bytes each micro-batch's split backward kept from its ``I`` to its ``W`` (0:
    #: not split): the gradients its ``W`` starts from.
    deferred: Dict[int, Tuple[int, ...]] = field(default_factory=dict)
    #: Per stage of this rank: the bytes of the parameter gradients the measured step made (0 where they
    #: existed before it: not set to None).
    gradients: Dict[int, int] = field(default_factory=dict)
    #: Per worker of this rank: the most bytes its transport held at once in receives posted for messages not
    #: taken yet (none in one process).
    buffers: Dict[int, int] = field(default_factory=dict)
    #: Per worker of this rank: the most bytes a step adds at once, predicted from the figures above: the
    #: activations and gradients as :attr:`~torchpipe.schedule.Simulation.peak_bytes` has them come and go,
    #: and the buffers.
    predicted_peak: Dict[int, int] = field(default_factory=dict)
    #: Per stage of this rank: the most bytes of gradients each micro-batch's backward made on its way (of the
    #: activations it passed through, of the weights before they reached ``.grad``), held while it ran.
    temporaries: Dict[int, Tuple[int, ...]] = field(default_factory=dict)

    @property
    def measured(self) -> bool:
        return bool(self.held)

    def __str__(self) -> str:
        if not self.measured:
            return (f"nothing measured yet: the bytes each stage holds per micro-batch are measured on the first "
                    f"training step (schedule {self.schedule!r})")
        lines = [f"schedule {self.schedule!r}, bytes held per micro-batch from its forward to its backward:"]
        for s, held in self.held.items():
            most = max(self.recomputed.get(s, (0,)), default=0)
            extra = f" (+ {most} while recomputed)" if most else ""
            waiting = max(self.deferred.get(s, (0,)), default=0)
            extra += f" (+ {waiting} from I to W)" if waiting else ""
            making = max(self.temporaries.get(s, (0,)), default=0)
            extra += f" (+ {making} while its backward runs)" if making else ""
            lines.append(f"  stage {s}: {', '.join(str(b) for b in held)}{extra}; "
                         f"its gradients {self.gradients.get(s, 0)}")
        lines += [f"  receives posted ahead on worker {w}: at most {b}" for w, b in self.buffers.items()]
        lines += [f"  predicted peak of worker {w}: {peak} bytes" for w, peak in self.predicted_peak.items()]
        return "\n".join(lines)


def report(measured: Optional[Measured], schedule: Schedule, workers: Sequence[int], name: str) -> MemoryReport:
    """The report of ``measured`` for ``schedule`` (without recomputations: the measured ones are added) on
    ``workers``."""
    footprint = measured.footprint() if measured is not None else None
    if measured is None or footprint is None:
        return MemoryReport(name)
    peaks = footprint.peaks(schedule)
    held, again, deferred, temporaries = footprint.sizes(schedule.stages, schedule.microbatches)
    local = sorted({s for s, _ in measured.pairs})
    return MemoryReport(
        name,
        {s: tuple(int(b) for b in held[s]) for s in local},
        {s: tuple(int(b) for b in again[s]) for s in local},
        {s: tuple(int(b) for b in deferred[s]) for s in local},
        {s: int(measured.gradients.get(s, 0)) for s in local},
        {w: int(b) for w, b in measured.buffers.items()},
        {w: int(peaks[w]) for w in workers},
        {s: tuple(int(b) for b in temporaries[s]) for s in local},
    )
