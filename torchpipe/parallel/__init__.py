"""Data-parallel wrappers on the shared device-transfer core: DataParallel and TupleParallel."""
from torchpipe.parallel.collate import (
    Batch,
    Tuplewise,
    cat,
    cuda_attrs,
    default_collate,
    recursive_cuda,
    recursive_to,
    tp_collate,
    tuple_fn,
)
from torchpipe.parallel.data_parallel import DataParallel
from torchpipe.parallel.replicate import replicate
from torchpipe.parallel.tuple_parallel import TupleParallel

__all__ = ["DataParallel", "TupleParallel", "replicate", "recursive_cuda", "recursive_to", "cuda_attrs", "Batch",
           "tp_collate", "default_collate", "tuple_fn", "Tuplewise", "cat"]
