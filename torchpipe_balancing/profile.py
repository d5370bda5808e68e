"""Per-layer profilers: forward+backward time, and memory kept for backward plus parameters.

Both run the layers of an ``nn.Sequential`` one at a time, feeding each layer
the (detached) output of the previous one, inside :func:`~torchpipe_balancing.sandbox.sandbox`
so the module comes back exactly as it was.

[Note: layer inputs] Each layer gets a fresh input: floating-point tensors are
detached, marked ``requires_grad`` and cloned, so the input is not a leaf (a
first ``ReLU(inplace=True)`` works, as it does inside a pipeline) and the
user's sample is never modified in place. Integer tensors (token ids) are
cloned and passed as they are.

[Note: skips while profiling] Layers of :mod:`torchpipe.skip` (and those of
``torchpipe.as_sequential``) hand tensors to later layers with stash and pop.
Profiled one at a time, each layer runs under a :class:`_SkipTracker`: a popped
tensor is a fresh input like the layer's own (so its backward stops there, as
at a partition boundary), and a stashed tensor is a root of the stashing
layer's backward, as it is in a pipeline, where the popping layer's gradient
comes back to it. ``balance_by_size`` counts a stashed tensor in the stashing
layer's activations (it is held from the stash to the pop), once per storage
like every saved tensor.
"""
import dataclasses
import statistics
import time
import warnings
from typing import Any, Dict, List, Optional, Set, Tuple, cast

import torch
from torch import Tensor, nn

from torchpipe.context import task_context
from torchpipe.skip.namespace import Namespace
from torchpipe.transfer import map_structure, split, tensors_of
from torchpipe.types import TensorOrTensors

__all__ = ["profile_times", "profile_sizes", "LayerSize"]


def _fresh_input(batch: Any) -> Any:
    """A copy of ``batch`` that a layer can consume and differentiate (see [Note: layer inputs])."""

    def fresh(t: Tensor) -> Tensor:
        if t.is_floating_point() or t.is_complex():
            return t.detach().requires_grad_().clone()
        return t.detach().clone()

    return map_structure(lambda x: fresh(x) if isinstance(x, Tensor) else x, batch)


def _detached(batch: Any) -> Any:
    return map_structure(lambda x: x.detach() if isinstance(x, Tensor) else x, batch)


class _SkipTracker:
    """Serves stash and pop while layers are profiled one at a time (see [Note: skips while profiling])."""

    def __init__(self) -> None:
        self.tensors: Dict[Tuple[Namespace, str], Optional[Tensor]] = {}
        #: What the layer being profiled stashed.
        self.stashed: List[Tensor] = []

    def save(self, layer: Any, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        self.tensors[(ns, name)] = tensor
        if tensor is not None:
            self.stashed.append(tensor)

    def load(self, layer: Any, ns: Namespace, name: str) -> Optional[Tensor]:
        try:
            tensor = self.tensors.pop((ns, name))
        except KeyError:
            raise RuntimeError(
                f"{type(layer).__name__} popped {name!r} ({ns}) but no earlier layer stashed it"
            ) from None
        return None if tensor is None else cast(Tensor, _fresh_input(tensor))

    def run(self, layer: nn.Module, inputs: Any) -> Tuple[Any, List[Tensor]]:
        """Runs ``layer`` on ``inputs``; returns its output and the tensors it stashed."""
        self.stashed = []
        with task_context(None, skips=self):
            output = layer(inputs)
        stashed, self.stashed = self.stashed, []
        return output, stashed


def _roots(output: Any, stashed: List[Tensor]) -> List[Tensor]:
    """The tensors a layer's backward starts from: its outputs and what it stashed, each once."""
    roots: Dict[int, Tensor] = {}
    for t in list(tensors_of(output)) + stashed:
        if t.requires_grad:
            roots.setdefault(id(t), t)
    return list(roots.values())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_pass(layers: List[nn.Module], sample: Any, device: torch.device) -> List[float]:
    """Times forward and backward of every layer once; returns seconds per layer."""
    times: List[float] = []
    batch = sample
    skips = _SkipTracker()
    for layer in layers:
        inputs = _fresh_input(batch)
        _synchronize(device)
        start = time.perf_counter()
        output, stashed = skips.run(layer, inputs)
        _synchronize(device)
        forward = time.perf_counter() - start

        roots = _roots(output, stashed)
        grads = [torch.ones_like(t) for t in roots]
        _synchronize(device)
        start = time.perf_counter()
        if roots:
            torch.autograd.backward(roots, grads)
        _synchronize(device)
        backward = time.perf_counter() - start

        times.append(forward + backward)
        batch = _detached(output)
        del inputs, output, stashed, roots, grads
    return times


def profile_times(
    module: nn.Sequential, sample: TensorOrTensors, timeout: float, device: torch.device
) -> List[float]:
    """Median forward+backward seconds of each layer of ``module`` on ``sample``.

    The module must already be on ``device`` in training mode (the caller
    wraps this in :func:`~torchpipe_balancing.sandbox.sandbox`) and ``sample``
    on ``device``.

    A first pass warms up (allocator, kernels, lazy initialisation) and is
    thrown away. Then timed passes run: always one, and more while the next
    one is expected to finish within ``timeout`` seconds of the start. Each
    layer's cost is the median of its measurements, which shrugs off the
    outliers of a busy machine; layers are interleaved within every pass, so
    a slow spell of the machine hits all layers alike.
    """
    layers = list(module)
    began = time.perf_counter()
    measured: List[List[float]] = [[] for _ in layers]
    with torch.enable_grad():
        _one_pass(layers, sample, device)  # warm-up
        last = 0.0
        while not measured[0] or time.perf_counter() - began + last <= timeout:
            started = time.perf_counter()
            for costs, seconds in zip(measured, _one_pass(layers, sample, device)):
                costs.append(seconds)
            last = time.perf_counter() - started
    return [statistics.median(costs) for costs in measured]


@dataclasses.dataclass(frozen=True)
class LayerSize:
    """What one layer holds in memory while a micro-batch waits for its backward."""

    #: Bytes of the tensors autograd saved for backward (parameters and buffers excluded),
    #: deduplicated by storage; on CUDA raised to what the allocator saw if it saw more.
    activation_bytes: int
    #: Bytes of the layer's parameters (each counted once; a parameter an earlier layer holds too, a tied
    #: weight, counts in that layer only).
    parameter_bytes: int
    #: CUDA only: the allocator's peak during the forward, above what was allocated before it.
    cuda_peak_bytes: Optional[int] = None

    def cost(self, param_scale: float) -> float:
        """The memory cost used for balancing: activations plus ``param_scale`` times the parameters."""
        return self.activation_bytes + param_scale * self.parameter_bytes


def _untyped_storage(t: Tensor) -> Optional[torch.UntypedStorage]:
    """The tensor's storage, or None for tensors that have none (sparse, nested, wrapper subclasses)."""
    try:
        return t.untyped_storage()
    except RuntimeError:  # what torch raises for a tensor without one storage (its subclasses too)
        return None


def _storage_key(t: Tensor) -> Tuple[str, int]:
    storage = _untyped_storage(t)
    return ("id", id(t)) if storage is None else (str(t.device), storage.data_ptr())


def _storage_bytes(t: Tensor) -> int:
    storage = _untyped_storage(t)
    return t.numel() * t.element_size() if storage is None else int(storage.nbytes())


def _layer_size(
    layer: nn.Module, inputs: Any, device: torch.device, skips: _SkipTracker, counted: Set[int]
) -> Tuple[LayerSize, Any]:
    """Runs ``layer`` forward on ``inputs`` and measures it; returns the measurement and the output.

    A parameter whose id is in ``counted`` is held by an earlier layer too (a
    tied embedding and output projection): it counts there, not again here.
    """
    # Parameters and buffers are kept alive by the layer, not by the micro-batch.
    own: Set[Tuple[str, int]] = {_storage_key(t) for t in layer.parameters()}
    own |= {_storage_key(t) for t in layer.buffers()}
    parameter_bytes = sum(p.numel() * p.element_size() for p in layer.parameters() if id(p) not in counted)
    counted.update(id(p) for p in layer.parameters())
    before_storages = {_storage_key(t) for t in tensors_of(inputs)}

    saved: Dict[Tuple[str, int], int] = {}

    def pack(t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key not in own:
            saved[key] = _storage_bytes(t)
        return t

    def unpack(t: Tensor) -> Tensor:
        return t

    cuda = device.type == "cuda"
    if cuda:
        # A throw-away forward first: lazy allocations that outlive it (the cuBLAS workspace,
        # cuDNN's) must not be mistaken for memory the graph keeps.
        probe = _SkipTracker()
        probe.tensors = dict(skips.tensors)
        probe.run(layer, _fresh_input(inputs))
        torch.cuda.synchronize(device)
        allocated_before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        output, stashed = skips.run(layer, inputs)
    for t in stashed:  # held from the stash to the pop: count it with the stashing layer, once per storage
        key = _storage_key(t)
        if key not in own:
            saved[key] = _storage_bytes(t)
    activation_bytes = sum(saved.values())
    peak: Optional[int] = None

    if cuda:
        # Cross-check with the allocator: what the forward left allocated, minus outputs that
        # nothing saved, is what the graph keeps. More than the hooks saw means tensors kept
        # outside save_for_backward (e.g. stored on ctx directly), which the hooks miss.
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - allocated_before
        retained = torch.cuda.memory_allocated(device) - allocated_before
        unsaved_outputs: Dict[Tuple[str, int], int] = {}
        for t in tensors_of(output):
            key = _storage_key(t)
            if key not in saved and key not in before_storages and key not in own:
                unsaved_outputs[key] = _storage_bytes(t)
        retained -= sum(unsaved_outputs.values())
        seen_new = sum(n for key, n in saved.items() if key not in before_storages)
        unseen = retained - seen_new
        if unseen > max(1 << 20, seen_new // 10):
            warnings.warn(
                f"{type(layer).__name__} keeps {unseen} bytes for backward that "
                "torch.autograd.graph.saved_tensors_hooks did not see (tensors stored on ctx "
                "directly?); balance_by_size counts the CUDA allocator's figure for it",
                stacklevel=4,
            )
            activation_bytes += unseen

    return LayerSize(activation_bytes, parameter_bytes, peak), output


def profile_sizes(module: nn.Sequential, input: TensorOrTensors, chunks: int, device: torch.device) -> List[LayerSize]:
    """Measures each layer of ``module`` on the first micro-batch of ``input`` split into ``chunks``.

    The module must already be on ``device`` in training mode and ``input``
    on ``device`` (see :func:`profile_times`). Only forward passes run: what
    a layer saves for backward is known when its forward returns.
    """
    microbatch = split(input, chunks)[0]
    sizes: List[LayerSize] = []
    batch: Any = microbatch
    skips = _SkipTracker()
    counted: Set[int] = set()
    with torch.enable_grad():
        for layer in module:
            inputs = _fresh_input(batch)
            size, output = _layer_size(layer, inputs, device, skips, counted)
            sizes.append(size)
            batch = _detached(output)
            del inputs, output
    return sizes
