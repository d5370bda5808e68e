"""Tensor parallelism inside each stage: ``Pipeline(mesh=<('dp', 'pp', 'tp') or ('pp', 'tp')>, tensor_parallel=plan)``.

[Note: tensor parallel stages] A mesh with a ``'tp'`` dimension runs, per
replica, one pipeline per tp rank (its lanes): the ranks of a ``'pp'``
sub-group are one lane's stages, and the tp ranks of a stage split it with
DTensor (``torch.distributed.tensor.parallel``), each holding its shards.

- The plan is applied to each of this rank's stages once it is built and
  on its device (a meta-device stage is split on the meta device and then
  materialised, each rank its shards only), before FSDP2 (``data_parallel='shard'`` shards the
  DTensors over ``'dp'`` on top: a 2-D sharding per stage). Its names are
  the plain module's, with ``*`` patterns per name part as
  ``parallelize_module`` takes them; each entry is applied to the modules
  of this rank's stages that it names. The whole plan is checked against the
  whole model first: an entry that names no module, a style other than
  DTensor's or the names below, a sharded size that ``tp`` does not divide.
- A layer made by ``as_sequential`` (a ``TracedLayer``) runs aten operators
  on its parameters, not modules a style could hook, and its graph holds the
  model's global sizes (``expand(b, 2, 2, s, 8)`` for the heads). So there
  the plan names the original model's modules (``model.layers.*.mlp.up_proj``,
  as Hugging Face's plans do), and a style says only how the module's
  parameters are split: colwise along the output (an embedding's width),
  rowwise along the input (an embedding's vocabulary; a bias whole).
  Everything else is DTensor's: the layer computes on DTensors of global
  shape, plain tensors count as replicated (``implicit_replication``), and
  each result of a split parameter that DTensor leaves partial is summed
  there, as the module styles' output hooks do, so no partial value outlives
  the operation that made it. The layer's other parameters (its norms')
  become replicated DTensors. Attention must then be one DTensor can split
  (``attn_implementation='eager'``: its matrix products and softmax);
  ``'sequence_parallel'`` and styles with layouts of their own do not apply.
- A stage's tp ranks compute on the same input, so the first stage's tp
  ranks read the same mini-batch (checked by its size), and only the first
  lane's last stage tells the loss. Every lane runs the same schedule: the
  tp collectives inside a stage pair up because each lane's workers run the
  same actions in the same order.
- Between stages, each tp rank sends to the same tp rank of the next stage:
  plain tensors as they are, a DTensor as its local shard with its
  placements (``distributed/dtensors.py``); gradients come back with theirs.
- Parameters that the plan leaves whole are replicated over ``'tp'``: they
  start as the first tp rank's, and a norm of the gradients counts them on
  it only (a sharded one on every tp rank: its shards).
- A sharded parameter's gradient may come out of DTensor's backward placed
  otherwise (an embedding split on its vocabulary gets a replicated one):
  after each stage's last backward it is placed as its parameter, before
  anything reduces or reads it, so that every shard holds its own part.
"""
import fnmatch
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union, cast

import torch
from torch import nn

from torchpipe.compiling import compile_layers
from torchpipe.partition import place

__all__ = ["TensorParallelPlan", "STYLE_NAMES", "verify_plan", "parallelize_stages", "describe_plan", "replicated",
           "action_context", "settled", "uncompilable", "compile_stage"]

#: A plan: module names (``*`` patterns per name part) to styles, or a function of a stage and the tp mesh.
TensorParallelPlan = Union[Mapping[str, Any], Callable[[nn.Module, Any], nn.Module]]

#: The style names a plan may use in place of a ``ParallelStyle``: DTensor's three, and Hugging Face's names of
#: ``base_model_tp_plan`` and ``_tp_plan`` that have a DTensor equivalent.
STYLE_NAMES = ("colwise", "rowwise", "sequence_parallel", "colwise_gather_output", "embedding_rowwise")


def _styles() -> Dict[str, Callable[[], Any]]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "sequence_parallel": SequenceParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }


def _supported() -> bool:
    try:
        from torch.distributed.tensor.parallel import parallelize_module  # noqa: F401
    except ImportError:
        return False
    return True


def _style(name: str, value: Any) -> Any:
    """The ``ParallelStyle`` of plan entry ``name``."""
    from torch.distributed.tensor.parallel import ParallelStyle

    if isinstance(value, ParallelStyle):
        return value
    if isinstance(value, str) and value in STYLE_NAMES:
        return _styles()[value]()
    raise ValueError(
        f"tensor_parallel[{name!r}] is {value!r}: a plan maps module names to a ParallelStyle "
        f"(ColwiseParallel(), RowwiseParallel(), SequenceParallel(), PrepareModuleInput(...), ...) or to one of "
        f"{', '.join(map(repr, STYLE_NAMES))}"
    )


def _matches(module: nn.Module, pattern: str) -> List[Tuple[str, nn.Module]]:
    """The submodules of ``module`` that ``pattern`` names (``*`` patterns per name part), with their names."""
    found: List[Tuple[str, nn.Module]] = [("", module)]
    for token in pattern.split("."):
        found = [(f"{name}.{child_name}" if name else child_name, child)
                 for name, sub in found for child_name, child in sub.named_children()
                 if fnmatch.fnmatchcase(child_name, token)]
    return found


def verify_plan(module: nn.Module, plan: Any, tp: int, ties: Sequence[Any] = ()) -> Optional[Dict[str, Any]]:
    """Checks ``plan`` against the whole ``module`` (and its tied parameters, ``ties``); the plan with styles
    for names (None: a function).

    Raises:
        ValueError: this PyTorch has no tensor parallelism; an entry that names no module of ``module``, or
            whose style is neither a ``ParallelStyle`` nor one of :data:`STYLE_NAMES`; a size that the style
            shards and ``tp`` does not divide (the layer, its size and ``tp`` named); a tied parameter whose
            holders the plan splits differently (their gradients could not be added up shard by shard).
        TypeError: ``plan`` is neither a mapping nor callable.
    """
    if not _supported():
        raise ValueError(f"tensor_parallel= needs torch.distributed.tensor.parallel, which torch "
                         f"{torch.__version__} lacks; upgrade PyTorch")
    if callable(plan) and not isinstance(plan, Mapping):
        return None
    if not isinstance(plan, Mapping):
        raise TypeError(f"tensor_parallel must be a dict from module names to styles, or a function of a stage and "
                        f"the tp mesh, got {type(plan).__name__}")
    if not plan:
        raise ValueError("tensor_parallel is an empty plan: name the modules to split over 'tp'")
    styles: Dict[str, Any] = {}
    for name, value in plan.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor_parallel's keys are module names of the model, got {name!r}")
        styles[name] = style = _style(name, value)
        matched = _matches(module, name)
        traced_matched = _traced_matches(module, name)
        if not matched and not traced_matched:
            raise ValueError(f"tensor_parallel[{name!r}] names no module of the model (its modules are named "
                             f"as in named_modules(), e.g. {_examples(module)}; in a layer of as_sequential, "
                             "as in the original model)")
        for path, sub in matched:
            _check_divisible(path, sub, style, tp)
        for layer, path, holder in traced_matched:
            _check_traced(name, layer, path, holder, style, tp)
    for tie in ties:
        split = {h.key: _split_dim(module, h.layer, h.path, h.attribute, styles) for h in tie.holders}
        if len(set(split.values())) > 1:
            described = ", ".join(f"{key} {'whole' if dim is None else f'split along dimension {dim}'}"
                                  for key, dim in split.items())
            raise ValueError(f"the plan splits the holders of one tied parameter differently ({described}): split "
                             "them alike (an embedding 'embedding_rowwise' and its head 'colwise' both split the "
                             "vocabulary), or leave both whole")
    return styles


def _split_dim(module: nn.Module, layer: str, path: str, attribute: str, styles: Mapping[str, Any]) -> Optional[int]:
    """The dimension along which the plan splits parameter ``attribute`` of ``module[layer].<path>`` (None:
    whole): the last entry naming the module wins, as its style is applied last."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    name = ".".join(part for part in (layer, path) if part)
    owner = module.get_submodule(name)
    found: Optional[int] = None
    holder = module.get_submodule(layer)
    if _is_traced(holder) and attribute == "weight":  # by the original model's names (see _parallelize_traced)
        for pattern, style in styles.items():
            if any(matched is owner for _, matched in _matches(holder, pattern)):
                kind = _traced_style(pattern, style)
                embedding = _used_by([code.graph for code in _codes(holder)], f"{path}.weight",
                                     torch.ops.aten.embedding.default)
                found = (1 if kind == "colwise" else 0) if embedding else (0 if kind == "colwise" else 1)
        return found
    for pattern, style in styles.items():
        if not any(matched is owner for _, matched in _matches(module, pattern)):
            continue
        found = None
        if isinstance(owner, nn.Linear) and attribute == "weight":
            found = 0 if isinstance(style, ColwiseParallel) else 1 if isinstance(style, RowwiseParallel) else None
        elif isinstance(owner, nn.Embedding) and attribute == "weight":
            found = 1 if isinstance(style, ColwiseParallel) else 0 if isinstance(style, RowwiseParallel) else None
    return found


def _examples(module: nn.Module) -> str:
    names = [name for name, _ in module.named_modules() if name][:4]
    return ", ".join(map(repr, names)) or "none"


def _check_divisible(path: str, module: nn.Module, style: Any, tp: int) -> None:
    """Raises ``ValueError`` where ``style`` shards a size of ``module`` that ``tp`` does not divide."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    sizes: Dict[str, int] = {}
    if isinstance(module, nn.Linear):
        if isinstance(style, ColwiseParallel):
            sizes["out_features"] = module.out_features
        elif isinstance(style, RowwiseParallel):
            sizes["in_features"] = module.in_features
    elif isinstance(module, nn.Embedding):
        if isinstance(style, ColwiseParallel):
            sizes["embedding_dim"] = module.embedding_dim
        elif isinstance(style, RowwiseParallel):
            sizes["num_embeddings"] = module.num_embeddings
    for what, size in sizes.items():
        if size % tp:
            raise ValueError(
                f"{type(style).__name__} splits {path!r} ({type(module).__name__}) along its {what} of {size}, "
                f"which tp = {tp} does not divide: choose a tp that divides it, or leave the layer whole"
            )


def _check_traced(pattern: str, layer: nn.Module, path: str, holder: nn.Module, style: Any, tp: int) -> None:
    """Raises ``ValueError`` where a traced layer's module cannot be split as ``style`` says by ``tp``."""
    kind = _traced_style(pattern, style)
    weight = holder._parameters.get("weight")
    if weight is None or weight.dim() != 2:
        raise ValueError(f"tensor_parallel[{pattern!r}] names {path!r}, which holds no matrix to split (a Linear's "
                         "or an Embedding's weight)")
    graphs = [code.graph for code in _codes(layer)]
    embedding = _used_by(graphs, f"{path}.weight", torch.ops.aten.embedding.default)
    dim = (1 if kind == "colwise" else 0) if embedding else (0 if kind == "colwise" else 1)
    if weight.shape[dim] % tp:
        raise ValueError(
            f"tensor_parallel[{pattern!r}] splits {path!r} ({'an embedding' if embedding else 'a linear map'} of "
            f"weight {tuple(weight.shape)}) along its size {weight.shape[dim]}, which tp = {tp} does not divide: "
            "choose a tp that divides it, or leave the layer whole"
        )


def describe_plan(plan: Any) -> Any:
    """What the ranks compare of a plan (see [Note: ranks agree]): each entry's name and style."""
    if plan is None:
        return None
    if callable(plan) and not isinstance(plan, Mapping):
        return "a function"
    return {str(name): value if isinstance(value, str) else type(value).__name__ for name, value in plan.items()}


def _codes(layer: nn.Module) -> List[Any]:
    """A traced layer's code per mode (``TracedLayer._codes``)."""
    return list(cast(Dict[Any, Any], layer.__dict__["_codes"]).values())


def _is_traced(layer: nn.Module) -> bool:
    from torchpipe.sequential.layer import TracedLayer

    return isinstance(layer, TracedLayer)


def _traced_matches(module: nn.Module, pattern: str) -> List[Tuple[nn.Module, str, nn.Module]]:
    """The parameter holders that ``pattern`` names, by the original model's names, in the traced layers of
    ``module`` (a Sequential or a stage): each with its layer and its name there."""
    found: List[Tuple[nn.Module, str, nn.Module]] = []
    for layer in module.children():
        if _is_traced(layer):
            found += [(layer, path, sub) for path, sub in _matches(layer, pattern)]
    return found


def parallelize_stages(stages: Sequence[Optional[nn.Sequential]], plan: Any, styles: Optional[Dict[str, Any]],
                       tp_mesh: Any, devices: Sequence[torch.device], lane: int) -> List[Optional[nn.Sequential]]:
    """This rank's stages placed on their ``devices`` and split over ``tp_mesh`` by ``plan`` (``styles``: the
    checked mapping; None: ``plan`` is a function of a stage and the mesh); ``lane``: this rank's on ``tp_mesh``.

    A stage built on the meta device is split there and then materialised (see :func:`_materialise`), so that no
    rank ever holds it whole.

    Raises:
        TypeError: a plan function that returned something other than an ``nn.Sequential`` of the stage's
            layers under their names.
    """
    result: List[Optional[nn.Sequential]] = []
    for s, stage in enumerate(stages):
        if stage is None:
            result.append(None)
            continue
        meta = any(t.is_meta for t in list(stage.parameters()) + list(stage.buffers()))
        if not meta:
            stage = cast(nn.Sequential, place(stage, devices[s]))
        made = _parallelize(s, stage, plan, styles, tp_mesh)
        if meta:
            _materialise(made, devices[s], lane)
        result.append(made)
    return result


def _materialise(stage: nn.Module, device: torch.device, lane: int) -> None:
    """Materialises ``stage``, split on the meta device, on ``device``: each tp rank allocates and initialises its
    shards only (``partition.place``). The tp ranks draw from random streams of their own, so that the shards of
    one parameter are not copies of each other (the ranks of a job usually share their seed); what the plan left
    whole is the first tp rank's on every tp rank once the pipeline is set up (``setup.connect_stages``). The
    caller's random state is as before."""
    accelerator = None if device.type == "cpu" else getattr(torch, device.type)
    index = [] if accelerator is None else [device.index if device.index is not None else accelerator.current_device()]
    with torch.random.fork_rng(devices=index, device_type="cuda" if accelerator is None else device.type):
        seed = int(torch.randint(0, 2**62, ())) + lane
        torch.default_generator.manual_seed(seed)
        if accelerator is not None:
            with accelerator.device(index[0]):
                accelerator.manual_seed(seed)
        place(stage, device)


def _parallelize(s: int, stage: nn.Sequential, plan: Any, styles: Optional[Dict[str, Any]],
                 tp_mesh: Any) -> nn.Sequential:
    """Stage ``s`` split over ``tp_mesh`` by ``plan`` (see :func:`parallelize_stages`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if styles is None:
        made = plan(stage, tp_mesh)
        if not isinstance(made, nn.Sequential) or list(made._modules) != list(stage._modules):
            raise TypeError(
                f"tensor_parallel's function returned {type(made).__name__} for stage {s}: it must return the "
                f"stage (an nn.Sequential of layers {list(stage._modules)}), parallelized in place"
            )
        return made
    for name, style in styles.items():
        for _, sub in _matches(stage, name):
            parallelize_module(sub, tp_mesh, style)
    for layer in stage.children():
        if _is_traced(layer):
            _parallelize_traced(layer, styles, tp_mesh)
    return stage


def compile_stage(stage: nn.Sequential, options: Dict[str, Any]) -> None:
    """Compiles each layer of a split ``stage`` with ``torch.compile``'s keyword arguments ``options``, as
    :func:`torchpipe.compiling.compile_layers` does, with two differences that DTensor asks for: shapes are
    static unless ``options`` say ``dynamic`` (its sharding propagation does not take a symbolic batch size
    through a traced layer's views: each micro-batch size compiles once), and the layers that hold an embedding
    split on its vocabulary stay eager, with a warning (see :func:`uncompilable`)."""
    compile_layers(stage, {"dynamic": False, **options}, eager=uncompilable(stage))


def uncompilable(stage: nn.Module) -> List[str]:
    """The layers of ``stage`` that ``torch.compile`` cannot take once split: those holding an embedding table
    split on its rows (the vocabulary), whose lookup DTensor leaves as a masked partial that dynamo does not
    trace (it fails on the first call)."""
    names = []
    for name, layer in stage.named_children():
        graphs = [code.graph for code in _codes(layer)] if _is_traced(layer) else []
        for path, sub in layer.named_modules():
            for attr, param in sub._parameters.items():
                rows = [p for p in getattr(param, "placements", ()) if p.is_shard(0)]
                target = f"{path}.{attr}" if path else attr
                if rows and (isinstance(sub, nn.Embedding)
                             or _used_by(graphs, target, torch.ops.aten.embedding.default)):
                    names.append(name)
    return list(dict.fromkeys(names))


def action_context(stages: Sequence[Optional[nn.Module]]) -> Optional[Callable[[], Any]]:
    """What the actions of tensor-parallel ``stages`` run under: DTensor's implicit replication where a stage
    holds a traced layer (see [Note: tensor parallel stages]), else None."""
    if not any(_is_traced(layer) for stage in stages if stage is not None for layer in stage.children()):
        return None
    from torch.distributed.tensor.experimental import implicit_replication

    return cast(Callable[[], Any], implicit_replication)


def _traced_style(pattern: str, style: Any) -> str:
    """``'colwise'`` or ``'rowwise'``: how a style splits a traced layer's parameters (see [Note: tensor parallel
    stages])."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(style, ColwiseParallel):
        return "colwise"
    if isinstance(style, RowwiseParallel):
        return "rowwise"
    raise ValueError(
        f"tensor_parallel[{pattern!r}] is {type(style).__name__}, which splits a module by hooking its calls; a "
        "layer made by as_sequential calls no modules: give its modules 'colwise', 'rowwise' (or Hugging Face's "
        "'colwise_gather_output', 'embedding_rowwise'), which split their parameters"
    )


def _parallelize_traced(layer: nn.Module, styles: Mapping[str, Any], mesh: Any) -> None:
    """Splits the parameters of a traced layer's modules that ``styles`` names, and has the layer sum what DTensor
    leaves partial after each operation on them (see [Note: tensor parallel stages])."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    graphs = [code.graph for code in _codes(layer)]
    placed: Dict[str, Any] = {}
    for pattern, style in styles.items():
        for path, holder in _matches(layer, pattern):
            kind = _traced_style(pattern, style)
            for attr, param in list(holder._parameters.items()):
                if param is None:
                    continue
                target = f"{path}.{attr}"
                embedding = _used_by(graphs, target, torch.ops.aten.embedding.default)
                if attr == "bias":
                    placement = Shard(0) if kind == "colwise" else Replicate()
                elif param.dim() != 2:
                    raise ValueError(f"tensor_parallel[{pattern!r}] splits {target}, of {param.dim()} "
                                     "dimensions; colwise and rowwise split a matrix (a Linear's or an "
                                     "Embedding's weight)")
                elif embedding:
                    placement = Shard(1) if kind == "colwise" else Shard(0)
                else:
                    placement = Shard(0) if kind == "colwise" else Shard(1)
                holder._parameters[attr] = nn.Parameter(distribute_tensor(param.detach(), mesh, [placement]),
                                                        requires_grad=param.requires_grad)
                placed[target] = placement
    # The layer's other parameters (norms) are whole on every tp rank: replicated DTensors, whose gradients
    # DTensor then places as they are (a plain parameter's would be a DTensor, perhaps partial).
    for holder in layer.modules():
        for attr, param in list(holder._parameters.items()):
            if param is not None and not hasattr(param, "placements"):
                holder._parameters[attr] = nn.Parameter(distribute_tensor(param.detach(), mesh, [Replicate()]),
                                                        requires_grad=param.requires_grad)
    if not placed:
        return
    for graph in graphs:
        users = [user for node in graph.nodes if node.op == "get_attr" and node.target in placed
                 for user in node.users if user.op == "call_function"]
        for user in dict.fromkeys(users):
            _settle_after(graph, user)
    cast(Any, layer)._make_forward()


def _settle_after(graph: Any, node: Any) -> None:
    """Has every use of ``node`` in ``graph`` take its :func:`settled` value."""
    with graph.inserting_after(node):
        summed = graph.call_function(settled, (node,))
    node.replace_all_uses_with(summed, delete_user_cb=lambda use: use is not summed)


def _used_by(graphs: Sequence[Any], target: str, op: Any) -> bool:
    return any(node.op == "get_attr" and node.target == target and any(u.target is op for u in node.users)
               for graph in graphs for node in graph.nodes)


def settled(value: Any) -> Any:
    """``value`` with what is partial of it summed (a DTensor's partial placements made replicated); its gradient
    summed likewise (see :class:`_Settle`)."""
    placements = getattr(value, "placements", None)
    if placements is None or not any(p.is_partial() for p in placements):
        return value
    return _Settle.apply(value)  # type: ignore[no-untyped-call]


def _summed(value: Any) -> Any:
    from torch.distributed.tensor import Replicate

    placements = [Replicate() if p.is_partial() else p for p in value.placements]
    return value.redistribute(value.device_mesh, placements) if placements != list(value.placements) else value


class _Settle(torch.autograd.Function):
    """A partial DTensor summed, and its gradient too: the gradient of a sum over tp ranks is the whole gradient,
    which DTensor's backward may hand over partial (the input gradient of a colwise product) where the forward's
    placement was a partial of another kind (an embedding's masked one), to which it cannot convert."""

    @staticmethod
    def forward(ctx: Any, value: Any) -> Any:
        return _summed(value)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return _summed(grad) if hasattr(grad, "placements") else grad


def replicated(param: Any) -> bool:
    """Whether ``param`` is whole on every tp rank (not a DTensor sharded over ``'tp'``)."""
    placements = getattr(param, "placements", None)
    mesh = getattr(param, "device_mesh", None)
    if placements is None or mesh is None:
        return True
    names = getattr(mesh, "mesh_dim_names", None) or ()
    for dim, placement in enumerate(placements):
        if dim < len(names) and names[dim] == "tp" and placement.is_shard():
            return False
    return True
