"""Long skip connections: ``@skippable`` layers ``stash`` a tensor that a distant layer ``pop``-s.

Inside :class:`torchpipe.GPipe` a skip tensor travels straight from the
stashing partition's device to the popping partition's device, never through
the partitions in between, with correct gradients in every checkpoint mode.
Skippable layers also work in a plain ``nn.Sequential``.
"""
from torchpipe.skip.layout import inspect_skip_layout, verify_skippables
from torchpipe.skip.namespace import Namespace
from torchpipe.skip.skippable import Skippable, pop, skippable, stash

__all__ = ["skippable", "stash", "pop", "Namespace", "verify_skippables", "Skippable", "inspect_skip_layout"]
