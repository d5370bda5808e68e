"""Train a small GPT-2 on the Python standard library's own source, byte by byte, with a Pipeline: ``make run-lm``.

What it does, in order:

1. reads the ``.py`` files at the top of the standard library
   (``sysconfig.get_paths()["stdlib"]``, present on every machine that has
   Python), as bytes: the vocabulary is the 256 byte values; every tenth file
   is held out for evaluation;
2. builds a GPT-2 from a ``transformers`` config (random weights, nothing
   downloaded) whose output projection is its token embedding
   (``tie_word_embeddings=True``), and makes it an ``nn.Sequential`` with
   ``torchpipe.as_sequential`` (traced by ``torch.export``);
3. balances the layers with ``torchpipe_balancing``: ``--balance size``
   (the default, ``balance_by_size``, the same on every run), ``time``
   (``balance_by_time``) or a list such as ``14,14``;
4. trains it with ``torchpipe.Pipeline`` (``--schedule 1f1b`` by default),
   cross-entropy of each position's logits against the next byte, AdamW,
   the gradients clipped to a norm of ``--clip``; prints the loss every
   ``--print-every`` steps;
5. prints the loss on the held-out files before and after training, and a
   continuation of a prompt (sampled, or greedy with ``--temperature 0``),
   decoded as bytes;
6. writes the timeline of one training step (``--timeline``, a PNG; a JSON
   Chrome trace beside it).

With ``--checkpoint-dir DIR`` the run saves itself every ``--every`` steps
(:class:`torchpipe.Checkpointer`: weights, AdamW's state, the LR schedule
and the data generator's position, every rank's RNG states) and, started
again with the same flags, resumes from its newest complete checkpoint; under
``torchrun --max-restarts N`` a run that loses a rank does so by itself.

In one process (the default) every stage is a CPU worker with one core (or a
GPU each when there are enough). Across processes, one stage per rank::

    python examples/train_lm.py                      # make run-lm
    torchrun --standalone --nproc-per-node 2 examples/train_lm.py --distributed   # make run-lm-distributed

On a 3-D mesh, ``--tp`` ranks split each stage with tensor parallelism (a
Llama, ``--model llama``, by its own plan, ``model._tp_plan``) and ``--dp``
replicas train on their own windows; the pipeline gets the ranks left::

    torchrun --standalone --nproc-per-node 4 examples/train_lm.py --distributed --model llama --tp 2   # make run-3d
    torchrun --standalone --nproc-per-node 8 examples/train_lm.py --distributed --model llama --tp 2 --dp 2

Every rank reads the same files and builds the same model from the same
seed; the first stage's rank feeds the token ids, the last stage's rank the
targets, and rank 0 prints. Two runs with the same flags and ``--seed``
print the same losses, in one process or across ranks (up to the rounding
of the tied weight's gradient, summed in another order there). With
``--balance time`` the balance is measured, so it may differ from run to
run; give the balance it printed to repeat a run.
"""
import argparse
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import torchpipe
import torchpipe.distributed
from torchpipe import trace
from torchpipe_balancing import balance_by_size, balance_by_time

VOCAB = 256  # byte values
HELD_OUT = 10  # every tenth file is for evaluation only


# --- the data ----------------------------------------------------------------------------------------


def stdlib_files() -> List[Path]:
    """The ``.py`` files at the top of the standard library, sorted by name (the same list on every rank)."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(folder.glob("*.py"))
    if len(files) < HELD_OUT:
        raise SystemExit(f"found only {len(files)} .py files in {folder}; this example trains on them")
    return files


def corpus() -> Tuple[Tensor, Tensor]:
    """The training and the held-out bytes, as two 1-D ``uint8`` tensors."""
    train: List[bytes] = []
    held_out: List[bytes] = []
    for k, path in enumerate(stdlib_files()):
        (held_out if k % HELD_OUT == 0 else train).append(path.read_bytes())

    def tensor(parts: List[bytes]) -> Tensor:
        return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)

    return tensor(train), tensor(held_out)


def windows(text: Tensor, count: int, length: int, generator: torch.Generator) -> Tensor:
    """``count`` windows of ``length`` consecutive bytes at random places, as int64 token ids."""
    starts = torch.randint(0, len(text) - length, (count,), generator=generator)
    return torch.stack([text[s:s + length] for s in starts.tolist()]).long()


# --- the model ---------------------------------------------------------------------------------------


def language_model(args: argparse.Namespace) -> Tuple[nn.Sequential, Dict[str, str]]:
    """A GPT-2 (or a Llama) with tied embedding and head, random weights from ``--seed``, made into a Sequential;
    with the model's own tensor-parallel plan (a Llama's: GPT-2 has none)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    if args.model == "llama":
        # Eager attention: its matrix products and softmax are what DTensor splits by heads (see
        # docs/distributed.md, "Tensor parallel inside stages").
        model: nn.Module = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=args.width, intermediate_size=4 * args.width, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=args.heads, max_position_embeddings=args.length,
            bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True, attn_implementation="eager",
        ))
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=args.length, n_embd=args.width, n_layer=args.layers, n_head=args.heads,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
        ))
        assert model.lm_head.weight is model.transformer.wte.weight
    example = torch.zeros(2, args.length, dtype=torch.long)
    # use_cache=False: a cache is of no use in training. The Sequential takes token ids and returns logits.
    seq = torchpipe.as_sequential(model, input_ids=example, use_cache=False, output="logits")
    return seq, dict(getattr(model, "_tp_plan", None) or {})


def next_token_loss(logits: Tensor, ids: Tensor) -> Tensor:
    """Cross-entropy of each position's logits against the byte that follows it."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def find_balance(args: argparse.Namespace, seq: nn.Sequential, stages: int, sample: Tensor) -> List[int]:
    if args.balance == "time":
        # Each worker computes with one intra-op thread on CPU: profile the layers that way.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return balance_by_time(stages, seq, sample, timeout=args.balance_timeout)
        finally:
            torch.set_num_threads(threads)
    if args.balance == "size":
        # param_scale=4: AdamW keeps the weight, its gradient and two moments per parameter.
        return balance_by_size(stages, seq, sample, chunks=args.chunks, param_scale=4.0)
    balance = [int(b) for b in args.balance.split(",")]
    if len(balance) != stages:
        raise SystemExit(f"--balance {args.balance} has {len(balance)} stages; this run has {stages}")
    return balance


# --- the run -----------------------------------------------------------------------------------------


class Run:
    """The pipeline on this process, and what the ranks must agree on."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.distributed = bool(args.distributed)
        #: With --tp or --dp: the (dp, pp, tp) mesh, and this rank's replica and stage position on it.
        self.mesh: Any = None
        self.replica, self.replicas = 0, 1
        if self.distributed:
            cuda = torch.cuda.is_available()
            # torch's init_process_group on a store prefix of this torchrun attempt's own: a restarted job does not
            # read the dead attempt's keys.
            torchpipe.distributed.init_process_group("nccl" if cuda else "gloo")
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            # The device of this script's own collectives: NCCL takes CUDA tensors only.
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
            if cuda:
                torch.cuda.set_device(self.device)
            if not cuda:  # each rank its share of the host's cores
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                                          self.world))))
            pipelines = self.world
            if args.tp > 1 or args.dp > 1:
                if self.world % (args.tp * args.dp):
                    raise SystemExit(f"--tp {args.tp} x --dp {args.dp} must divide the {self.world} ranks")
                from torch.distributed.device_mesh import init_device_mesh

                pipelines = self.world // (args.tp * args.dp)
                self.mesh = init_device_mesh("cuda" if cuda else "cpu", (args.dp, pipelines, args.tp),
                                             mesh_dim_names=("dp", "pp", "tp"))
                self.replica, self.replicas = self.mesh.get_local_rank("dp"), args.dp
            stages = pipelines * (2 if args.schedule == "interleaved_1f1b" else 1)
            devices = None
        else:
            self.rank, self.world = 0, 1
            self.device = torch.device("cpu")
            stages = args.stages
            workers = stages // 2 if args.schedule == "interleaved_1f1b" else stages
            enough = torch.cuda.is_available() and torch.cuda.device_count() >= workers
            devices = [torch.device("cuda", k) if enough else torch.device("cpu") for k in range(workers)]
        self.stages = stages
        self.devices = devices

    def print(self, *values: Any) -> None:
        if self.rank == 0:
            print(*values, flush=True)

    def agree(self, value: Any) -> Any:
        """Rank 0's value on every rank (a measured balance differs from rank to rank)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def build(self, seq: nn.Sequential, balance: List[int], plan: Dict[str, str]) -> torchpipe.Pipeline:
        args = self.args
        on_mesh: Dict[str, Any] = {}
        if self.mesh is not None:
            on_mesh = dict(mesh=self.mesh, data_parallel=args.data_parallel if args.dp > 1 else None,
                           tensor_parallel=plan if args.tp > 1 else None)
        elif self.distributed:
            on_mesh = dict(group=dist.group.WORLD)
        pipe = torchpipe.Pipeline(seq, balance, chunks=args.chunks, schedule=args.schedule, loss_fn=next_token_loss,
                                  checkpoint=args.checkpoint, devices=self.devices, **on_mesh)
        workers = pipe.schedule.stage_workers
        self.first, self.last = workers[0], workers[-1]
        # Where this rank is in its pipeline, and the global rank that tells the last stage's logits.
        self.position = self.rank if self.mesh is None else self.mesh.get_local_rank("pp")
        self.teller = self.last if self.mesh is None else int(self.mesh.mesh[0, self.last, 0])
        return pipe

    def inputs(self, ids: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """What this rank passes to ``step``: the ids on the first stage's rank, the targets on the last's (with
        replicas, each replica its share of ``ids``)."""
        if not self.distributed:
            return ids, ids
        if self.replicas > 1:
            ids = ids.chunk(self.replicas)[self.replica]
        return (ids if self.position == self.first else None), (ids if self.position == self.last else None)

    def broadcast_from_last(self, tensor: Tensor) -> Tensor:
        """The last stage's rank's ``tensor`` on every rank (on the CPU).

        Sent point to point, not by ``dist.broadcast``: gloo runs a collective
        on a worker thread that lets go of the tensor after the caller is
        through with it, and a process that exits meanwhile aborts ("terminate
        called without an active exception", a race of PyTorch's at
        interpreter exit). The last of these comes just before the run ends."""
        if not self.distributed:
            return tensor
        tensor = tensor.to(self.device)
        if self.rank == self.teller:
            for rank in range(self.world):
                if rank != self.rank:
                    dist.send(tensor, rank)
        else:
            dist.recv(tensor, self.teller)
        return tensor.cpu()


def evaluate(run: Run, pipe: torchpipe.Pipeline, batches: Sequence[Tensor]) -> float:
    """The mean next-byte loss on the held-out batches: loss only, no gradient touched."""
    total = 0.0
    with torch.no_grad():
        for ids in batches:
            total += pipe.step(*run.inputs(ids)).item()
    return total / len(batches)


def continue_text(run: Run, pipe: torchpipe.Pipeline, prompt: bytes, count: int, context: int, temperature: float,
                  seed: int) -> bytes:
    """``count`` bytes after ``prompt``, one pipelined forward (one micro-batch) each: sampled at ``temperature``
    from a generator seeded with ``seed`` (0: greedy, the likeliest byte each time)."""
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    pipe.eval()
    try:
        for _ in range(count):
            window = ids[:, -context:]  # the model has `context` positions
            logits = pipe(window if run.position == run.first else None)  # on the last stage's rank, else None
            if logits is not None and hasattr(logits, "full_tensor"):  # split over the tp ranks: made whole
                logits = logits.full_tensor()
            following = torch.zeros(1, 1, dtype=torch.long)
            if logits is not None:
                last = logits[:, -1].float().cpu()
                if temperature > 0:
                    following = torch.multinomial(torch.softmax(last / temperature, dim=-1), 1, generator=generator)
                else:
                    following = last.argmax(dim=-1, keepdim=True)
            ids = torch.cat([ids, run.broadcast_from_last(following)], dim=1)
    finally:
        pipe.train()
    return bytes(ids[0, len(prompt):].tolist())


def save_timeline(run: Run, pipe: torchpipe.Pipeline, ids: Tensor, path: Path) -> None:
    """Records one training step (after the run, so nothing is cold) and writes it as a PNG and a Chrome trace."""
    with trace.record_timeline() as timeline:
        pipe.step(*run.inputs(ids))
    pipe.zero_grad()
    merged = pipe.gather_timeline(timeline)  # a collective: every rank calls it; rank 0 gets the whole
    if merged is None or run.rank != 0:  # on a mesh, each pipeline's first rank has its own: rank 0 writes
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    merged.save_chrome_trace(path.with_suffix(".json"))
    if run.mesh is not None:
        where = f"{run.world} ranks, (dp, pp, tp) = {tuple(run.mesh.shape)}: rank 0's pipeline"
    elif run.distributed:
        where = f"{run.world} ranks"
    else:
        where = f"{len(set(pipe.devices))} GPUs" if pipe.devices[0].type == "cuda" else f"{run.stages} CPU workers"
    merged.save_png(path, title=f"one step of examples/train_lm.py: schedule {run.args.schedule!r}, "
                                f"{run.stages} stages on {where}, {run.args.chunks} micro-batches")
    run.print(f"timeline of one step: {path} and {path.with_suffix('.json')} (chrome://tracing, ui.perfetto.dev)")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16, help="windows per step (mini-batch)")
    parser.add_argument("--length", type=int, default=128, help="bytes per window (the model's context)")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zero_bubble", "interleaved_1f1b"])
    parser.add_argument("--stages", type=int, default=2, help="stages in one process (across processes: one per "
                                                                 "rank, two with interleaved_1f1b)")
    parser.add_argument("--checkpoint", default="never", choices=["always", "except_last", "never"])
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--width", type=int, default=128, help="hidden size")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (0: none)")
    parser.add_argument("--balance", default="size", help="'size' (balance_by_size: the same on every run), 'time' "
                                                          "(balance_by_time: measured) or a balance such as 14,14")
    parser.add_argument("--balance-timeout", type=float, default=1.0, help="seconds balance_by_time may profile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--print-every", type=int, default=25)
    parser.add_argument("--eval-batches", type=int, default=8, help="held-out batches of --batch windows")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--generate", type=int, default=160, help="bytes to generate after the prompt")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0: greedy)")
    parser.add_argument("--timeline", type=Path, default=Path("out/timeline-lm.png"),
                        help="the PNG of one step's timeline ('' : none)")
    parser.add_argument("--distributed", action="store_true", help="one stage per rank (launch with torchrun)")
    parser.add_argument("--model", default="gpt2", choices=["gpt2", "llama"])
    parser.add_argument("--tp", type=int, default=1, help="with --distributed: tensor-parallel ranks per stage "
                                                          "(--model llama: its own plan)")
    parser.add_argument("--dp", type=int, default=1, help="with --distributed: data-parallel replicas")
    parser.add_argument("--data-parallel", default="replicate", choices=["replicate", "shard"])
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save every --every steps here, and resume from the newest complete checkpoint")
    parser.add_argument("--every", type=int, default=50, help="with --checkpoint-dir: steps between checkpoints")
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "length", "chunks", "stages", "layers", "width", "heads", "print_every",
                 "eval_batches", "every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.length < 2:
        parser.error("--length must be at least 2: a position predicts the next")
    if args.width % args.heads:
        parser.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
    if not args.prompt:
        parser.error("--prompt must not be empty")
    if args.tp < 1 or args.dp < 1:
        parser.error("--tp and --dp must be at least 1")
    if (args.tp > 1 or args.dp > 1) and not args.distributed:
        parser.error("--tp and --dp split the ranks of a job: add --distributed (and launch with torchrun)")
    if args.tp > 1 and args.model != "llama":
        parser.error("--tp needs --model llama: a model's own tensor-parallel plan splits it, and GPT-2 has none")
    return args


def main(argv: Sequence[str]) -> None:
    args = parse_args(argv)
    run = Run(args)
    began = time.perf_counter()
    train_text, held_out_text = corpus()
    generator = torch.Generator().manual_seed(args.seed)
    held_out = [windows(held_out_text, args.batch, args.length, generator) for _ in range(args.eval_batches)]
    run.print(f"data: {len(train_text) / 1e6:.1f} MB of Python (the standard library's {len(stdlib_files())} "
              f"top-level files), {len(held_out_text) / 1e6:.2f} MB of them held out; windows of {args.length} bytes")

    seq, plan = language_model(args)
    parameters = {id(p): p.numel() for p in seq.parameters()}  # the tied weight once
    balance = run.agree(find_balance(args, seq, run.stages, held_out[0]) if run.rank == 0 else None)
    kind = "Llama" if args.model == "llama" else "GPT-2"
    run.print(f"model: {kind}, {args.layers} blocks, width {args.width}, {sum(parameters.values()) / 1e6:.2f}M "
              f"parameters, embedding and head tied; as_sequential: {len(seq)} layers in "
              f"{time.perf_counter() - began:.0f} s")
    pipe = run.build(seq, balance, plan)
    names = [str(getattr(layer, "name", k)) for k, layer in enumerate(seq)]
    cuts = [sum(balance[:s]) for s in range(len(balance))]
    where = (f"ranks {list(pipe.schedule.stage_workers)}" if run.distributed else [str(d) for d in pipe.devices])
    run.print(f"balance_by_{args.balance}: {balance}" if args.balance in ("time", "size") else f"balance: {balance}",
              f"(stages start at {', '.join(names[c] for c in cuts)}) on {where}; schedule {args.schedule!r}, "
              f"chunks {args.chunks}, batch {args.batch}")

    # AdamW on this process's parameters: on every rank, the tied weight's copy gets the same summed gradient,
    # so the same update keeps the copies equal.
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = min(20, args.steps // 5 + 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # a short warm-up, then a linear decay to a tenth
        optimizer, lambda k: min(1.0, (k + 1) / warmup) * (1.0 - 0.9 * k / args.steps))
    ckpt = None
    start = 0
    if args.checkpoint_dir is not None:
        ckpt = torchpipe.Checkpointer(args.checkpoint_dir, pipe, optimizer, every=args.every, keep=2)
        start = ckpt.restore()  # weights, AdamW's state, this rank's RNG states; 0 without a checkpoint
        if start:
            # What the run's position is besides: the data's generator and the LR schedule.
            generator.set_state(ckpt.extra["data"])
            schedule.load_state_dict(ckpt.extra["schedule"])
            run.print(f"resumed from step {start}, the newest complete checkpoint in {args.checkpoint_dir}")
    run.print(f"held-out loss {'before training' if not start else f'at step {start}'}: "
              f"{evaluate(run, pipe, held_out):.3f} (uniform over bytes: "
              f"{torch.log(torch.tensor(float(VOCAB))).item():.3f})")
    train = time.perf_counter()
    recent: List[float] = []
    for step in range(start + 1, args.steps + 1):
        ids = windows(train_text, args.batch * run.replicas, args.length, generator)  # each replica its share
        recent.append(pipe.step(*run.inputs(ids)).item())
        if args.clip > 0:  # by the whole model's norm, the tied weight counted once: a collective across ranks
            pipe.clip_grad_norm_(args.clip)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        if ckpt is not None:  # every --every steps, written in the background
            ckpt.step(step, extra={"data": generator.get_state(), "schedule": schedule.state_dict()})
        if step % args.print_every == 0 or step == args.steps:
            seconds = time.perf_counter() - train
            run.print(f"step {step:4d}/{args.steps}: loss {sum(recent) / len(recent):.3f}  "
                      f"({(step - start) * args.batch * run.replicas * args.length / seconds:.0f} tokens/s, "
                      f"{seconds:.0f} s)")
            recent = []
    if ckpt is not None:
        ckpt.close()
    seconds = time.perf_counter() - train
    tokens = (args.steps - start) * args.batch * run.replicas * args.length
    run.print(f"held-out loss after {args.steps} steps: {evaluate(run, pipe, held_out):.3f}; trained in "
              f"{seconds:.0f} s ({tokens / max(seconds, 1e-9):.0f} tokens/s)")
    text = continue_text(run, pipe, args.prompt.encode(), args.generate, args.length, args.temperature, args.seed)
    how = f"sampled at temperature {args.temperature}" if args.temperature > 0 else "greedy"
    run.print(f"continuation of {args.prompt!r} ({how}):\n{(args.prompt.encode() + text).decode(errors='replace')}")
    if str(args.timeline) not in ("", "."):
        save_timeline(run, pipe, windows(train_text, args.batch, args.length, generator), args.timeline)
    run.print(f"done in {time.perf_counter() - began:.0f} s")
    if run.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
