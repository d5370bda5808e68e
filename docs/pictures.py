"""Draws the schedule pictures of docs/schedules.md from real steps (docs/_static/schedule-*.png).

Each picture is the timeline of one training step recorded with
``torchpipe.trace.record_timeline()`` after a warm-up step: a 16-layer,
1024-wide Linear+ReLU MLP, a batch of 512 in 4 micro-batches, MSE loss, every
stage on ``'cpu'`` with one intra-op thread per worker. Run it from the
repository root::

    python docs/pictures.py            # writes docs/_static/schedule-*.png
    python docs/pictures.py zbv        # only the pictures whose name starts so

On a CPU the boxes' widths wobble from run to run; their order and the gaps
between them (the bubbles) are the schedule's.

The language-model pictures of docs/language_models.md are drawn by the
example itself, from the repository root (it writes a Chrome trace beside
each PNG; only the PNGs are kept)::

    python examples/train_lm.py --timeline docs/_static/timeline-lm.png
    torchrun --standalone --nproc-per-node 2 examples/train_lm.py --distributed \
        --timeline docs/_static/timeline-lm-distributed.png
"""
import os
import platform
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torchpipe  # noqa: E402
from torchpipe import trace  # noqa: E402

OUT = ROOT / "docs" / "_static"
CHUNKS = 4
BATCH = 512
WIDTH = 1024


def mlp(layers: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    modules = []
    for _ in range(layers):
        modules += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*modules)


def balance(stages: int, layers: int = 32) -> list:
    return [layers // stages] * stages


def wanted(name: str) -> bool:
    """Whether the command line asks for picture ``name`` (no argument: all of them)."""
    return not sys.argv[1:] or any(name.startswith(prefix) for prefix in sys.argv[1:])


def record(name: str, pipe: nn.Module, title: str, gpipe: bool = False) -> None:
    if not wanted(name):
        return
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)

    def step() -> None:
        if gpipe:
            nn.functional.mse_loss(pipe(x), y).backward()
        else:
            pipe.step(x, y)

    step()  # warm-up: workers started, memory allocated
    with trace.record_timeline() as timeline:
        step()
    path = OUT / f"schedule-{name}.png"
    timeline.save_png(path, title=title)
    print(f"{path.relative_to(ROOT)}: {len(timeline)} tasks")


def main() -> None:
    torch.set_num_threads(2)  # split between the two workers: one intra-op thread each
    loss = nn.functional.mse_loss
    cpu2 = ["cpu", "cpu"]
    for schedule in ("gpipe", "1f1b", "zero_bubble"):
        if not wanted(schedule):
            continue
        pipe = torchpipe.Pipeline(mlp(), balance(2), chunks=CHUNKS, schedule=schedule, loss_fn=loss, devices=cpu2)
        record(schedule, pipe, f"Pipeline, schedule='{schedule}': 2 stages, {CHUNKS} micro-batches")
    for schedule in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev"):
        if not wanted(schedule):
            continue
        # The loop placement: one worker per entry of devices; the V: half the stages.
        pipe = torchpipe.Pipeline(mlp(), balance(4), chunks=CHUNKS, schedule=schedule, loss_fn=loss, devices=cpu2)
        record(schedule, pipe, f"Pipeline, schedule='{schedule}': 4 stages on 2 workers, {CHUNKS} micro-batches")
    pipe = torchpipe.Pipeline(mlp(), balance(2), chunks=CHUNKS, schedule="1f1b", loss_fn=loss, devices=cpu2,
                              checkpoint="always")
    record("1f1b-checkpoint", pipe, f"Pipeline, schedule='1f1b', checkpoint='always': 2 stages, {CHUNKS} micro-batches")
    model = torchpipe.GPipe(mlp(), balance(2), devices=cpu2, chunks=CHUNKS, checkpoint="except_last")
    record("gpipe-checkpoint", model, f"GPipe, checkpoint='except_last': 2 partitions, {CHUNKS} micro-batches",
           gpipe=True)
    print(f"machine: {cpu()}, {os.cpu_count()} cores, torch {torch.__version__}")


def cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
