"""``InputGuard``: the shapes and dtypes an exported graph holds for, checked on every call of the first layer.

``torch.export`` traces with symbolic sizes where it can (the batch and the
sequence dimensions of a language model) and proves the graph right for a range
of each; where the model needs a size fixed (a hidden size, a buffer it slices
to the sequence length) it keeps the example's size or narrows the range. A
call outside that domain could compute garbage without an error, so the first
layer checks its inputs against the domain and refuses others with a message
that says which dimension is out of range and what to do.
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["InputGuard", "Dimension"]

#: One dimension of an input: a fixed size, a symbol (``'s27'``), or an expression of symbols (``('2*s27',)``).
Dimension = Union[int, str, Tuple[str]]


class InputGuard:
    """Checks that the inputs are ones the exported graph holds for; raises ``ValueError`` otherwise.

    Args:
        names: the inputs' names, in order (``['input_ids', 'attention_mask']``).
        dtypes: their dtypes in the example.
        shapes: their dimensions, each a size, a symbol or an expression.
        ranges: for each symbol, the smallest and largest size (None: no
            limit) the graph holds for.
        what: the module, in words, for the messages.
    """

    def __init__(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype],
        shapes: Sequence[Sequence[Dimension]],
        ranges: Dict[str, Tuple[int, Optional[int]]],
        what: str,
    ) -> None:
        self.names = list(names)
        self.dtypes = list(dtypes)
        self.shapes = [list(shape) for shape in shapes]
        self.ranges = dict(ranges)
        self.what = what
        # Each symbol's readable name: where it first occurs (``input_ids.shape[1]``).
        self.labels: Dict[str, str] = {}
        for name, shape in zip(self.names, self.shapes):
            for d, size in enumerate(shape):
                if isinstance(size, str):
                    self.labels.setdefault(size, f"{name}.shape[{d}]")
        self._compound = any(isinstance(size, tuple) for shape in self.shapes for size in shape)

    def __call__(self, input: Any) -> None:
        tensors = (input,) if isinstance(input, Tensor) else input
        if not isinstance(tensors, tuple) or len(tensors) != len(self.names):
            return  # the layer itself says what it takes
        values: Dict[str, int] = {}
        problems: List[str] = []
        for name, tensor, dtype, shape in zip(self.names, tensors, self.dtypes, self.shapes):
            if not isinstance(tensor, Tensor):
                return
            if tensor.dtype != dtype:
                problems.append(f"{name} is {tensor.dtype}, traced with {dtype}")
            if tensor.dim() != len(shape):
                problems.append(f"{name} has {tensor.dim()} dimensions, traced with {len(shape)}")
                continue
            for d, (size, expected) in enumerate(zip(tensor.shape, shape)):
                if isinstance(expected, int):
                    if size != expected:
                        problems.append(f"{name}.shape[{d}] is {size} but the graph holds for {expected} only")
                elif isinstance(expected, str):
                    bound = values.setdefault(expected, size)
                    if bound != size:
                        problems.append(
                            f"{name}.shape[{d}] is {size} but must equal {self.labels[expected]}, which is {bound}"
                        )
        for symbol, size in values.items():
            low, high = self.ranges.get(symbol, (0, None))
            if size < low or (high is not None and size > high):
                allowed = f"{low} to {high}" if high is not None else f"at least {low}"
                problems.append(f"{self.labels[symbol]} is {size} but the graph holds for {allowed}")
        if self._compound and not problems:
            problems += self._check_expressions(tensors, values)
        if problems:
            raise ValueError(
                f"{self.what} was traced with torch.export for inputs {self.domain()}; "
                f"these inputs are outside it: {'; '.join(problems)}. The graph is proven for that domain only. "
                "If the module takes such inputs, convert it again with an example of their sizes and dtypes "
                "(export fixes a dimension that is 1 in the example, and any the model needs fixed; see "
                "docs/language_models.md, 'Shapes')"
            )

    def _check_expressions(self, tensors: Sequence[Tensor], values: Dict[str, int]) -> List[str]:
        import sympy  # type: ignore[import-untyped]  # torch's own dependency; only for derived sizes

        problems: List[str] = []
        for name, tensor, shape in zip(self.names, tensors, self.shapes):
            for d, (size, expected) in enumerate(zip(tensor.shape, shape)):
                if isinstance(expected, tuple):
                    wanted = sympy.sympify(expected[0]).subs({sympy.Symbol(k): v for k, v in values.items()})
                    if wanted.is_number and int(wanted) != size:
                        problems.append(f"{name}.shape[{d}] is {size} but must be {expected[0]} = {int(wanted)}")
        return problems

    def domain(self) -> str:
        """The inputs the graph holds for, in words."""
        parts = []
        for name, dtype, shape in zip(self.names, self.dtypes, self.shapes):
            dims = []
            for size in shape:
                if isinstance(size, int):
                    dims.append(str(size))
                elif isinstance(size, str):
                    low, high = self.ranges.get(size, (0, None))
                    dims.append(f"{low}..{high if high is not None else ''}")
                else:
                    dims.append(size[0])
            parts.append(f"{name}: {str(dtype).replace('torch.', '')}[{', '.join(dims)}]")
        return "(" + "; ".join(parts) + ")"
