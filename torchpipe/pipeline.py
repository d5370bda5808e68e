"""The Pipeline module: a training step that owns the loss, so that it can run any schedule."""
import math
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchpipe import microbatch, trace
from torchpipe.checkpoint import checkpoint_stop, verify_checkpoint
from torchpipe.clip import Exchange
from torchpipe.compiling import CompileOptions, compile_layers, compile_options
from torchpipe.distributed import tensor_parallel as parallelism
from torchpipe.distributed.backend import DistributedBackend
from torchpipe.distributed.channel import Channel, PipelineError
from torchpipe.distributed.dtensors import like
from torchpipe.distributed.mesh import parse_mesh
from torchpipe.distributed.setup import connect_stages, open_channel
from torchpipe.distributed.tensor_parallel import TensorParallelPlan
from torchpipe.partition import (
    cut,
    place,
    resolve_devices,
    verify_balance,
    verify_module,
)
from torchpipe.pipelined import Pipelined
from torchpipe.recompute import RecomputeLike, describe_recompute, verify_recompute
from torchpipe.runtime import Runner, Stages, weight_grad
from torchpipe.runtime.backend import Backend
from torchpipe.runtime.held import MemoryReport, report
from torchpipe.runtime.local import LocalBackend
from torchpipe.runtime.loss import LossSpec, without_backward
from torchpipe.runtime.ties import TiedCopies, find_ties, retie, shared_stages, untie_devices
from torchpipe.schedule import SPLITTING, Schedule
from torchpipe.schedule.auto import AutoTuner
from torchpipe.schedule.footprint import verify_memory_limit
from torchpipe.schedule.measured import Timings, Tuner
from torchpipe.schedule.resolve import ScheduleLike, resolve
from torchpipe.schedule.split import SplitTuner
from torchpipe.skip.layout import inspect_skip_layout, verify_skippables
from torchpipe.state_dict import PlainKeys
from torchpipe.types import Device, TensorOrTensors

__all__ = ["Pipeline", "PipelineError"]




class Pipeline(Pipelined):
    """Trains an ``nn.Sequential`` pipelined over stages with any schedule: forward, loss and backward in one step.

    ``GPipe`` hands its output back and the user calls ``loss.backward()``, so
    every forward must finish before any backward. A ``Pipeline`` owns the
    whole training step, so it can run 1F1B (a stage holds the activations of
    at most as many micro-batches as there are stages), interleaved 1F1B
    (several stages per worker: a smaller bubble) or zero-bubble (each backward
    split in two, the weight half filling the bubbles). The loss and every
    parameter's ``.grad`` are those of ``loss_fn(module(input), target)`` and
    ``loss.backward()`` on the plain module.

    Args:
        module: the ``nn.Sequential`` to pipeline (as for :class:`torchpipe.GPipe`).
        balance: layers per stage, summing to ``len(module)``; ``len(balance)``
            is the number of stages.
        chunks: the number of micro-batches.
        schedule: ``'gpipe'``, ``'1f1b'``, ``'interleaved_1f1b'``, ``'zero_bubble'``,
            ``'looped_bfs'``, ``'interleaved_zero_bubble'``, ``'zbv'``, ``'dualpipev'``
            (see :data:`torchpipe.schedule.NAMES`), ``'auto'`` (the fastest of these for the
            costs measured on the first step: see [Note: auto schedule]), or a
            schedule built with :mod:`torchpipe.schedule` (a
            :class:`~torchpipe.schedule.Schedule`, or one list of actions per
            worker such as ``[['0F0', '0B0'], ['1F0', '1B0']]``) for ``chunks``
            micro-batches.
        loss_fn: ``loss_fn(output, target)`` (or ``loss_fn(output)`` when the
            target is None) of one micro-batch, a single-element tensor. None:
            the module's output is the loss.
        loss_reduction: ``'mean'``: each micro-batch's loss is weighted by its
            share of the samples, so the step's loss is the mini-batch mean
            (``loss_fn`` must average over its micro-batch, as PyTorch's losses
            do by default); ``'sum'``: the micro-batches' losses are added.
        checkpoint: ``'always'``, ``'except_last'`` or ``'never'``, as for GPipe.
        recompute: ``'full'``, ``'selective'`` or ``policy(op) -> bool``: what a
            checkpointed micro-batch recomputes, as for GPipe.
        devices: one device per stage (per worker for several stages per worker:
            the loop-placed and V-shaped names and custom schedules), as for GPipe.
        group: a ``torch.distributed`` process group to run one worker per
            rank; None: one process.
        deferred_batch_norm: as for GPipe.
        mesh: a ``DeviceMesh`` with dimensions ``('dp', 'pp')``, ``('pp', 'tp')``
            or ``('dp', 'pp', 'tp')`` (in any order): the pipeline runs over each
            ``'pp'`` sub-group (as with ``group``), the ranks of a ``'dp'``
            sub-group are data-parallel replicas of the same stages, each
            stepping on its own mini-batch, and the ranks of a ``'tp'``
            sub-group split each stage by ``tensor_parallel``.
        data_parallel: with ``mesh``: ``'replicate'`` (default; whole stages on
            every replica, gradients all-reduced once per step after each
            stage's last backward) or ``'shard'`` (FSDP2 per stage: parameters,
            gradients and optimizer state sharded over ``'dp'``, gathered once
            per step). The loss is the mean over every replica's samples, and
            gradients are the plain module's on all of them.
        loss_weight: ``loss_weight(target)`` of a micro-batch's target: its
            weight in a ``'mean'`` loss (a number or a single-element tensor;
            None: its number of samples). Each micro-batch's loss counts by its
            weight over the whole mini-batch's, every replica's included, so
            ``lambda labels: (labels != -100).sum()`` with a token-level
            ``loss_fn`` gives the plain module's mean over the mini-batch's
            tokens (see [Note: token weights]).
        compile: True, or a dict of ``torch.compile`` keyword arguments:
            each layer of each stage is compiled in place (regional
            compilation; :func:`torchpipe.compiling.compile_layers`), the
            layers of :func:`torchpipe.as_sequential` as whole graphs; the
            state dict keys stay the module's. False: eager.
        tensor_parallel: with a mesh that has ``'tp'``: how each stage is split
            over its tp ranks, as ``parallelize_module`` takes a plan: a dict
            from the module's names (``'3.q_proj'``, ``'*.mlp.down_proj'``) to
            ``ParallelStyle``s or the names ``'colwise'``, ``'rowwise'``,
            ``'sequence_parallel'``, ``'colwise_gather_output'``,
            ``'embedding_rowwise'``; or a function ``fn(stage, tp_mesh)`` that
            parallelizes a stage in place and returns it (see [Note: tensor
            parallel stages]).

    Across processes every rank must pass the same arguments and build the
    same model: the ranks compare them as the pipeline is made, and a
    difference is a ``ValueError`` on every rank (see [Note: ranks agree]).

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, ``chunks`` is not an
            ``int``, or ``loss_weight`` is not callable.
        ValueError: ranks that were given different arguments or models, a
            ``loss_weight`` with ``loss_reduction='sum'``, a bad ``chunks``, ``checkpoint``, ``loss_reduction`` or
            ``schedule`` (every problem of a custom schedule is listed), a
            number of stages that does not fit the schedule's workers, a
            module that repeats a layer or shares a buffer between layers, a
            mesh with other dimensions than those above, a ``data_parallel``
            other than ``'replicate'`` and ``'shard'``, a ``'tp'`` dimension
            without ``tensor_parallel`` or the other way round, or a plan that
            names no module, or splits a size that ``tp`` does not divide.
        BalanceError: ``balance`` does not fit ``module``.
        IndexError: fewer devices than workers.

    Example::

        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        pipe = Pipeline(model, balance=[2, 1], chunks=4, schedule="1f1b",
                        loss_fn=nn.functional.cross_entropy, devices=["cpu", "cpu"])
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        loss = pipe.step(torch.randn(64, 16), torch.randint(0, 4, (64,)))
        optimizer.step(); optimizer.zero_grad()
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Optional[Sequence[int]] = None,
        *,
        chunks: int = 1,
        schedule: ScheduleLike = "1f1b",
        loss_fn: Optional[Callable[..., Tensor]] = None,
        loss_reduction: str = "mean",
        checkpoint: str = "never",
        devices: Optional[Sequence[Device]] = None,
        group: Any = None,
        deferred_batch_norm: bool = False,
        mesh: Any = None,
        data_parallel: Optional[str] = None,
        loss_weight: Optional[Callable[[Any], Any]] = None,
        compile: CompileOptions = False,
        tensor_parallel: Optional[TensorParallelPlan] = None,
        recompute: RecomputeLike = "full",
        memory_limit: Optional[int] = None,
    ) -> None:
        super().__init__()
        if isinstance(chunks, bool) or not isinstance(chunks, int):
            raise TypeError(f"chunks must be an int (the number of micro-batches), got {chunks!r}")
        chunks = microbatch.verify_chunks(chunks)
        checkpoint = verify_checkpoint(checkpoint)
        policy = verify_recompute(recompute, checkpoint)
        limit = verify_memory_limit(memory_limit, schedule)
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if loss_weight is not None and not callable(loss_weight):
            raise TypeError(f"loss_weight must be a function of a micro-batch's target, got {loss_weight!r}")
        if loss_weight is not None and loss_reduction != "mean":
            raise ValueError(
                "loss_weight weighs each micro-batch's loss in a mean (loss_reduction='mean'); with "
                "loss_reduction='sum' the micro-batches' losses are added as they are"
            )
        compiled = compile_options(compile)
        verify_module(module)
        balance = verify_balance(module, balance)
        if not balance:
            raise ValueError("a Pipeline needs at least one stage; the module is empty")
        verify_skippables(module)
        on_mesh = parse_mesh(mesh, data_parallel, group, tensor_parallel)
        styles = None
        if on_mesh is not None and on_mesh.tp_mesh is not None:
            styles = parallelism.verify_plan(module, tensor_parallel, on_mesh.lanes, find_ties(module, balance))
        if on_mesh is not None:
            group = on_mesh.pipeline
        ranks = None
        if group is not None and dist.is_available() and dist.is_initialized():
            ranks = dist.get_world_size(group)
        if isinstance(schedule, str) and schedule in SPLITTING and not weight_grad.supported():
            raise ValueError(
                f"{schedule} needs torch.autograd.graph.GradientEdge, which torch {torch.__version__} lacks; "
                "upgrade PyTorch or choose '1f1b'"
            )
        schedule_for, workers = resolve(schedule, chunks, len(balance), devices, ranks)
        #: A zero-bubble schedule's placement, from the costs of its first steps ([Note: zero-bubble split]).
        self._tuner: Optional[Tuner] = None
        if schedule == "auto":  # see [Note: auto schedule]
            self._tuner = AutoTuner(len(balance), workers, chunks, splitting=weight_grad.supported(),
                                    memory_limit=limit)
            schedule_for = self._tuner.plan
        if schedule == "zero_bubble":
            self._tuner = SplitTuner(len(balance))
            schedule_for = self._tuner.plan
        stage_workers = list(schedule_for(chunks).stage_workers)
        self._channel: Optional[Channel] = None
        if group is None:
            worker_devices = resolve_devices(devices, workers)
            local = set(range(len(balance)))
        else:
            # Before anything that depends on them: every rank was given the same (see [Note: ranks agree]).
            self._channel = open_channel(group, devices, on_mesh, module, {
                "balance": list(balance), "chunks": chunks,
                "schedule": schedule if isinstance(schedule, str) else str(schedule_for(chunks)),
                "checkpoint": checkpoint, "recompute": describe_recompute(recompute),
                "loss_reduction": loss_reduction, "loss_weight": "a function" if loss_weight is not None else None,
                "deferred_batch_norm": deferred_batch_norm,
                "data_parallel": None if on_mesh is None else on_mesh.mode,
                "tensor_parallel": parallelism.describe_plan(tensor_parallel),
                "memory_limit": memory_limit,
            }, workers=workers, stages=len(balance), interleaved=schedule_for(chunks).name == "interleaved_1f1b")
            device = self._channel.device
            worker_devices = [device] * workers
            local = set(schedule_for(chunks).stages_of(self._channel.rank))
        stage_devices = [worker_devices[w] for w in stage_workers]
        module = self._keep_arguments(module, balance, stage_devices, chunks, checkpoint, deferred_batch_norm)
        self.loss_fn = loss_fn
        self.loss_reduction = loss_reduction
        #: ``loss_weight(target)``: each micro-batch's weight in a ``'mean'`` loss (None: its samples).
        self.loss_weight = loss_weight
        self.schedule_name = schedule_for(chunks).name
        self._layer_index = {name: k for k, name in enumerate(module._modules)}
        # Each process builds and keeps only its own stages (on the meta device, see partition.place); layers
        # of several stages may share a parameter (see [Note: tied parameters]).
        ties = find_ties(module, balance)
        all_stages = cut(module, balance)
        layout = inspect_skip_layout(all_stages)
        untie_devices(all_stages, stage_devices, ties)
        tp = on_mesh if on_mesh is not None and on_mesh.tp_mesh is not None else None
        stages: List[Optional[nn.Sequential]] = [  # tensor parallel stages are placed split (see below)
            (stage if tp is not None else cast(nn.Sequential, place(stage, stage_devices[s]))) if s in local else None
            for s, stage in enumerate(all_stages)
        ]
        del all_stages
        if tp is not None:  # see [Note: tensor parallel stages]
            stages = parallelism.parallelize_stages(stages, tensor_parallel, styles, tp.tp_mesh, stage_devices, tp.lane)
        copies = retie(stages, ties)
        if compiled is not None:  # each layer of this rank's stages, in place: the keys stay the module's
            for stage in stages:
                if stage is not None:
                    compile_layers(stage, compiled) if tp is None else parallelism.compile_stage(stage, compiled)
        # The layers are this module's children under their own names, so that state_dict() has the plain
        # module's keys ('3.weight') and parameters() are the layers'.
        for stage in stages:
            for name, layer in stage.named_children() if stage is not None else ():
                if hasattr(self, name) and name not in self._modules:
                    raise ValueError(f"a layer named {name!r} clashes with an attribute of Pipeline; rename it")
                self.add_module(name, layer)
        self._stages = stages
        self._ties = ties
        self.data_parallel = None if on_mesh is None else on_mesh.mode
        placed = Stages(
            stages, stage_devices, stage_workers, worker_devices, layout,
            name=f"Pipeline(balance={balance}, schedule={self.schedule_name!r})",
        )
        placed.share(shared_stages(stages, ties))
        placed.recompute, self.recompute = policy, recompute
        if isinstance(self._tuner, AutoTuner):  # see [Note: held bytes]
            self._tuner.footprint_source = lambda: placed.measured.footprint() if placed.measured else None
        if on_mesh is not None and on_mesh.tp_mesh is not None:
            placed.action_context = parallelism.action_context(stages)
        self._runner = Runner(placed, schedule_for)
        #: Where the steps run: this process, or this rank of several (one code path for both from here on).
        self._backend: Backend
        if self._channel is None:
            if any(len(group) > 1 for group in copies):
                self._runner.hooks.append(TiedCopies(copies))
            self._backend = LocalBackend()
        else:
            connect_stages(self._runner, self._channel, ties, copies, on_mesh)
            self._name_copies_as_their_first_holder()
            self._backend = DistributedBackend(self._channel, self.devices)

    def _name_copies_as_their_first_holder(self) -> None:
        """A rank that holds a copy of a tied parameter but not its first holder's layer also holds the copy
        under the first holder's name (an extra child that holds only it), first: so the copy's first name,
        which the optimizer's state dict and DCP key it by, is the same under every layout."""
        aliases: Dict[str, nn.Module] = {}
        for tie in self._ties:
            first = tie.holders[0]
            if first.layer in self._modules:
                continue
            local = [(h, stage) for stage in self._stages if stage is not None
                     for h in tie.holders if h.layer in stage._modules]
            if not local:
                continue
            holder, stage = local[0]
            aliases.setdefault(first.layer, nn.Module())
            first.attach(aliases[first.layer], holder.get(stage))
        if aliases:
            layers = dict(self._modules)
            self._modules.clear()
            for name in sorted(set(layers) | set(aliases), key=self._layer_index.__getitem__):
                self._modules[name] = layers.get(name, aliases.get(name))

    @property
    def stages(self) -> List[Optional[nn.Sequential]]:
        """The stages, each an ``nn.Sequential`` of consecutive layers on its device (None: on another rank)."""
        return list(self._stages)

    @property
    def rank(self) -> Optional[int]:
        """This process's rank in the pipeline's group (None in one process)."""
        return self._backend.rank

    @property
    def schedule(self) -> Schedule:
        """The schedule of a step of ``chunks`` micro-batches (without recomputations)."""
        return self._runner.schedule(self.chunks)

    def memory(self) -> MemoryReport:
        """This rank's stages' bytes per micro-batch, measured on the first training step, and the predicted
        peak of the schedule this pipeline runs (see [Note: held bytes]); before that step, a report that says
        nothing was measured yet (``str()`` it to read it)."""
        stages = self._runner.stages
        measured = stages.measured
        shape = measured.shape if measured is not None else (self.chunks, 0)
        schedule = self._runner.schedule(shape[0])  # its recomputations are the measured ones
        workers = range(schedule.num_workers) if self._channel is None else [self._channel.rank]
        return report(measured, schedule, list(workers), self.schedule_name)

    # --- steps ---------------------------------------------------------------------------------------

    def step(
        self,
        input: Optional[TensorOrTensors] = None,
        target: Optional[TensorOrTensors] = None,
        *,
        loss_scale: float = 1.0,
    ) -> Tensor:
        """Runs one mini-batch, forward and backward; returns its loss (a 0-dim tensor).

        Every parameter's ``.grad`` accumulates what ``(loss * loss_scale).backward()``
        on the plain module would add. Under ``torch.no_grad()`` or after
        ``eval()`` only the loss is computed. Across processes every rank calls
        ``step``: the input is read on the first stage's rank, the target on the
        last stage's (others may pass None), and every rank returns the loss.

        Args:
            input: the mini-batch's input.
            target: its target (None when ``loss_fn`` takes only the output).
            loss_scale: what the gradients are scaled by (the loss returned is
                not): ``1 / n`` to accumulate the gradients of ``n`` steps as
                the plain ``(loss / n).backward()`` would.

        The loss returned has no graph: the step ran the backward. Its
        ``backward()`` raises an error that says so.
        """
        scale = float(loss_scale)
        if not math.isfinite(scale):
            raise ValueError(f"loss_scale must be a finite number, got {loss_scale!r}")
        spec = LossSpec(self.loss_fn, self.loss_reduction, self.loss_weight, scale)
        training = torch.is_grad_enabled() and self.training
        tuner = self._tuner if training and self._tuner is not None and not self._tuner.decided else None
        timings: Optional[Timings] = Timings() if tuner is not None and tuner.measuring else None
        relayouts: List[float] = []
        started = time.perf_counter()
        with self._batch_norm_statistics(self._local_stages()):
            loss = self._backend.step(
                self._runner, input, target, chunks=self.chunks, loss=spec, training=training,
                module_training=self.training, checkpoint_stop=self._checkpoint_stop(training), timings=timings,
                relayouts=relayouts,
            )
        if tuner is not None:  # see [Note: zero-bubble split]
            exchange = self._backend.exchange
            if timings is not None:
                changed = tuner.record(timings, exchange, self.chunks, relayouts=relayouts)
            else:
                changed = tuner.record_trial(time.perf_counter() - started, exchange, _rows(input))
            if changed:
                self._runner.forget_plans()
                self.schedule_name = self.schedule.name
        return without_backward(loss) if training else loss

    def _local_stages(self) -> List[nn.Sequential]:
        return [stage for stage in self._stages if stage is not None]

    def _checkpoint_stop(self, training: bool) -> Callable[[int], int]:
        def stop(microbatches: int) -> int:
            return checkpoint_stop(self.checkpoint, microbatches, training)

        return stop

    def forward(self, input: Optional[TensorOrTensors]) -> Optional[TensorOrTensors]:
        """Runs the forward alone (no loss, no graph) and returns the module's output, on the last stage's device.

        Across processes every rank calls it; the input is read on the first
        stage's rank, and the output returned on the last stage's (None on the others).
        """
        return self._backend.forward(self._runner, input, chunks=self.chunks, module_training=self.training)

    # --- moving and state -----------------------------------------------------------------------------

    def _exchange(self) -> Optional[Exchange]:
        return self._backend.exchange

    def _counted(self, params: List[nn.Parameter]) -> List[nn.Parameter]:
        # This rank's share of the whole model's norm: a tied parameter on the first holder's copy only,
        # replicated gradients on the first replica only, and a parameter whole on every tp rank on the first
        # tp rank only (see [Note: tensor parallel stages]).
        channel = self._channel
        if channel is not None and channel.replicas > 1 and self.data_parallel == "replicate" and channel.replica:
            return []
        if channel is not None and channel.lane:
            params = [p for p in params if not parallelism.replicated(p)]
        copies = set()
        for tie in self._ties:
            held = [(h, stage) for stage in self._stages if stage is not None
                    for h in tie.holders if h.layer in stage._modules]
            first = [param for h, stage in held if h == tie.holders[0] for param in [h.get(stage)]]
            for h, stage in held:
                param = h.get(stage)
                if not first or param is not first[0]:
                    copies.add(id(param))
        return [p for p in params if id(p) not in copies]

    def full_state_dict(self) -> Dict[str, Any]:
        """The whole module's state dict with the plain module's keys (loadable into it, or any Pipeline).

        Across processes every rank calls it (it is a collective); the first
        stage's rank gets the whole state dict, every other rank an empty dict.
        On a mesh, that is the first replica's first stage's rank (global
        rank 0); sharded parameters are gathered whole.
        """
        merged = self._backend.gather_state(dict(self.state_dict()), self._runner.stages.stage_workers[0])
        if merged is None:
            return {}
        # Ranks hold stages out of order (interleaved schedules): put the keys in the module's layer order.
        return dict(sorted(merged.items(), key=lambda item: self._layer_index.get(item[0].split(".", 1)[0], -1)))

    def gather_timeline(self, timeline: trace.Timeline) -> Optional[trace.Timeline]:
        """Every rank's timeline merged into one, on the first stage's rank (None elsewhere); a collective.

        Record each rank's steps with :func:`torchpipe.trace.record_timeline`,
        then call this on every rank: the merged timeline has a row per rank
        and stage (:meth:`~torchpipe.trace.Timeline.save_chrome_trace`,
        :meth:`~torchpipe.trace.Timeline.save_png`). In one process it returns ``timeline``.
        """
        return self._backend.gather_timeline(timeline, self._runner.stages.stage_workers[0])

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Loads the keys this pipeline (this rank) holds from a plain module's, or any GPipe's, Pipeline's
        or rank's state dict; ``strict`` checks that every key this rank holds is there."""
        held = {PlainKeys.plain(k): v for k, v in state_dict.items()}
        # The keys of the layers this rank runs (a wrong one among them is unexpected, as usual), and of a tied
        # copy held under its first holder's name (see _name_copies_as_their_first_holder).
        own = self.state_dict(keep_vars=True)
        layers = {name for stage in self._stages if stage is not None for name in stage._modules}
        # A whole tensor for a DTensor parameter (tensor parallel, FSDP2) loads as this rank's shards of it.
        mine = {k: like(v, own.get(k)) for k, v in held.items() if k in own or k.split(".", 1)[0] in layers}
        if assign:
            return super().load_state_dict(mine, strict=strict, assign=True)
        return super().load_state_dict(mine, strict=strict)

    def extra_repr(self) -> str:
        return (
            f"balance={self.balance}, devices={[str(d) for d in self.devices]}, chunks={self.chunks}, "
            f"schedule={self.schedule_name!r}, checkpoint={self.checkpoint!r}"
        )




def _rows(input: Optional[TensorOrTensors]) -> int:
    """The batch size of a step's input (0 for none: a rank that does not read it)."""
    if isinstance(input, (tuple, list)):
        input = input[0] if input else None
    return int(input.size(0)) if isinstance(input, Tensor) and input.dim() > 0 else 0
