"""Symbolic sizes in an exported graph, each read from the nearest tensor that has it (see [Note: export])."""
import heapq
import operator
from typing import Any, Dict, Optional, Set, Tuple

import torch
from torch import Tensor, fx

from torchpipe.sequential.trace import SCOPE

__all__ = ["SymbolicSizes", "symbol_of"]


def symbol_of(value: Any) -> Any:
    """The sympy expression of a symbolic int, or None."""
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return None


_ARITHMETIC = frozenset({
    operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod, operator.neg,
    operator.pow,
})


class SymbolicSizes:
    """Each tensor operator reads the symbolic sizes it uses from the nearest tensor that has them.

    See [Note: export]. A size expression (``s0 * s1``) is rebuilt from its
    symbols; one that is not made of ``sym_size`` reads and arithmetic is
    left as it is. Size reads no longer used are removed.
    """

    def __init__(self, graph: fx.Graph, kinds: Dict[fx.Node, type]) -> None:
        self.graph = graph
        self.kinds = kinds
        self.order: Dict[fx.Node, float] = {n: float(i) for i, n in enumerate(graph.nodes)}

    def symbolic(self, node: fx.Node) -> bool:
        return (
            node.op == "call_function" and self.kinds.get(node) is int and symbol_of(node.meta.get("val")) is not None
        )

    def localize(self) -> None:
        for consumer in list(self.graph.nodes):
            if consumer.op != "call_function" or self.symbolic(consumer):
                continue
            made: Dict[fx.Node, Optional[fx.Node]] = {}
            for node in [n for n in consumer.all_input_nodes if self.symbolic(n)]:
                new = self.rebuild(node, consumer, made)
                if new is not None and new is not node:
                    consumer.replace_input_with(node, new)
        for node in reversed(list(self.graph.nodes)):
            if self.symbolic(node) and not node.users and (node.target is _SYM_SIZE or node.target in _ARITHMETIC):
                self.graph.erase_node(node)

    def rebuild(self, node: fx.Node, consumer: fx.Node, made: Dict[fx.Node, Optional[fx.Node]]) -> Optional[fx.Node]:
        """``node`` (a size) computed from tensors near ``consumer``; itself if it is already; None if it cannot be."""
        if node in made:
            return made[node]
        result: Optional[fx.Node] = None
        if node.target is _SYM_SIZE:
            expression = symbol_of(node.meta.get("val"))
            found = self.nearest(consumer, expression) if expression is not None and expression.is_Symbol else None
            if found is not None:
                result = node if found == tuple(node.args) else self.insert(consumer, node, _SYM_SIZE, found)
        elif all(not isinstance(a, fx.Node) or self.symbolic(a) for a in node.args) and not node.kwargs:
            rebuilt = [self.rebuild(a, consumer, made) if isinstance(a, fx.Node) else a for a in node.args]
            if all(r is not None for r in rebuilt):
                same = all(r is a for r, a in zip(rebuilt, node.args))
                result = node if same else self.insert(consumer, node, node.target, tuple(rebuilt))
        made[node] = result
        return result

    def insert(self, consumer: fx.Node, like: fx.Node, target: Any, args: Tuple[Any, ...]) -> fx.Node:
        with self.graph.inserting_before(consumer):
            node = self.graph.call_function(target, args)
        node.meta = {"val": like.meta.get("val"), SCOPE: consumer.meta.get(SCOPE, ())}
        self.kinds[node] = int
        self.order[node] = self.order[consumer] - 0.5
        return node

    def nearest(self, consumer: fx.Node, symbol: Any, limit: int = 400) -> Optional[Tuple[fx.Node, int]]:
        """The tensor nearest before ``consumer`` among its ancestors that has ``symbol`` as a size: (node, dim)."""
        heap = [(-self.order[n], id(n), n) for n in consumer.all_input_nodes if n in self.order]
        heapq.heapify(heap)
        seen: Set[fx.Node] = set()
        while heap and len(seen) < limit:
            _, _, node = heapq.heappop(heap)
            if node in seen:
                continue
            seen.add(node)
            value = node.meta.get("val")
            if isinstance(value, Tensor) and node.op != "get_attr":
                for d, size in enumerate(value.shape):
                    if symbol_of(size) is not None and symbol_of(size) == symbol:
                        return node, d
            for parent in node.all_input_nodes:
                if parent not in seen and parent in self.order:
                    heapq.heappush(heap, (-self.order[parent], id(parent), parent))
        return None


_SYM_SIZE = torch.ops.aten.sym_size.int
