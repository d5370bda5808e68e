"""A Pipeline on a 2-D DeviceMesh: the pipeline over ``'pp'``, data-parallel replicas over ``'dp'``."""
from typing import Any, NamedTuple, Optional, Tuple

__all__ = ["MeshLayout", "DATA_PARALLEL", "parse_mesh"]

#: The values ``data_parallel=`` takes.
DATA_PARALLEL = ("replicate", "shard")


class MeshLayout(NamedTuple):
    """Where this rank is on a mesh, and the groups it runs on."""

    #: The process group of this rank's pipeline (the ``'pp'`` dimension).
    pipeline: Any
    #: This rank's replica (its index along ``'dp'``) and the number of replicas.
    replica: int
    replicas: int
    #: The global ranks of the whole mesh, in its order.
    ranks: Tuple[int, ...]
    #: The ``'dp'`` sub-mesh (FSDP2 shards over it).
    dp_mesh: Any
    #: ``'replicate'`` or ``'shard'``.
    mode: str


def parse_mesh(mesh: Any, data_parallel: Optional[str], group: Any) -> Optional[MeshLayout]:
    """Checks ``mesh=``, ``data_parallel=`` and ``group=`` together; None without a mesh.

    Raises:
        ValueError: a mesh without exactly the dimensions ``'pp'`` and ``'dp'``, a ``data_parallel`` other
            than ``'replicate'`` or ``'shard'`` (or given without a mesh), or both ``mesh`` and ``group``.
            Every rank passes the same arguments, so every rank raises.
    """
    if mesh is None:
        if data_parallel is not None:
            raise ValueError(
                f"data_parallel={data_parallel!r} needs a mesh: pass mesh=init_device_mesh(device_type, (dp, pp), "
                "mesh_dim_names=('dp', 'pp'))"
            )
        return None
    if group is not None:
        raise ValueError("pass either group= (a pipeline over one process group) or mesh= (pipeline and data "
                         "parallel on a 2-D DeviceMesh), not both")
    mode = "replicate" if data_parallel is None else data_parallel
    if mode not in DATA_PARALLEL:
        raise ValueError(f"data_parallel must be 'replicate' or 'shard', got {data_parallel!r}")
    names = getattr(mesh, "mesh_dim_names", None)
    ndim = getattr(mesh, "ndim", None)
    if ndim != 2 or names is None or sorted(names) != ["dp", "pp"]:
        raise ValueError(
            f"mesh must be a 2-D DeviceMesh with dimensions named 'pp' and 'dp', got "
            f"{'a mesh with dimensions ' + repr(names) if names is not None else type(mesh).__name__}"
            f"{f' ({ndim}-D)' if ndim is not None else ''}; e.g. "
            "init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'pp'))"
        )
    return MeshLayout(
        pipeline=mesh.get_group("pp"),
        replica=mesh.get_local_rank("dp"),
        replicas=mesh.size(names.index("dp")),
        ranks=tuple(int(r) for r in mesh.mesh.flatten().tolist()),
        dp_mesh=mesh["dp"],
        mode=mode,
    )
