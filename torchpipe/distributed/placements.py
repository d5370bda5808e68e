"""A tensor-parallel stage's gradients placed as its parameters, after the stage's last backward (see [Note:
tensor parallel stages] in ``distributed/tensor_parallel.py``)."""
from typing import Mapping

from torch import nn

from torchpipe.runtime.step import StageHooks, Step

__all__ = ["GradientPlacements"]


class GradientPlacements(StageHooks):
    """Places each parameter's gradient as the parameter, after its stage's last backward (see [Note: tensor
    parallel stages]): a DTensor parameter's placed as it is, and a plain one's whole (a traced layer's plain
    parameter gets a DTensor gradient from the DTensors it met, possibly partial).

    Args:
        stages: this rank's stages, by stage index.
    """

    def __init__(self, stages: Mapping[int, nn.Module]) -> None:
        self.params = {s: list(stage.parameters()) for s, stage in stages.items()}

    def after_last_backward(self, step: Step, stage: int) -> None:
        for param in self.params.get(stage, ()):
            grad = param.grad
            if grad is None or not hasattr(grad, "placements"):
                continue
            if not hasattr(param, "placements"):
                param.grad = grad.full_tensor()  # type: ignore[attr-defined]
            elif grad.placements != param.placements:
                param.grad = grad.redistribute(param.device_mesh, param.placements)  # type: ignore[attr-defined]
