"""A Pipeline on a DeviceMesh: the pipeline over ``'pp'``, data-parallel replicas over ``'dp'``, and each stage
split over ``'tp'`` with tensor parallelism (see [Note: tensor parallel stages] in ``tensor_parallel.py``)."""
from typing import Any, NamedTuple, Optional, Tuple

__all__ = ["MeshLayout", "DATA_PARALLEL", "parse_mesh"]

#: The values ``data_parallel=`` takes.
DATA_PARALLEL = ("replicate", "shard")

#: The dimension sets a mesh may have.
_LAYOUTS = (("dp", "pp"), ("pp", "tp"), ("dp", "pp", "tp"))


class MeshLayout(NamedTuple):
    """Where this rank is on a mesh, and the groups it runs on."""

    #: The process group of this rank's pipeline (the ``'pp'`` dimension).
    pipeline: Any
    #: This rank's replica (its index along ``'dp'``) and the number of replicas (1 without ``'dp'``).
    replica: int
    replicas: int
    #: The global ranks of the whole mesh, in its order.
    ranks: Tuple[int, ...]
    #: The ``'dp'`` sub-mesh (FSDP2 shards over it; None without ``'dp'``).
    dp_mesh: Any
    #: ``'replicate'`` or ``'shard'``.
    mode: str
    #: The ``'tp'`` sub-mesh its stages are split over (None without ``'tp'``).
    tp_mesh: Any = None
    #: This rank's index along ``'tp'`` (its lane: the pipelines of one replica, one per tp rank) and their number.
    lane: int = 0
    lanes: int = 1


def parse_mesh(
    mesh: Any, data_parallel: Optional[str], group: Any, tensor_parallel: Any = None
) -> Optional[MeshLayout]:
    """Checks ``mesh=``, ``data_parallel=``, ``group=`` and ``tensor_parallel=`` together; None without a mesh.

    Raises:
        ValueError: a mesh whose dimensions are not ``('dp', 'pp')``, ``('pp', 'tp')`` or ``('dp', 'pp', 'tp')``
            (in any order), a ``'tp'`` dimension without ``tensor_parallel`` or ``tensor_parallel`` without one,
            a ``data_parallel`` other than ``'replicate'`` or ``'shard'`` (or given without a mesh, or
            ``'shard'`` without ``'dp'``), or both ``mesh`` and ``group``. Every rank passes the same
            arguments, so every rank raises.
    """
    if mesh is None:
        if data_parallel is not None:
            raise ValueError(
                f"data_parallel={data_parallel!r} needs a mesh: pass mesh=init_device_mesh(device_type, (dp, pp), "
                "mesh_dim_names=('dp', 'pp'))"
            )
        if tensor_parallel is not None:
            raise ValueError(
                "tensor_parallel= splits each stage over a mesh's 'tp' dimension: pass mesh=init_device_mesh("
                "device_type, (pp, tp), mesh_dim_names=('pp', 'tp')) (or (dp, pp, tp) with 'dp')"
            )
        return None
    if group is not None:
        raise ValueError("pass either group= (a pipeline over one process group) or mesh= (pipeline and data "
                         "parallel on a DeviceMesh), not both")
    mode = "replicate" if data_parallel is None else data_parallel
    if mode not in DATA_PARALLEL:
        raise ValueError(f"data_parallel must be 'replicate' or 'shard', got {data_parallel!r}")
    names = getattr(mesh, "mesh_dim_names", None)
    ndim = getattr(mesh, "ndim", None)
    if names is None or tuple(sorted(names)) not in _LAYOUTS or ndim != len(names):
        raise ValueError(
            f"mesh must be a DeviceMesh with dimensions named ('dp', 'pp'), ('pp', 'tp') or ('dp', 'pp', 'tp'), "
            f"got {'a mesh with dimensions ' + repr(names) if names is not None else type(mesh).__name__}"
            f"{f' ({ndim}-D)' if ndim is not None else ''}; e.g. "
            "init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'pp'))"
        )
    if "tp" in names and tensor_parallel is None:
        raise ValueError(
            "the mesh has a 'tp' dimension but no tensor_parallel= plan says how to split the stages over it: "
            "pass tensor_parallel={'name.of.layer': 'colwise', ...} (or a function of a stage and the tp mesh)"
        )
    if "tp" not in names and tensor_parallel is not None:
        raise ValueError(
            f"tensor_parallel= needs a mesh with a 'tp' dimension, but its dimensions are {tuple(names)!r}; e.g. "
            "init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'tp'))"
        )
    if "dp" not in names and data_parallel == "shard":
        raise ValueError(f"data_parallel='shard' shards over a mesh's 'dp' dimension, which {tuple(names)!r} lacks")
    with_dp, with_tp = "dp" in names, "tp" in names
    return MeshLayout(
        pipeline=mesh.get_group("pp"),
        replica=mesh.get_local_rank("dp") if with_dp else 0,
        replicas=mesh.size(names.index("dp")) if with_dp else 1,
        ranks=tuple(int(r) for r in mesh.mesh.flatten().tolist()),
        dp_mesh=mesh["dp"] if with_dp else None,
        mode=mode,
        tp_mesh=mesh["tp"] if with_tp else None,
        lane=mesh.get_local_rank("tp") if with_tp else 0,
        lanes=mesh.size(names.index("tp")) if with_tp else 1,
    )
