"""Domain type aliases shared by every torchpipe module (defined here once)."""
from typing import Tuple, Union

import torch
from torch import Tensor

__all__ = ["Tensors", "TensorOrTensors", "Device"]

#: A tuple of tensors, the form a micro-batch takes between partitions.
Tensors = Tuple[Tensor, ...]

#: What a layer of a GPipe'd ``nn.Sequential`` takes and returns.
TensorOrTensors = Union[Tensor, Tensors]

#: Anything ``torch.device`` accepts: ``torch.device``, ``'cuda:1'``, ``'cpu'`` or a CUDA index.
Device = Union[torch.device, int, str]
