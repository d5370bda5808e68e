"""Language-model pipeline benchmark: tokens/s of a GPT-2 pipelined by torchpipe, in one process and
over 2 gloo ranks, against the plain model, the same micro-batches by hand, and ``torch.distributed.pipelining``.

The model is the one ``examples/train_lm.py`` trains: a GPT-2 from a
``transformers`` config (4 blocks, width 128, a byte vocabulary of 256, token
embedding and output projection tied), a mini-batch of 16 windows of 128
tokens, the next-token cross-entropy, 4 micro-batches. Every variant runs in
one launch of 2 processes (gloo on 127.0.0.1), in interleaved rounds (each
round runs every variant once, in a rotating order, with a barrier before and
after each step), and a figure is the median over the rounds:

* ``plain``: the model, the whole mini-batch, on rank 0 (rank 1 waits),
  with 1 and with 2 intra-op threads: on a busy machine 2 OpenMP threads can
  be several times slower than 1 (they wait for each other at every
  operator), so the figures "vs plain" are against the faster of the two;
* ``micro-batches by hand``: the same model run on the same 4 micro-batches
  one after the other, each loss weighted by its share (the plain model's
  gradients), on rank 0, 1 and 2 threads: what pipelining can at best divide
  by the number of workers, so the honest yardstick ("vs by hand": against
  the faster);
* ``torchpipe, 2 workers``: ``Pipeline`` of ``as_sequential(model)`` in rank
  0's process, 2 stages on ``['cpu', 'cpu']`` (one intra-op thread each);
* ``torchpipe, 2 ranks``: ``Pipeline(..., group=WORLD)``, one stage per rank
  (one intra-op thread each);
* ``pipelining``: ``torch.distributed.pipelining.pipeline()`` splits the same
  model (``Logits(model)``: token ids in, logits out) where torchpipe's stages
  meet (at the first block of the second half), ``ScheduleGPipe`` and
  ``Schedule1F1B`` with the same micro-batches and loss.

Both libraries get the same split: stage 1 starts at block ``layers // 2``.
Tied weights: ``pipeline()`` gives each stage its own copy of the tied
weight (stage 0 uses it as the embedding, stage 1 as the output projection)
and never adds their gradients, so each copy's gradient is a part of the
model's and the copies drift apart under an optimizer; torchpipe sums the
copies' gradients at the end of each step. The benchmark times both on the
tied model (the same computation; torchpipe's one extra all-reduce of the
tied weight's gradient is in its time) and prints, per library, whether each
rank's gradient of the tied weight equals the plain model's.

Memory: the step's peak resident set size above its start, per rank (Linux:
``/proc/self/clear_refs`` resets ``VmHWM`` before each measured step;
glibc's ``malloc`` is told to map and unmap large blocks, so the resident set
follows the live tensors).

    python benchmarks/lm_pipeline.py [--rounds 15] [--quick] [--json out.json]
"""
import argparse
import copy
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline  # noqa: E402

import torchpipe  # noqa: E402
from benchmarks.harness.machine import intra_op_threads, machine_description  # noqa: E402
from benchmarks.harness.memory import step_peak_bytes  # noqa: E402
from benchmarks.harness.output import Summary, format_table, save_json  # noqa: E402
from benchmarks.harness.processes import free_port, rank_environment, run_ranks  # noqa: E402
from benchmarks.harness.steps import (  # noqa: E402
    Step,
    drop_grads,
    microbatched_train_step,
    pipeline_step,
    train_step,
)
from benchmarks.harness.timing import rotated  # noqa: E402
from benchmarks.models import Logits  # noqa: E402

WORLD = 2
MiB = 1024 * 1024
#: The example's model and batch (examples/train_lm.py), and a tiny one for --quick.
FULL = {"layers": 4, "width": 128, "heads": 4, "length": 128, "batch": 16, "chunks": 4}
QUICK = {"layers": 2, "width": 32, "heads": 2, "length": 16, "batch": 8, "chunks": 2}
VOCAB = 256
#: The variants, in the order of the table, with the intra-op threads of rank 0's calling thread for those that run
#: in rank 0's process alone (None: both ranks, one thread each).
VARIANTS = [
    ("plain, 1 thread", 1),
    ("plain, 2 threads", 2),
    ("micro-batches by hand, 1 thread", 1),
    ("micro-batches by hand, 2 threads", 2),
    ("torchpipe 1f1b, 2 workers", 2),  # the two workers split the caller's 2 threads: one each
    ("torchpipe gpipe, 2 workers", 2),
    ("torchpipe 1f1b, 2 ranks", None),
    ("torchpipe gpipe, 2 ranks", None),
    ("pipelining Schedule1F1B, 2 ranks", None),
    ("pipelining ScheduleGPipe, 2 ranks", None),
]
PLAIN = ("plain, 1 thread", "plain, 2 threads")
BY_HAND = ("micro-batches by hand, 1 thread", "micro-batches by hand, 2 threads")


def gpt2(shape: Dict[str, int], seed: int = 0) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=shape["length"], n_embd=shape["width"], n_layer=shape["layers"],
        n_head=shape["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def next_token_loss(logits: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


# --- memory ------------------------------------------------------------------------------------------------


def peak_of(step: Step) -> int:
    """Bytes the step adds at its peak to this process's resident set (VmHWM reset just before it)."""
    peak = step_peak_bytes(step)
    if peak is None:
        raise RuntimeError("the step's peak memory needs /proc/self/clear_refs (Linux 4.0+)")
    return peak


# --- the variants on this rank -------------------------------------------------------------------------------


def variants(rank: int, shape: Dict[str, int], ids: Tensor) -> Dict[str, Step]:
    """Each variant's train step on this rank (forward, loss, backward; gradients dropped)."""
    chunks, half = shape["chunks"], shape["layers"] // 2
    model = gpt2(shape)
    plain = Logits(model)
    seq = torchpipe.as_sequential(model, input_ids=ids[:2], use_cache=False, output="logits")
    # Stage 1 starts at block `half`, for torchpipe as for pipelining.
    cut = next(k for k, layer in enumerate(seq) if layer.name.startswith(f"transformer.h.{half}."))  # type: ignore
    balance = [cut, len(seq) - cut]
    steps: Dict[str, Step] = {}

    if rank == 0:
        for name in PLAIN:
            steps[name] = train_step(plain, ids, target=ids, loss_fn=next_token_loss)
        for name in BY_HAND:
            steps[name] = microbatched_train_step(plain, ids, chunks, target=ids, loss_fn=next_token_loss)
        for schedule in ("1f1b", "gpipe"):
            with intra_op_threads(2):  # the workers split the caller's threads: one each
                local = torchpipe.Pipeline(copy.deepcopy(seq), balance, chunks=chunks, schedule=schedule,
                                           loss_fn=next_token_loss, devices=["cpu", "cpu"])
            steps[f"torchpipe {schedule}, 2 workers"] = pipeline_step(local, ids, ids)

    for schedule in ("1f1b", "gpipe"):
        pipe = torchpipe.Pipeline(copy.deepcopy(seq), balance, chunks=chunks, schedule=schedule,
                                  loss_fn=next_token_loss, group=dist.group.WORLD)
        steps[f"torchpipe {schedule}, 2 ranks"] = pipeline_step(pipe, ids if rank == 0 else None,
                                                                ids if rank == WORLD - 1 else None)

    split = pipeline(Logits(copy.deepcopy(model)), mb_args=(ids.chunk(chunks)[0],),
                     split_spec={f"model.transformer.h.{half}": SplitPoint.BEGINNING})
    for kind in (Schedule1F1B, ScheduleGPipe):
        stage = split.build_stage(rank, torch.device("cpu"))
        runner = kind(stage, chunks, loss_fn=next_token_loss)

        def pipelining_step(runner: Any = runner, module: nn.Module = stage.submod) -> None:
            if rank == 0:
                runner.step(ids)
            else:
                runner.step(target=ids, losses=[])
            drop_grads(module)

        steps[f"pipelining {kind.__name__}, 2 ranks"] = pipelining_step
    return steps


def in_process(name: str) -> bool:
    return dict(VARIANTS)[name] is not None


def threads(name: str) -> Optional[int]:
    return dict(VARIANTS)[name]


def run_variant(name: str, step: Step, rank: int) -> Optional[float]:
    """One step of the variant between barriers; its seconds (None on a rank that had nothing to do)."""
    dist.barrier()
    start = time.perf_counter()
    ran = False
    if not in_process(name) or rank == 0:
        with intra_op_threads(threads(name)):
            step()
        ran = True
    dist.barrier()
    return time.perf_counter() - start if ran else None


def gradients_match(rank: int, shape: Dict[str, int], ids: Tensor) -> Dict[str, Dict[str, bool]]:
    """Per library, after one step in float64: does this rank's gradient of the tied weight (``'tied'``), and
    of every other parameter it holds (``'others'``), equal the plain model's?"""
    chunks, half = shape["chunks"], shape["layers"] // 2
    model = gpt2(shape).double()
    plain = Logits(copy.deepcopy(model))
    next_token_loss(plain(ids), ids).backward()
    seq = torchpipe.as_sequential(copy.deepcopy(model), input_ids=ids[:2], use_cache=False, output="logits")
    cut = next(k for k, layer in enumerate(seq) if layer.name.startswith(f"transformer.h.{half}."))  # type: ignore
    pipe = torchpipe.Pipeline(seq, [cut, len(seq) - cut], chunks=chunks, loss_fn=next_token_loss,
                              group=dist.group.WORLD)
    pipe.step(ids if rank == 0 else None, ids if rank == WORLD - 1 else None)
    split = pipeline(Logits(copy.deepcopy(model)), mb_args=(ids.chunk(chunks)[0],),
                     split_spec={f"model.transformer.h.{half}": SplitPoint.BEGINNING})
    stage = split.build_stage(rank, torch.device("cpu"))
    runner = Schedule1F1B(stage, chunks, loss_fn=next_token_loss)
    if rank == 0:
        runner.step(ids)
    else:
        runner.step(target=ids, losses=[])
    want = {name.split(".", 1)[1]: p.grad for name, p in plain.named_parameters(remove_duplicate=False)}
    result: Dict[str, Dict[str, bool]] = {}
    for library, module in (("torchpipe", pipe), ("pipelining", stage.submod)):
        tied, others = [], []
        for name, p in module.named_parameters(remove_duplicate=False):
            # torchpipe's names start with the layer's index, pipelining's with the wrapper's `model.`.
            key = name.split(".", 1)[1]
            if p.grad is None or key not in want:
                continue
            same = torch.allclose(p.grad, want[key])
            # The holder of the tied weight that computes with it here: the embedding on rank 0, the head on 1.
            if key == ("transformer.wte.weight" if rank == 0 else "lm_head.weight"):
                tied.append(same)
            elif not key.endswith(("wte.weight", "lm_head.weight")):
                others.append(same)
        result[library] = {"tied": len(tied) == 1 and tied[0], "others": bool(others) and all(others)}
    return result


def rank_main(rank: int, shape: Dict[str, int], rounds: int, warmup: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=10))
    ids = torch.randint(0, VOCAB, (shape["batch"], shape["length"]), generator=torch.Generator().manual_seed(1))
    started = time.perf_counter()
    steps = variants(rank, shape, ids)
    setup = time.perf_counter() - started
    names = [name for name, _ in VARIANTS]
    for _ in range(warmup):
        for name in names:
            run_variant(name, steps.get(name, lambda: None), rank)
    # Memory: each variant's step once more, its peak measured on each rank that runs it.
    peaks: Dict[str, Optional[int]] = {}
    for name in names:
        dist.barrier()
        runs_here = rank == 0 or not in_process(name)
        if runs_here:
            with intra_op_threads(threads(name)):
                peaks[name] = peak_of(steps[name])
        else:
            peaks[name] = None
        dist.barrier()
    times: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):  # no variant always follows another
            seconds = run_variant(name, steps.get(name, lambda: None), rank)
            if seconds is not None:
                times[name].append(seconds)
    tied = gradients_match(rank, shape, ids)
    # Point to point, not a collective: gloo's worker thread may let go of a collective's tensors after the
    # caller is through with them, and a process that exits meanwhile aborts ("terminate called without an
    # active exception": this gather, the last call before the ranks exit, did so once in a CI run).
    mine = {"peaks": peaks, "tied": tied}
    gathered: List[Any] = [mine]
    if rank == 0:
        for other in range(1, WORLD):
            received: List[Any] = [None]
            dist.recv_object_list(received, other)
            gathered.append(received[0])
    else:
        dist.send_object_list([mine], 0)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "times": times, "setup_s": setup, "peaks": [g["peaks"] for g in gathered],
            "tied": [g["tied"] for g in gathered],
        }))
    dist.destroy_process_group()


# --- the launcher -----------------------------------------------------------------------------------------


def measure(shape: Dict[str, int], rounds: int, warmup: int, timeout: float = 1200.0) -> Dict[str, Any]:
    """Starts the 2 ranks, waits for them (killed after ``timeout`` s), and returns rank 0's figures."""
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "result.json")
        commands = [[sys.executable, __file__, "--rank", str(rank), "--shape", json.dumps(shape), "--rounds",
                     str(rounds), "--warmup", str(warmup), "--out", out] for rank in range(WORLD)]
        # Large blocks straight from mmap and back on free: the resident set follows live tensors.
        env = rank_environment(port, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        run_ranks(commands, env, timeout, "lm_pipeline")
        return dict(json.loads(Path(out).read_text()))


def report(shape: Dict[str, int], figures: Dict[str, Any]) -> Dict[str, Any]:
    """The table: tokens/s and ratios of medians, and the peak memory per rank."""
    tokens = shape["batch"] * shape["length"]
    median = {name: statistics.median(t) for name, t in figures["times"].items()}
    # What 2 stages could do at best: the micro-batches by hand on one thread, their work shared by 2 workers,
    # plus the bubble of a fill-drain or 1F1B step (equal stages, free messages): (chunks + 1) / (2 chunks).
    ideal = median[BY_HAND[0]] * (shape["chunks"] + WORLD - 1) / (WORLD * shape["chunks"])
    rows = []
    results: Dict[str, Any] = {}
    for name, _ in VARIANTS:
        peaks = [p[name] for p in figures["peaks"]]
        # Against the faster of each yardstick's thread counts: the best the plain model does on this machine.
        against = {"plain": min(median[n] for n in PLAIN) / median[name],
                   "by hand": min(median[n] for n in BY_HAND) / median[name]}
        library, schedule = name.split(",")[0].split(" ")[0], name.split(",")[0].split(" ")[-1]
        if library == "torchpipe" and name.endswith("2 ranks"):
            twin = "pipelining " + {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}[schedule] + ", 2 ranks"
            against["pipelining"] = median[twin] / median[name]
        of_ideal = ideal / median[name] if library in ("torchpipe", "pipelining") else None
        results[name] = {"tokens_per_s": tokens / median[name], "step_ms": median[name] * 1e3,
                         "vs_plain": against["plain"], "vs_by_hand": against["by hand"], "of_ideal": of_ideal,
                         "vs_pipelining": against.get("pipelining"), "peak_mib": [None if p is None else p / MiB
                                                                                   for p in peaks]}
        rows.append([name, tokens / median[name], against["plain"], against["by hand"], against.get("pipelining"),
                     of_ideal, median[name] * 1e3] + [None if p is None else p / MiB for p in peaks])
    print(format_table(
        ["variant", "tokens/s", "vs plain", "vs by hand", "vs pipelining", "of ideal", "step ms", "peak MiB rank 0",
         "peak MiB rank 1"], rows))
    print("(vs X: tokens/s over X's, from the medians of the interleaved rounds, X's faster thread count; > 1 is "
          "faster. Of ideal: the ideal step time over the variant's, the ideal being the micro-batches by hand on "
          f"1 thread shared by 2 workers with the bubble, x (chunks + 1) / (2 chunks): {ideal * 1e3:.0f} ms. "
          "Peak: the step's peak resident set above its start, on each rank that runs it)")
    tied = figures["tied"]
    for library in ("torchpipe", "pipelining"):
        print(f"{library} (1F1B, float64, one step): the tied weight's gradient equals the plain model's on rank 0 "
              f"(embedding): {tied[0][library]['tied']}, on rank 1 (head): {tied[1][library]['tied']}; every other "
              f"gradient: {tied[0][library]['others'] and tied[1][library]['others']}")
    return {"variants": results, "tied_gradient_equals_plain": tied, "setup_s": figures["setup_s"]}


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 1 round: checks that it runs")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, json.loads(args.shape), args.rounds, args.warmup, args.out)
        return {}
    shape = QUICK if args.quick else FULL
    rounds, warmup = (1, 1) if args.quick else (args.rounds, args.warmup)
    print(f"machine: {machine_description()}; 2 gloo ranks on 127.0.0.1, 1 intra-op thread each "
          f"(2 workers in one process: 1 each)")
    print(f"GPT-2: {shape['layers']} blocks, width {shape['width']}, vocabulary {VOCAB}, embedding and head tied; "
          f"batch {shape['batch']} x {shape['length']} tokens, {shape['chunks']} micro-batches, next-token "
          f"cross-entropy; stage 1 starts at block {shape['layers'] // 2}; {rounds} interleaved rounds")
    figures = measure(shape, rounds, warmup)
    results = report(shape, figures)
    results.update({"shape": shape, "rounds": rounds})
    if args.json:
        save_json(args.json, results)
    return results


def summary(results: Mapping[str, Any]) -> Summary:
    """RESULTS.md's table of a run (see run_all.py): each variant's tokens/s over the plain model's, the
    micro-batches by hand and pipelining's same schedule; its share of the ideal; its peak step memory per rank."""
    rows = [[name, r["tokens_per_s"], r["vs_plain"], r["vs_by_hand"], r["vs_pipelining"], r["of_ideal"], r["step_ms"],
             *r["peak_mib"]] for name, r in results["variants"].items()]
    tied = results["tied_gradient_equals_plain"]
    shape = results["shape"]
    notes = [f"GPT-2: blocks {shape['layers']}, width {shape['width']}, tied; batch {shape['batch']} x "
             f"{shape['length']} tokens in {shape['chunks']} micro-batches; interleaved rounds: {results['rounds']}.",
             "The tied weight's gradient equals the plain model's on both ranks: " + "; ".join(
                 f"{library} {'yes' if all(rank[library]['tied'] for rank in tied) else 'no'}"
                 for library in ("torchpipe", "pipelining")) + "."]
    return Summary(["variant", "tokens/s", "vs plain", "vs by hand", "vs pipelining", "of ideal", "step ms",
                    "peak MiB rank 0", "peak MiB rank 1"], rows, notes)


if __name__ == "__main__":
    main()
