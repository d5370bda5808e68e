"""Steps timed against each other on a noisy machine, and what two threads get from its cores right now.

Every benchmark prints figures as ratios to a yardstick measured in the same run. :func:`compare` alternates
the yardstick's step and each variant's (``plain, variant, plain, variant, ...``) after a warm-up, so drift of a
noisy machine hits both sides of each pair, and reports the median of the per-pair ratios. :func:`round_robin`
runs every step once a round, in an order that rotates, so that any two steps can be compared round by round
(:func:`median_ratio`). On CUDA every timed step ends with ``torch.cuda.synchronize``.
"""
import statistics
import threading
import time
from contextlib import closing
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, TypeVar

import torch

from benchmarks.harness.machine import intra_op_threads, synchronize
from benchmarks.harness.output import progress
from benchmarks.harness.steps import Step

__all__ = ["Variant", "Comparison", "compare", "round_robin", "rotated", "median_ratio", "at_once",
           "two_thread_ratio"]


@dataclass
class Variant:
    """A step to time, by name.

    ``threads``: intra-op threads of the calling thread while this step runs
    (``None`` leaves them as they are).
    """

    name: str
    step: Step
    threads: Optional[int] = None


@dataclass
class Comparison:
    """Timings of one variant against the plain step it was interleaved with (seconds)."""

    name: str
    ratio: float
    seconds: float
    plain_seconds: float
    ratios: List[float] = field(default_factory=list)

    def throughput(self, batch: int) -> float:
        return batch / self.seconds

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _timed(variant: Variant, device: torch.device) -> float:
    with intra_op_threads(variant.threads):
        synchronize(device)
        start = time.perf_counter()
        variant.step()
        synchronize(device)
        return time.perf_counter() - start


T = TypeVar("T")


def rotated(items: Sequence[T], by: int) -> List[T]:
    """``items`` starting from its ``by``-th (modulo its length): round ``by``'s order of steps that run once a
    round, so that none always follows the same one."""
    by %= len(items)
    return list(items[by:]) + list(items[:by])


def _timed_rounds(
    variants: Sequence[Variant], rounds: int, warmup: int, device: torch.device, bar: Any, rotate: bool
) -> List[List[float]]:
    """Each variant's step times over ``rounds`` rounds after ``warmup`` untimed ones; a round runs every
    variant once, in their order, or (``rotate``) starting one later each round."""
    times: List[List[float]] = [[] for _ in variants]
    for round in range(warmup + rounds):
        for k in rotated(range(len(variants)), round if rotate else 0):
            seconds = _timed(variants[k], device)
            if round >= warmup:
                times[k].append(seconds)
        bar.update(1)
    return times


def compare(
    plain: Variant,
    variants: Sequence[Variant],
    *,
    rounds: int = 5,
    warmup: int = 1,
    device: Optional[torch.device] = None,
    desc: str = "",
    quiet: bool = False,
) -> List[Comparison]:
    """Times each variant against ``plain``, interleaved in pairs; medians and the median ratio.

    For each variant: ``warmup`` untimed pairs, then ``rounds`` timed pairs
    ``(plain, variant)``. ``ratio`` is the median of the per-pair ratios
    ``variant / plain`` (so drift between pairs cancels); ``seconds`` and
    ``plain_seconds`` are the medians of each side.
    """
    device = device if device is not None else torch.device("cpu")
    results: List[Comparison] = []
    with closing(progress(total=len(variants) * (rounds + warmup), desc=desc, disable=quiet)) as bar:
        for variant in variants:
            plain_times, times = _timed_rounds([plain, variant], rounds, warmup, device, bar, rotate=False)
            ratios = [t / p for t, p in zip(times, plain_times)]
            results.append(Comparison(variant.name, statistics.median(ratios), statistics.median(times),
                                      statistics.median(plain_times), ratios))
    return results


def round_robin(
    variants: Sequence[Variant],
    *,
    rounds: int = 5,
    warmup: int = 1,
    device: Optional[torch.device] = None,
    desc: str = "",
    quiet: bool = False,
    rotate: bool = True,
) -> Dict[str, List[float]]:
    """Each variant's step times (seconds), every variant run once per round, in an order that rotates by one
    each round (no variant always follows the same one; ``rotate=False``: always in the order given).

    Ratios of two variants taken round by round (:func:`median_ratio`) compare steps run seconds apart, for
    any pair, where :func:`compare` compares each variant with the plain step only (variants measured minutes
    apart on a machine whose speed drifts).
    """
    assert len({variant.name for variant in variants}) == len(variants), "the variants need distinct names"
    with closing(progress(total=rounds + warmup, desc=desc, disable=quiet)) as bar:
        timed = _timed_rounds(variants, rounds, warmup, device or torch.device("cpu"), bar, rotate=rotate)
    return {variant.name: times for variant, times in zip(variants, timed)}


def median_ratio(times: Mapping[str, Sequence[float]], name: str, over: str) -> float:
    """The median over rounds of ``name``'s step time / ``over``'s in the same round (of :func:`round_robin`)."""
    return statistics.median(a / b for a, b in zip(times[name], times[over]))


def at_once(first: Step, second: Step) -> Step:
    """A step that runs ``first`` on the calling thread and ``second`` on another thread, at the same time (each
    with the caller's intra-op thread count)."""
    threads = torch.get_num_threads()

    def on_the_other_thread() -> None:
        torch.set_num_threads(threads)  # OpenMP's thread count is per thread: the same as the caller's
        second()

    def step() -> None:
        other = threading.Thread(target=on_the_other_thread)
        other.start()
        first()
        other.join()

    return step


def two_thread_ratio(first: Step, second: Step, *, rounds: int = 5) -> float:
    """What this machine's cores allow right now: the time of ``first`` and ``second`` (two independent
    halves of one piece of work) on two threads at once, over their time one after the other (median of
    interleaved pairs). 0.5 is two free cores; shared or hyper-threaded vCPUs, memory bandwidth and the GIL
    show here as more. A pipeline of two stages at that pace takes this ratio times 2 times the bubble's
    (m + p - 1) / (m p) (its stages each touch half the weights, so it may do better)."""

    def sequential() -> None:
        first()
        second()

    [result] = compare(Variant("one thread", sequential), [Variant("two threads", at_once(first, second))],
                       rounds=rounds, warmup=1, quiet=True)
    return result.ratio
