"""torchpipe: GPipe pipeline parallelism and data-parallel wrappers for PyTorch."""
from torchpipe.__version__ import __version__

__all__ = ["__version__"]
