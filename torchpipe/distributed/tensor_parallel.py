"""Tensor parallelism inside each stage: ``Pipeline(mesh=<('dp', 'pp', 'tp') or ('pp', 'tp')>, tensor_parallel=plan)``.

[Note: tensor parallel stages] A mesh with a ``'tp'`` dimension runs, per
replica, one pipeline per tp rank (its lanes): the ranks of a ``'pp'``
sub-group are one lane's stages, and the tp ranks of a stage split it with
DTensor (``torch.distributed.tensor.parallel``), each holding its shards.

- The plan is applied to each of this rank's stages once it is built and
  on its device, before FSDP2 (``data_parallel='shard'`` shards the
  DTensors over ``'dp'`` on top: a 2-D sharding per stage). Its names are
  the plain module's, with ``*`` patterns per name part as
  ``parallelize_module`` takes them; each entry is applied to the modules
  of this rank's stages that it names. The whole plan is checked against the
  whole model first: an entry that names no module, a style other than
  DTensor's or the names below, a sharded size that ``tp`` does not divide.
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
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from torchpipe.runtime.step import StageHooks, Step

__all__ = ["TensorParallelPlan", "STYLE_NAMES", "verify_plan", "parallelize_stages", "describe_plan", "replicated",
           "GradientPlacements"]

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
        if not matched:
            raise ValueError(f"tensor_parallel[{name!r}] names no module of the model (its modules are named "
                             f"as in named_modules(), e.g. {_examples(module)})")
        for path, sub in matched:
            _check_divisible(path, sub, style, tp)
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


def describe_plan(plan: Any) -> Any:
    """What the ranks compare of a plan (see [Note: ranks agree]): each entry's name and style."""
    if plan is None:
        return None
    if callable(plan) and not isinstance(plan, Mapping):
        return "a function"
    return {str(name): value if isinstance(value, str) else type(value).__name__ for name, value in plan.items()}


def parallelize_stages(stages: Sequence[Optional[nn.Sequential]], plan: Any, styles: Optional[Dict[str, Any]],
                       tp_mesh: Any) -> List[Optional[nn.Sequential]]:
    """This rank's stages split over ``tp_mesh`` by ``plan`` (``styles``: the checked mapping; None: ``plan`` is
    a function of a stage and the mesh).

    Raises:
        TypeError: a plan function that returned something other than an ``nn.Sequential`` of the stage's
            layers under their names.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    result: List[Optional[nn.Sequential]] = []
    for s, stage in enumerate(stages):
        if stage is None:
            result.append(None)
            continue
        if styles is None:
            made = plan(stage, tp_mesh)
            if not isinstance(made, nn.Sequential) or list(made._modules) != list(stage._modules):
                raise TypeError(
                    f"tensor_parallel's function returned {type(made).__name__} for stage {s}: it must return the "
                    f"stage (an nn.Sequential of layers {list(stage._modules)}), parallelized in place"
                )
            result.append(made)
            continue
        for name, style in styles.items():
            for _, sub in _matches(stage, name):
                parallelize_module(sub, tp_mesh, style)
        result.append(stage)
    return result


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


class GradientPlacements(StageHooks):
    """Places each DTensor parameter's gradient as the parameter, after its stage's last backward (see [Note:
    tensor parallel stages]).

    Args:
        stages: this rank's stages, by stage index.
    """

    def __init__(self, stages: Mapping[int, nn.Module]) -> None:
        self.params = {s: [p for p in stage.parameters() if hasattr(p, "placements")] for s, stage in stages.items()}

    def after_last_backward(self, step: Step, stage: int) -> None:
        for param in self.params.get(stage, ()):
            grad = param.grad
            if grad is not None and hasattr(grad, "placements") and grad.placements != param.placements:
                param.grad = grad.redistribute(param.device_mesh, param.placements)  # type: ignore[attr-defined]
