"""torchpipe: GPipe pipeline parallelism and data-parallel wrappers for PyTorch.

Wrap an ``nn.Sequential`` in :class:`GPipe` to train it pipelined over several
devices; see :mod:`torchpipe.skip` for long skip connections,
:mod:`torchpipe_balancing` to find a balance, :mod:`torchpipe.parallel`
for the data-parallel wrappers, and :class:`Checkpointer` for a job that
resumes after a failure.
"""
from torchpipe import schedule, skip, trace, transfer
from torchpipe.__version__ import __version__
from torchpipe.checkpointer import Checkpointer
from torchpipe.context import current_microbatch, is_checkpointing, is_recomputing
from torchpipe.gpipe import GPipe
from torchpipe.parallel import DataParallel, TupleParallel
from torchpipe.partition import BalanceError
from torchpipe.pipeline import Pipeline, PipelineError
from torchpipe.sequential import as_sequential

__all__ = [
    "__version__",
    "GPipe",
    "Pipeline",
    "PipelineError",
    "BalanceError",
    "Checkpointer",
    "as_sequential",
    "current_microbatch",
    "is_checkpointing",
    "is_recomputing",
    "DataParallel",
    "TupleParallel",
    "schedule",
    "skip",
    "trace",
    "transfer",
]
