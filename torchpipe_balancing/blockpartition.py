"""The exact solver: split a cost sequence into contiguous blocks minimising the largest block.

This is the *linear partition* (or *bottleneck chain partition*) problem.
:func:`solve` finds the smallest bottleneck ``C`` such that ``costs`` splits
into ``partitions`` contiguous, non-empty blocks none of which costs more than
``C``, then picks one such split deterministically.

[Note: exact arithmetic] Float costs are converted to exact rationals
(``fractions.Fraction(float)`` is exact) and then scaled by the common
denominator to Python ints, so every sum, comparison and the binary search run
on exact integers. The result is optimal for the real sums of the costs, not
for one particular order of float rounding, and ties between floats that are
equal as reals are recognised as ties.

How it stays fast (10,000 costs into 64 blocks in milliseconds):

* ``feasible(C)`` is a greedy over prefix sums: each block reaches as far as
  ``C`` allows, found by ``bisect`` in ``O(log n)``, so a check costs
  ``O(partitions * log n)``.
* The optimum lies in ``[lo, lo + max(costs)]`` where
  ``lo = max(max(costs), ceil(total / partitions))``, and it is an integer (in
  the scaled units), so a binary search over that range needs about
  ``log2(max(costs))`` checks, and the smallest feasible integer is exactly
  the optimum (a smaller bottleneck would be a feasible integer too).
"""
from bisect import bisect_left, bisect_right
from fractions import Fraction
from math import lcm
from numbers import Integral, Real
from typing import List, Sequence, Union, cast

__all__ = ["Cost", "solve", "check_partitions"]

#: A layer's cost: any non-negative real number (``int``, ``float``, ``Fraction``, NumPy scalars ...).
Cost = Union[int, float, Real]


def check_partitions(partitions: object, layers: int, what: str = "costs") -> int:
    """Validates a partition count for ``layers`` layers and returns it as an ``int``.

    Raises:
        TypeError: ``partitions`` is not an int.
        ValueError: ``partitions`` is less than 1 or more than ``layers``.
    """
    if isinstance(partitions, bool) or not isinstance(partitions, Integral):
        raise TypeError(f"partitions must be an int, got {type(partitions).__name__} ({partitions!r})")
    partitions = int(partitions)
    if partitions < 1:
        raise ValueError(f"partitions must be at least 1, got {partitions}")
    if partitions > layers:
        raise ValueError(
            f"cannot split {layers} layers ({what}) into {partitions} non-empty partitions; "
            f"pass partitions <= {layers}"
        )
    return partitions


def _to_scaled_ints(costs: Sequence[Cost]) -> List[int]:
    """Converts costs to ints proportional to them, exactly (see [Note: exact arithmetic])."""
    if all(type(c) is int for c in costs):
        ints = cast(Sequence[int], costs)
        if all(c >= 0 for c in ints):  # the common case: exact already, no conversion needed
            return list(ints)

    exact: List[Fraction] = []
    problems: List[str] = []
    for index, cost in enumerate(costs):
        try:
            value = Fraction(cost)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            problems.append(f"costs[{index}] = {cost!r} is not a finite real number")
            continue
        if value < 0:
            problems.append(f"costs[{index}] = {cost!r} is negative")
        exact.append(value)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError("costs must be finite, non-negative numbers: " + "; ".join(problems[:5]) + more)

    denominator = lcm(*{f.denominator for f in exact}) if exact else 1
    return [f.numerator * (denominator // f.denominator) for f in exact]


def solve(costs: Sequence[Cost], partitions: int) -> List[int]:
    """Returns the block sizes of an optimal contiguous split of ``costs`` into ``partitions`` blocks.

    Optimal means that the largest block total is as small as possible. Every
    block is non-empty. Among the optimal splits, the one returned is chosen
    deterministically: each block in turn takes the feasible end that brings
    its total closest to an even share of what is left (ties: the shorter
    block), so equal costs give sizes that differ by at most one where
    possible.

    Args:
        costs: non-negative real numbers, one per layer.
        partitions: the number of blocks, ``1 <= partitions <= len(costs)``.

    Returns:
        ``partitions`` positive ints summing to ``len(costs)``.

    Raises:
        TypeError: ``partitions`` is not an int.
        ValueError: ``partitions`` is out of range, or a cost is negative or not finite.

    Example::

        >>> solve([1, 2, 3, 4, 5, 6, 7, 8, 9], 3)
        [5, 2, 2]
    """
    n = len(costs)
    k = check_partitions(partitions, n)
    values = _to_scaled_ints(costs)

    prefix = [0] * (n + 1)
    for i, v in enumerate(values):
        prefix[i + 1] = prefix[i] + v
    total = prefix[n]
    biggest = max(values)

    def feasible(cap: int) -> bool:
        # Greedy: each block reaches as far as the cap allows. Requires cap >= biggest,
        # so every block advances by at least one layer.
        start = 0
        for _ in range(k):
            start = bisect_right(prefix, prefix[start] + cap, start) - 1
            if start == n:
                return True
        return False

    lo = max(biggest, -(-total // k))
    hi = lo + biggest  # always feasible: the greedy never leaves more than `biggest` slack per block
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid + 1
    return _pick_split(prefix, k, lo)


def _pick_split(prefix: List[int], k: int, cap: int) -> List[int]:
    """A deterministic split into ``k`` non-empty blocks, each totalling at most ``cap``.

    ``need[e]`` is the fewest blocks of total <= ``cap`` that cover layers
    ``e..n-1`` (computed right to left by the same greedy as the feasibility
    check; it does not increase with ``e``). Block ``p`` starting at ``s`` may
    end at ``e`` exactly when its total fits the cap, ``need[e] <= k - p - 1``
    (the rest still fits) and ``n - e >= k - p - 1`` (the rest can stay
    non-empty): an interval of ends, from which we take the one closest to an
    even share of the remaining total.
    """
    n = len(prefix) - 1
    need = [0] * (n + 1)
    for e in range(n - 1, -1, -1):
        reach = bisect_right(prefix, prefix[e] + cap, e) - 1
        assert reach > e, f"cap {cap} is below a single cost at index {e}"
        need[e] = 1 + need[reach]
    assert need[0] <= k, f"cap {cap} needs {need[0]} blocks, more than {k}"

    # need is non-increasing, so the ends with need[e] <= r form a suffix [first_ok(r), n].
    sizes: List[int] = []
    start = 0
    for p in range(k):
        rest = k - p - 1
        if rest == 0:
            sizes.append(n - start)
            break
        lowest = start + 1
        # Smallest e with need[e] <= rest: need is non-increasing, search on its negation.
        lowest = max(lowest, _first_at_most(need, rest, lowest))
        highest = min(bisect_right(prefix, prefix[start] + cap, start) - 1, n - rest)
        assert lowest <= highest, f"no valid end for block {p} from {start} (cap {cap})"
        # Target an even share of what is left, in doubled units to stay in ints.
        target2 = 2 * prefix[start] + (2 * (prefix[n] - prefix[start])) // (k - p)
        # The ends around the target: the last at or below it and the first above it.
        below = bisect_right(prefix, target2 // 2, lowest, highest + 1) - 1
        candidates = [e for e in (below, below + 1) if lowest <= e <= highest] or [lowest]
        best = min(candidates, key=lambda e: (abs(2 * prefix[e] - target2), e))
        # Zero costs make several ends equally good: among them, even out the layer counts.
        first = bisect_left(prefix, prefix[best], lowest, highest + 1)
        last = bisect_right(prefix, prefix[best], lowest, highest + 1) - 1
        even2 = 2 * start + (2 * (n - start)) // (k - p)
        end = min(max(even2 // 2, first), last)  # the nearest end to half of even2, ties: the shorter
        sizes.append(end - start)
        start = end
    return sizes


def _first_at_most(need: List[int], bound: int, lo: int) -> int:
    """The smallest ``e >= lo`` with ``need[e] <= bound`` (``need`` is non-increasing)."""
    hi = len(need) - 1  # need[n] == 0 <= bound
    negated = _Negated(need)
    return max(lo, bisect_left(negated, -bound, lo, hi))


class _Negated:
    """A read-only view of ``-values[i]``, so ``bisect`` can search a non-increasing list."""

    def __init__(self, values: List[int]) -> None:
        self.values = values

    def __getitem__(self, index: int) -> int:
        return -self.values[index]

    def __len__(self) -> int:
        return len(self.values)
