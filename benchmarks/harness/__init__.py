"""The benchmarks' harness: what every experiment in ``benchmarks/`` shares, one module per job.

- :mod:`~benchmarks.harness.machine`: the machine line every benchmark prints, its cores, the device a
  benchmark runs on, waiting for that device, a block's intra-op threads, whether torchgpipe is here.
- :mod:`~benchmarks.harness.steps`: the training steps that get timed: the plain module's, and the same
  micro-batches run by hand (the micro-batched ideal's yardstick), each with a loss argument; a Pipeline's
  step; the best a pipeline can do over the by-hand step.
- :mod:`~benchmarks.harness.timing`: steps timed in interleaved pairs (:func:`~.timing.compare`) or in rounds
  that run every step once (:func:`~.timing.round_robin`), ratios of medians, and what two threads get from
  this machine's cores right now (the machine line).
- :mod:`~benchmarks.harness.memory`: a process's resident set (now, at its peak, the peak reset) and the peak a
  step adds, on the CPU or on CUDA.
- :mod:`~benchmarks.harness.cpu`: CPU time and context switches per kind of thread.
- :mod:`~benchmarks.harness.processes`: child processes: a free port, a rank's environment, ranks started and
  waited for, a function run in a fresh interpreter.
- :mod:`~benchmarks.harness.output`: progress bars, plain-text tables, JSON results and bar plots.
"""
from pathlib import Path

#: The repository root (benchmarks/..).
ROOT = Path(__file__).resolve().parent.parent.parent
