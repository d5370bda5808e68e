"""Train a small ResNet-style model on synthetic images with GPipe: the README's ``make run``.

What it does, in order:

1. builds a sequential ResNet-style classifier and a synthetic data set
   (noisy copies of one random template per class, so the loss really falls);
2. finds a balance with ``torchpipe_balancing.balance_by_time``;
3. wraps the model in ``torchpipe.GPipe`` on the default devices: ``cuda:0 …``
   when there are enough GPUs, else ``['cpu'] * partitions`` with one intra-op
   thread (one core) per partition;
4. trains for ``--epochs`` with a progress bar;
5. measures, in this same run, the throughput and the peak memory of a train
   step of the pipelined model against the plain model (on CPU the peak
   memory is the peak resident set size of a child process per model);
6. records the timeline of one step and writes ``out/timeline.png`` and
   ``out/timeline.json`` (open the latter in chrome://tracing or
   https://ui.perfetto.dev).

Run: ``python examples/train.py [--epochs 3] [--chunks 4] [--partitions 2] [--no-timeline]``.
"""
import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchpipe
from torchpipe import trace
from torchpipe_balancing import balance_by_time

ROOT = Path(__file__).resolve().parent.parent
CLASSES = 10


# --- the model ---------------------------------------------------------------------------------


class Residual(nn.Module):
    """A basic ResNet block: two 3x3 convolutions and a shortcut (a 1x1 convolution when the shape changes)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inplanes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


def resnet(width: int = 32, blocks: Sequence[int] = (2, 2, 2)) -> nn.Sequential:
    """A small ResNet for 3x32x32 images, as the flat ``nn.Sequential`` GPipe partitions."""
    layers: List[nn.Module] = [
        nn.Conv2d(3, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
    ]
    planes = width
    for stage, count in enumerate(blocks):
        out_planes = width * 2**stage
        for k in range(count):
            layers.append(Residual(planes, out_planes, stride=2 if stage > 0 and k == 0 else 1))
            planes = out_planes
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(planes, CLASSES)]
    return nn.Sequential(*layers)


def synthetic_data(samples: int, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """Noisy copies of one random 3x32x32 template per class: learnable, but not in one step."""
    generator = torch.Generator().manual_seed(seed)
    templates = torch.randn(CLASSES, 3, 32, 32, generator=generator)
    labels = torch.randint(0, CLASSES, (samples,), generator=generator)
    images = templates[labels] + 2.0 * torch.randn(samples, 3, 32, 32, generator=generator)
    return images, labels


# --- measurements ------------------------------------------------------------------------------


def make_models(args: argparse.Namespace, balance: List[int]) -> Tuple[nn.Module, nn.Module]:
    """The plain model and its pipelined twin, with the same initial weights."""
    torch.manual_seed(args.seed)
    plain = resnet(args.width)
    pipelined = torchpipe.GPipe(copy.deepcopy(plain), balance, devices=pick_devices(args.partitions),
                                chunks=args.chunks, checkpoint=args.checkpoint)
    return plain.to(input_device(pipelined)), pipelined


def pick_devices(partitions: int) -> List[torch.device]:
    """``cuda:0 … cuda:n-1`` when there are that many GPUs, else CPU partitions."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= partitions:
        return [torch.device("cuda", j) for j in range(partitions)]
    return [torch.device("cpu")] * partitions


def input_device(model: nn.Module) -> torch.device:
    return model.devices[0] if isinstance(model, torchpipe.GPipe) else next(model.parameters()).device


def output_device(model: nn.Module) -> torch.device:
    return model.devices[-1] if isinstance(model, torchpipe.GPipe) else next(model.parameters()).device


def train_step_fn(model: nn.Module, lr: float) -> Callable[[Tensor, Tensor], float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    src, dst = input_device(model), output_device(model)

    def step(images: Tensor, labels: Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images.to(src)), labels.to(dst))
        loss.backward()
        optimizer.step()
        return float(loss.item())

    return step


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compare_speed(steps: Dict[str, Callable[[Tensor, Tensor], float]], images: Tensor, labels: Tensor,
                  rounds: int) -> Dict[str, float]:
    """Samples per second of each train step, the median of rounds in which the steps alternate."""
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            synchronize()
            start = time.perf_counter()
            step(images, labels)
            synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: len(images) / statistics.median(t) for name, t in times.items()}


def peak_step_memory(model: nn.Module, images: Tensor, labels: Tensor, lr: float, steps: int = 2) -> int:
    """Bytes a train step adds at its peak: CUDA allocator peak, or the peak RSS above the start on CPU."""
    step = train_step_fn(model, lr)
    devices = [d for d in getattr(model, "devices", [input_device(model)]) if d.type == "cuda"]
    if devices:
        step(images, labels)  # warm-up: cuDNN workspaces and lazy state are not the model's memory
        synchronize()
        before = sum(torch.cuda.memory_allocated(d) for d in set(devices))
        for d in set(devices):
            torch.cuda.reset_peak_memory_stats(d)
        for _ in range(steps):
            step(images, labels)
        synchronize()
        return sum(torch.cuda.max_memory_allocated(d) for d in set(devices)) - before
    before = _current_rss()
    for _ in range(steps):
        step(images, labels)
    return max(0, _peak_rss() - before)


def _current_rss() -> int:
    return _proc_status_bytes("VmRSS")


def _peak_rss() -> int:
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over fork and exec, so a child
    # of a large parent would report the parent's size.
    return _proc_status_bytes("VmHWM")


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line (peak memory on CPU needs Linux)")


def measure_peak_in_child(args: argparse.Namespace, balance: List[int], which: str) -> "subprocess.Popen[str]":
    """Starts this script in a fresh process that reports the peak memory of one model's train step."""
    command = [sys.executable, __file__, "--measure-peak", which, "--balance", ",".join(map(str, balance)),
               "--chunks", str(args.chunks), "--partitions", str(args.partitions), "--width", str(args.width),
               "--batch-size", str(args.batch_size), "--checkpoint", args.checkpoint, "--seed", str(args.seed)]
    # Large blocks straight from mmap and back on free (no dynamic threshold, no per-thread arena
    # keeping freed memory), so the resident set tracks live tensors, whichever thread freed them.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)


def child_main(args: argparse.Namespace) -> None:
    """``--measure-peak plain|gpipe``: print one JSON line with the peak step memory."""
    torch.set_num_threads(args.partitions)
    balance = [int(b) for b in args.balance.split(",")]
    plain, pipelined = make_models(args, balance)
    model = plain if args.measure_peak == "plain" else pipelined
    del plain, pipelined
    images, labels = synthetic_data(args.batch_size, seed=args.seed + 1)
    print(json.dumps({"peak": peak_step_memory(model, images, labels, args.lr)}))


# --- the training run --------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    parser.add_argument("--width", type=int, default=32, help="channels of the first stage")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--balance-timeout", type=float, default=1.0, help="seconds balance_by_time may profile")
    parser.add_argument("--speed-rounds", type=int, default=5,
                        help="alternating plain/pipelined steps for the throughput comparison")
    parser.add_argument("--timeline", action=argparse.BooleanOptionalAction, default=True,
                        help="write the timeline of one step to OUT/timeline.png and OUT/timeline.json")
    parser.add_argument("--out", type=Path, default=ROOT / "out", help="folder for the timeline files")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs, tests)")
    parser.add_argument("--measure-peak", choices=["plain", "gpipe"], help=argparse.SUPPRESS)
    parser.add_argument("--balance", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("epochs", "steps_per_epoch", "batch_size", "chunks", "partitions", "speed_rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def main(argv: Sequence[str]) -> None:
    args = parse_args(argv)
    if args.measure_peak:
        child_main(args)
        return
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    model = resnet(args.width)
    devices = pick_devices(args.partitions)
    on_cpu = devices[0].type == "cpu"
    images, labels = synthetic_data(args.epochs * args.steps_per_epoch * args.batch_size, seed=args.seed + 1)

    # Balance: each partition will run with one intra-op thread, so profile the layers that way.
    torch.set_num_threads(1)
    balance = balance_by_time(args.partitions, model, images[: args.batch_size], timeout=args.balance_timeout)
    # CPU workers share the caller's thread count: `partitions` threads give each partition one core.
    torch.set_num_threads(args.partitions if on_cpu else torch.get_num_threads())
    print(f"{len(model)} layers, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
          f"balance_by_time: {balance} on {[str(d) for d in devices]}, chunks={args.chunks}, "
          f"checkpoint={args.checkpoint!r}" + (f", {args.partitions} CPU threads" if on_cpu else ""))

    plain, pipelined = make_models(args, balance)
    step = train_step_fn(pipelined, args.lr)
    batches = [(images[k:k + args.batch_size], labels[k:k + args.batch_size])
               for k in range(0, len(images), args.batch_size)]
    losses: List[float] = []
    progress = tqdm(total=len(batches), desc="training", unit="step", disable=args.no_progress, file=sys.stdout)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        epoch_losses = []
        for x, y in batches[epoch * args.steps_per_epoch:(epoch + 1) * args.steps_per_epoch]:
            epoch_losses.append(step(x, y))
            progress.set_postfix(epoch=epoch, loss=f"{epoch_losses[-1]:.3f}")
            progress.update()
        losses.append(statistics.mean(epoch_losses))
        progress.write(f"epoch {epoch}: mean loss {losses[-1]:.4f}")
    progress.close()
    elapsed = time.perf_counter() - start
    print(f"trained {len(batches)} steps in {elapsed:.1f} s; loss {losses[0]:.4f} -> {losses[-1]:.4f}")

    if args.timeline:
        x, y = batches[0]
        with trace.record_timeline() as timeline:
            step(x, y)
        args.out.mkdir(parents=True, exist_ok=True)
        timeline.save_chrome_trace(args.out / "timeline.json")
        timeline.save_png(args.out / "timeline.png",
                          title=f"one training step: {args.partitions} partitions, {args.chunks} micro-batches, "
                                f"checkpoint={args.checkpoint!r}")
        print(f"timeline of one step ({len(timeline)} tasks): {args.out / 'timeline.png'}, "
              f"{args.out / 'timeline.json'}")

    # Throughput: plain and pipelined train steps alternate, so machine drift hits both alike.
    speed = compare_speed({"plain": train_step_fn(plain, args.lr), "gpipe": step}, *batches[0], args.speed_rounds)
    if on_cpu:
        # One fresh process per model: the peak resident set size is a per-process high-water mark.
        children = {name: measure_peak_in_child(args, balance, name) for name in ("plain", "gpipe")}
        peaks = {}
        for name, child in children.items():
            out, _ = child.communicate()
            if child.returncode != 0:
                raise RuntimeError(f"measuring the peak memory of the {name} model failed (exit {child.returncode})")
            peaks[name] = json.loads(out.strip().splitlines()[-1])["peak"]
        memory_note = "peak RSS above start, one process each"
    else:
        peaks = {"plain": peak_step_memory(plain, *batches[0], args.lr),
                 "gpipe": peak_step_memory(pipelined, *batches[0], args.lr)}
        memory_note = "CUDA max_memory_allocated"
    mib = 2.0**20
    print(f"throughput: GPipe {speed['gpipe']:.0f} samples/s vs plain {speed['plain']:.0f} samples/s "
          f"({speed['gpipe'] / speed['plain']:.2f}x); peak step memory: GPipe {peaks['gpipe'] / mib:.1f} MiB vs "
          f"plain {peaks['plain'] / mib:.1f} MiB ({peaks['gpipe'] / max(peaks['plain'], 1):.2f}x, {memory_note}); "
          f"batch {args.batch_size}, {args.partitions} partitions, chunks {args.chunks}")
    where = f"{args.partitions} CPU cores" if on_cpu else f"{args.partitions} GPUs"
    print(summary(speed["gpipe"] / speed["plain"], peaks["gpipe"] / max(peaks["plain"], 1), where))


def summary(speed: float, memory: float, where: str) -> str:
    """What pipelining bought in this run, in one plain sentence: speed, memory, or neither."""
    faster = speed >= 1.02
    smaller = memory <= 0.9
    said = f"GPipe trained at {speed:.2f}x the plain model's speed in {memory:.2f}x its peak step memory"
    if faster and smaller:
        verdict = "pipelining bought both speed and memory here"
    elif faster:
        verdict = "pipelining bought speed here, at about the same memory"
    elif smaller:
        cost = "about the same speed" if speed >= 0.98 else f"{1 - speed:.0%} less speed"
        verdict = (f"pipelining bought memory here, not speed: {1 / memory:.1f}x the batch (or the model) fits "
                   f"in the same memory, at {cost}")
    else:
        verdict = "pipelining bought neither here: try more micro-batches (--chunks) or checkpointing"
    return f"summary: on {where}, {said}: {verdict}"


if __name__ == "__main__":
    main(sys.argv[1:])
