"""Tensor-parallel benchmark: a Pipeline on a (pp, tp) = (2, 2) mesh against PyTorch's own composition of the
same (``torch.distributed.pipelining`` stages parallelized with ``parallelize_module``, torchtitan's recipe), on
4 gloo ranks, with the plain module in one process as the yardstick.

The model is a stack of MLP blocks (a norm, a Linear up to 4 x the width, GELU, a Linear down, a residual) between
an input and an output Linear, with an MSE loss on ``[batch, sequence, width]``. Two plans split it over ``'tp'``:

- ``replicated``: each block's up colwise and down rowwise; the activations between blocks, and so the messages
  between stages, are whole on every tp rank;
- ``sequence``: sequence parallel as Megatron-LM and torchtitan do it: the norms on a sequence shard
  (``SequenceParallel``), the up's input gathered, the down's output reduce-scattered (``Shard(1)``): a
  message between stages is ``1/tp`` of the replicated one's.

Configurations, all in the same 4 processes (each with one intra-op thread) and rounds: torchpipe and pipelining
with each plan, ``'1f1b'`` / ``Schedule1F1B`` over ``--chunks`` micro-batches; and torchpipe on a ``(dp, pp) =
(2, 2)`` mesh without tensor parallelism (the same world size as 2-D: what the third dimension costs). First, one
step of each library with the same weights and batch: their gradients (made whole) must agree, and the largest
difference is printed. Then ``--rounds`` rounds: the plain step on rank 0 (the others wait), then one step of each
configuration in turn (a barrier between them); the figures are medians over rounds of each step's time, of
plain / step (the speed-up), and of pipelining's step over torchpipe's for the same plan (> 1: torchpipe is
faster). The bytes a stage sends per step: what torchpipe's transport sent as activations (the local shards
with sequence parallel). On 2 CPU cores the 4 processes take turns on the cores: the ratios between
configurations are what to read, not the speed-up.

    python benchmarks/tensor_parallel.py [--rounds 5] [--chunks 4] [--batch 8] [--sequence 64] [--width 128]
                                         [--blocks 4] [--json out.json] [--quick]
"""
import argparse
import copy
import datetime
import fnmatch
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.output import Summary, format_table, save_json  # noqa: E402
from benchmarks.harness.processes import free_port, rank_environment, run_ranks  # noqa: E402

WORLD = 4
PLANS = ("replicated", "sequence")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: List[nn.Module] = [nn.Linear(width, width)] + [Block(width) for _ in range(blocks)]
    return nn.Sequential(*layers, nn.Linear(width, width))


def plan(kind: str, last: int) -> Dict[str, Any]:
    """The tensor-parallel plan of :func:`build`'s model (``last``: the output layer's index)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if kind == "replicated":
        return {"*.up": ColwiseParallel(), "*.down": RowwiseParallel()}
    return {
        "0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),  # into sequence shards
        "*.norm": SequenceParallel(),
        "*.up": ColwiseParallel(input_layouts=Shard(1)),
        "*.down": RowwiseParallel(output_layouts=Shard(1)),
        str(last): ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),  # whole again
    }


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


def _full(tensor: Tensor) -> Tensor:
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


class Config:
    """One configuration on this rank: its step, and its parameters by the plain module's names."""

    def __init__(self, library: str, kind: str, model: nn.Sequential, chunks: int, tp_mesh: Any, dp_mesh: Any,
                 balance: Sequence[int]) -> None:
        self.library, self.kind = library, kind
        self.sent = 0
        if library == "torchpipe":
            import torchpipe

            mesh = dp_mesh if kind == "dp x pp" else tp_mesh
            self.pipe = torchpipe.Pipeline(model, list(balance), chunks=chunks, schedule="1f1b", loss_fn=loss_fn,
                                           mesh=mesh, tensor_parallel=None if kind == "dp x pp" else
                                           plan(kind, len(model) - 1))
            self.position = mesh.get_local_rank("pp")
            self.named = dict(self.pipe.named_parameters())
            self.run: Callable[[Tensor, Tensor], None] = self._torchpipe
        else:
            from torch.distributed import pipelining
            from torch.distributed.tensor.parallel import parallelize_module

            self.position = tp_mesh.get_local_rank("pp")
            start = sum(balance[: self.position])
            names = list(model._modules)[start: start + balance[self.position]]
            part = nn.Sequential()
            for name in names:
                part.add_module(name, model._modules[name])
            for key, style in plan(kind, len(model) - 1).items():  # the modules each entry names, as torchpipe
                for name, module in part.named_modules():
                    if len(name.split(".")) == len(key.split(".")) and fnmatch.fnmatchcase(name, key):
                        parallelize_module(module, tp_mesh["tp"], style)
            stage = pipelining.PipelineStage(part, self.position, 2, torch.device("cpu"),
                                             group=tp_mesh.get_group("pp"))
            self.schedule = pipelining.Schedule1F1B(stage, chunks, loss_fn=loss_fn)
            self.named = dict(part.named_parameters())
            self.run = self._pipelining

    def _torchpipe(self, x: Tensor, y: Tensor) -> None:
        self.pipe.step(x if self.position == 0 else None, y if self.position == 1 else None)

    def _pipelining(self, x: Tensor, y: Tensor) -> None:
        if self.position == 0:
            self.schedule.step(x)
        else:
            self.schedule.step(target=y, losses=[])

    def step(self, x: Tensor, y: Tensor) -> None:
        self.run(x, y)

    def zero(self) -> None:
        for param in self.named.values():
            param.grad = None


def rank_main(rank: int, port: int, args: Dict[str, Any], out: str) -> None:
    """What each of the 4 ranks runs; rank 0 writes the results to ``out``."""
    from torch.distributed.device_mesh import init_device_mesh

    import torchpipe.distributed.transport as transport_module
    from torchpipe.runtime.transport import EdgeKind

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(minutes=10))
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    dp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    width, blocks, chunks = args["width"], args["blocks"], args["chunks"]
    model = build(width, blocks)
    layers = len(model)
    balance = [layers // 2, layers - layers // 2]
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args["batch"], args["sequence"], width, generator=generator)
    y = torch.randn(args["batch"], args["sequence"], width, generator=generator)
    configs: Dict[str, Config] = {}
    for kind in PLANS:
        for library in ("torchpipe", "pipelining"):
            configs[f"{library} {kind}"] = Config(library, kind, copy.deepcopy(model), chunks, tp_mesh, dp_mesh,
                                                  balance)
    configs["torchpipe dp x pp"] = Config("torchpipe", "dp x pp", copy.deepcopy(model), chunks, tp_mesh, dp_mesh,
                                          balance)
    # Bytes sent as activations by torchpipe's transport (the local shards that cross).
    counting: Dict[str, int] = {}
    send = transport_module.DistributedTransport.send

    def counted(self: Any, edge: Any, message: Any) -> None:
        if edge.kind is EdgeKind.ACTIVATION and counting.get("on") is not None:
            from torchpipe.distributed import dtensors

            for tensor in message.tensors:
                if tensor is not None:
                    local, _ = dtensors.split(tensor)
                    counting["bytes"] = counting.get("bytes", 0) + local.numel() * local.element_size()
        send(self, edge, message)

    transport_module.DistributedTransport.send = counted  # type: ignore[method-assign]
    # Gradients first: each library's step on the same weights and batch, made whole and compared.
    differences: Dict[str, float] = {}
    for kind in PLANS:
        ours, theirs = configs[f"torchpipe {kind}"], configs[f"pipelining {kind}"]
        ours.step(x, y)
        theirs.step(x, y)
        worst, compared = 0.0, 0
        for name, param in theirs.named.items():
            mine = ours.named[name]
            if (param.grad is None) != (mine.grad is None):
                raise AssertionError(f"{kind}: {name} has a gradient in one library only")
            if param.grad is not None and mine.grad is not None:
                worst = max(worst, float((_full(param.grad) - _full(mine.grad)).abs().max()))
                compared += 1
        if not compared:
            raise AssertionError(f"{kind}: no gradient to compare on rank {rank}")
        box = [worst]
        everyone: List[List[float]] = [[0.0] for _ in range(WORLD)]
        dist.all_gather_object(everyone, box)
        differences[kind] = max(v[0] for v in everyone)
        ours.zero()
        theirs.zero()
    sent: Dict[str, int] = {}
    for name in ("torchpipe replicated", "torchpipe sequence", "torchpipe dp x pp"):
        counting.clear()
        counting["on"] = 1
        configs[name].step(x, y)
        configs[name].zero()
        sent[name] = counting.get("bytes", 0)
        counting.clear()
    plain_model = build(width, blocks)
    times: Dict[str, List[float]] = {name: [] for name in ["plain", *configs]}
    order = list(configs)
    for round_ in range(args["rounds"]):
        dist.barrier()
        if rank == 0:
            began = time.perf_counter()
            loss_fn(plain_model(x), y).backward()
            times["plain"].append(time.perf_counter() - began)
            plain_model.zero_grad(set_to_none=True)
        for name in order[round_ % len(order):] + order[: round_ % len(order)]:
            dist.barrier()
            began = time.perf_counter()
            configs[name].step(x, y)
            elapsed = [time.perf_counter() - began]
            configs[name].zero()
            slowest: List[List[float]] = [[0.0] for _ in range(WORLD)]
            dist.all_gather_object(slowest, elapsed)
            times[name].append(max(v[0] for v in slowest))
    every: List[Dict[str, int]] = [{} for _ in range(WORLD)]
    dist.all_gather_object(every, sent)
    if rank == 0:
        result = {"times": times, "differences": differences, "sent": every, "args": args,
                  "machine": machine_description()}
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def figures(result: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """Per configuration: the median step, speed-up over plain and, for torchpipe's, pipelining's step over its."""
    times = result["times"]
    plain = times["plain"]
    rows = []
    for name, steps in times.items():
        if name == "plain":
            continue
        rival = name.replace("torchpipe", "pipelining")
        versus = None
        if name.startswith("torchpipe") and rival in times:
            versus = statistics.median(r / t for r, t in zip(times[rival], steps))
        sent = [rank.get(name) for rank in result["sent"]]
        rows.append({"configuration": name, "step_s": statistics.median(steps),
                     "speedup": statistics.median(p / t for p, t in zip(plain, steps)), "vs_pipelining": versus,
                     "sent_bytes": max((s for s in sent if s is not None), default=None)})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round: checks that it runs")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.batch, args.sequence, args.width, args.blocks = 1, 4, 8, 16, 2
    settings = {k: getattr(args, k) for k in ("rounds", "chunks", "batch", "sequence", "width", "blocks")}
    if args.rank is not None:
        rank_main(args.rank, args.port, settings, args.out)
        return {}
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "result.json")
        commands = [[sys.executable, str(Path(__file__).resolve()), "--rank", str(rank), "--port", str(port),
                     "--out", out, *(argv if argv is not None else sys.argv[1:])] for rank in range(WORLD)]
        run_ranks(commands, rank_environment(port), timeout=1800, what="the tensor-parallel benchmark")
        result = json.loads(Path(out).read_text())
    rows = figures(result)
    print(f"machine: {result['machine']}; 4 gloo ranks, one intra-op thread each; model: {args.blocks} MLP blocks "
          f"of width {args.width}, batch {args.batch} x sequence {args.sequence}, {args.chunks} micro-batches")
    print("gradients, torchpipe against pipelining on the same weights and batch (largest difference, made whole): "
          + ", ".join(f"{kind} {value:.2e}" for kind, value in result["differences"].items()))
    print(format_table(["configuration", "step ms", "speed-up vs plain", "pipelining / torchpipe", "sent per step"],
                       [[r["configuration"], r["step_s"] * 1e3, r["speedup"], r["vs_pipelining"],
                         None if r["sent_bytes"] is None else f"{r['sent_bytes'] / 1024:.0f} KiB"] for r in rows]))
    print(f"(medians over {args.rounds} rounds; a step's time is its slowest rank's; pipelining / torchpipe > 1: "
          "torchpipe faster; sent: activation bytes the first stage's rank sent in one step)")
    results = {"rows": rows, "differences": result["differences"], "machine": result["machine"], "args": settings}
    if args.json:
        save_json(args.json, results)
    return results


def summary(results: Mapping[str, Any]) -> Summary:
    """RESULTS.md's table of a run (see run_all.py)."""
    rows = [[r["configuration"], r["step_s"] * 1e3, r["speedup"], r["vs_pipelining"],
             None if r["sent_bytes"] is None else r["sent_bytes"] / 1024] for r in results["rows"]]
    differences = ", ".join(f"{kind} {value:.2e}" for kind, value in results["differences"].items())
    return Summary(["configuration", "step ms", "speed-up vs plain", "pipelining / torchpipe", "sent per step, KiB"],
                   rows, [f"Gradients against pipelining's, largest difference: {differences}. 4 gloo ranks on "
                          "this machine's cores; settings: " + json.dumps(results["args"])])


if __name__ == "__main__":
    main()
