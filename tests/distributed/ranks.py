"""What each rank runs in the multi-process tests (called by tests/distributed/launch.py in fresh processes)."""
import copy
import datetime
import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

import torchpipe
from tests.models import Pop, Sleep, Stash, UseMask, WithMask
from torchpipe import Pipeline, PipelineError
from torchpipe.distributed.memory import memory_of
from torchpipe.schedule import Kind


def model_for(stages: int) -> nn.Sequential:
    """Two layers per stage: a skip from stage 0 to the last stage, an integer mask from stage 0 to stage 1."""
    torch.manual_seed(1)
    layers: List[nn.Module] = [Stash(), WithMask(), UseMask()]
    while len(layers) < 2 * stages - 1:
        layers += [nn.Linear(6, 6), nn.Tanh()][: 2 * stages - 1 - len(layers)]
    layers.append(Pop())
    return nn.Sequential(*layers)


def mse(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


def _differences(case: str, loss: Tensor, expected: Tensor, plain: nn.Module, held: Dict[str, Tensor]) -> List[str]:
    """How a step's loss and this rank's gradients (``held``, by name) differ from the plain module's (after its
    backward of ``expected``)."""
    problems = []
    if not torch.allclose(loss, expected.detach(), rtol=1e-5, atol=1e-6):
        problems.append(f"{case}: loss {loss.item()} != {expected.item()}")
    for name, param in plain.named_parameters():
        if name in held and not torch.allclose(held[name].grad, param.grad, rtol=1e-4, atol=1e-6):
            problems.append(f"{case}: gradient of {name} differs")
    return problems


def transparency(rank: int, world: int) -> List[str]:
    """Every schedule, checkpoint mode and chunks: loss on every rank and every local .grad equal the plain module's.

    Returns the cases that differed (empty: all equal).
    """
    problems: List[str] = []
    schedules = ["gpipe", "1f1b", "zero_bubble", "interleaved_1f1b"]
    for schedule in schedules:
        stages = 2 * world if schedule == "interleaved_1f1b" else world
        for checkpoint, chunks in [("never", 1), ("always", 3), ("except_last", 8), ("never", 5)]:
            model = model_for(stages)
            plain = copy.deepcopy(model)
            pipe = Pipeline(model, [2] * stages, chunks=chunks, schedule=schedule, loss_fn=mse,
                            checkpoint=checkpoint, group=dist.group.WORLD)
            held = dict(pipe.named_parameters())
            # Shapes change between steps; the last batch has fewer micro-batches than stages.
            for batch in (8, 5, 2):
                torch.manual_seed(batch)
                x, y = torch.randn(batch, 6), torch.randn(batch, 6)
                loss = pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)
                expected = mse(plain(x), y)
                expected.backward()
                problems += _differences(f"{schedule} {checkpoint} chunks={chunks} batch={batch}", loss, expected,
                                         plain, held)
    return problems


def zero_bubble_placement(rank: int, world: int) -> Dict[str, Any]:
    """A zero-bubble pipeline through its measured steps and its trial, to its placement: every step's loss and
    gradients, and the placement each rank decided. Every stage starts with a Linear, so each runs on the leaves
    of the message it receives (no alias: see takes_leaves)."""
    from torchpipe.schedule.split import TUNING_STEPS

    torch.manual_seed(2)
    model = nn.Sequential(*[layer for _ in range(world) for layer in (nn.Linear(6, 6), nn.Tanh())])
    plain = copy.deepcopy(model)
    pipe = Pipeline(model, [2] * world, chunks=4, schedule="zero_bubble", loss_fn=mse, group=dist.group.WORLD)
    held = dict(pipe.named_parameters())
    problems: List[str] = []
    for step in range(TUNING_STEPS + 1):
        torch.manual_seed(step)
        x, y = torch.randn(8, 6), torch.randn(8, 6)
        loss = pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)
        expected = mse(plain(x), y)
        expected.backward()
        problems += _differences(f"step {step}", loss, expected, plain, held)
    assert pipe._tuner is not None
    split = pipe._tuner.split
    runs = [any(a.kind is Kind.BACKWARD_WEIGHT for a in pipe.schedule.actions() if a.stage == s)
            for s in range(world)]
    from torchpipe.runtime.boundary import takes_leaves

    bare = [takes_leaves(stage) for stage in pipe._runner.stages.modules if stage is not None]
    return {"problems": problems, "decided": pipe._tuner.decided, "split": split, "runs": runs, "bare": bare}


def holds_only_its_stages(rank: int, world: int) -> Dict[str, Any]:
    """A meta-device model is materialised stage by stage; each rank holds its layers only."""
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(2 * world)])
    pipe = Pipeline(model, [2] * world, loss_fn=mse, group=dist.group.WORLD)
    names = sorted({name.split(".")[0] for name, _ in pipe.named_parameters()})
    meta = [name for name, p in pipe.named_parameters() if p.is_meta]
    x = torch.randn(4, 64)
    loss = _step(pipe, x, rank, world)
    return {"layers": names, "meta": meta, "finite": bool(torch.isfinite(loss))}


def save_checkpoint(rank: int, world: int, path: str, stages: int) -> bool:
    """Trains a step, then saves the whole state dict (plain keys) from the first stage's rank."""
    torch.manual_seed(3)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(2 * stages)])
    schedule = "interleaved_1f1b" if stages > world else "1f1b"
    pipe = Pipeline(model, [2] * stages, chunks=2, loss_fn=mse, schedule=schedule, group=dist.group.WORLD)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    x = torch.randn(4, 6)
    _step(pipe, x, rank, world)
    optimizer.step()
    state = pipe.full_state_dict()
    if rank == 0:
        torch.save(state, path)
        return list(state) == list(nn.Sequential(*[nn.Linear(6, 6) for _ in range(2 * stages)]).state_dict())
    return state == {}


def load_checkpoint(rank: int, world: int, path: str) -> bool:
    """Loads a checkpoint saved with another world size; the outputs equal the plain module's with it."""
    state = torch.load(path, weights_only=True)
    layers = len({key.split(".")[0] for key in state})
    plain = nn.Sequential(*[nn.Linear(6, 6) for _ in range(layers)])
    plain.load_state_dict(state)
    pipe = Pipeline(nn.Sequential(*[nn.Linear(6, 6) for _ in range(layers)]), [layers // world] * world,
                    chunks=2, loss_fn=mse, group=dist.group.WORLD)
    pipe.load_state_dict(state)
    torch.manual_seed(5)  # the same input on every rank
    x = torch.randn(4, 6)
    out = pipe(x if rank == 0 else None)
    return out is None if rank != world - 1 else bool(torch.allclose(out, plain(x), atol=1e-6))


class Fails(nn.Module):
    """Raises (or ends its process) in micro-batch 2's forward of the step it is armed for."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.armed = False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed and torchpipe.current_microbatch() is not None and torchpipe.current_microbatch().index == 2:
            if self.how == "die":
                os._exit(17)
            raise ValueError("layer failed on purpose")
        return x


def _step(pipe: Pipeline, x: Tensor, rank: int, world: int) -> Tensor:
    """One step with ``x`` as the input (on rank 0) and the target (on the last rank); the step's loss."""
    return pipe.step(x if rank == 0 else None, x if rank == world - 1 else None)


def reported(call: Callable[[], Any]) -> Dict[str, Any]:
    """What ``call`` raised (type and message; None if nothing) and how long it took."""
    report: Dict[str, Any] = {"raised": None}
    start = time.monotonic()
    try:
        call()
    except BaseException as exc:  # noqa: B036 - reported to the test
        report["raised"] = type(exc).__name__
        report["message"] = str(exc)
    report["seconds"] = time.monotonic() - start
    return report


def _failing_step(pipe: Pipeline, x: Tensor, rank: int, world: int, *, no_input: bool = False) -> Dict[str, Any]:
    """One step with ``x`` as input (none with ``no_input``) and target: what it raised (type and message) and
    how long it took."""
    return reported(lambda: pipe.step(x if rank == 0 and not no_input else None, x if rank == world - 1 else None))


def failure(rank: int, world: int, how: str, schedule: str) -> Dict[str, Any]:
    """Rank 1's layer fails in a step; every rank reports what it raised and when, then runs another step."""
    fails = Fails(how)
    layers: List[nn.Module] = []
    for stage in range(world):
        layers += [nn.Linear(6, 6), fails if stage == 1 else nn.Tanh()]
    pipe = Pipeline(nn.Sequential(*layers), [2] * world, chunks=4, loss_fn=mse, schedule=schedule,
                    group=dist.group.WORLD)
    x = torch.randn(8, 6)
    _step(pipe, x, rank, world)
    fails.armed = rank == 1
    report = _failing_step(pipe, x, rank, world)
    fails.armed = False
    pipe.zero_grad()
    loss = _step(pipe, x, rank, world)
    report["next step"] = bool(torch.isfinite(loss))
    for _ in range(3):
        _step(pipe, x, rank, world)
    report["receiving threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("torchpipe-recv"))
    return report


def receive_bug(rank: int, world: int, where: str) -> Dict[str, Any]:
    """Rank 1 meets an error of a kind its receive does not expect (a bug, a TypeError) in the second step, on
    the receiving thread, which takes a peer's first message (``'first'``: in the wait for it; ``'decode
    first'``: in decoding its header), or on the stage's thread, which takes the rest (``'later'``: in decoding
    the third message's header). Every rank reports what it raised and when."""
    from torchpipe.distributed import transport, wire

    armed = {"on": False, "skip": 0 if where == "decode first" else 2}

    def bug() -> TypeError:
        return TypeError(f"a bug in a receive, on thread {threading.current_thread().name}")

    class BuggyWork:
        def wait(self, *args: Any) -> bool:
            raise bug()

    decode, post = wire.decode, transport.DistributedTransport._post_message

    def buggy_decode(header: Tensor) -> Any:
        if armed["on"] and where != "first":
            if armed["skip"] == 0:
                raise bug()
            armed["skip"] -= 1
        return decode(header)

    def buggy_post(self: Any, peer: int, k: int, edge: Any) -> Any:
        posted = post(self, peer, k, edge)
        if armed["on"] and where == "first" and k == 0:
            return posted._replace(work=BuggyWork())
        return posted

    wire.decode = buggy_decode  # type: ignore[assignment]
    transport.DistributedTransport._post_message = buggy_post  # type: ignore[method-assign]
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]), [2, 2], chunks=4, loss_fn=mse,
                    group=dist.group.WORLD)
    x = torch.randn(8, 6)
    _step(pipe, x, rank, world)
    armed["on"] = rank == 1
    return _failing_step(pipe, x, rank, world)


def interleaved_with_four_stages_per_rank(rank: int, world: int) -> bool:
    """8 stages on 2 ranks: each rank runs 4, and the loss is the plain module's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(8)])
    plain = copy.deepcopy(model)
    pipe = Pipeline(model, [1] * 8, chunks=4, loss_fn=mse, schedule="interleaved_1f1b", group=dist.group.WORLD)
    x = torch.randn(8, 6)
    loss = _step(pipe, x, rank, world)
    held = sorted(int(name.split(".")[0]) for name, _ in pipe.named_parameters() if name.endswith("weight"))
    return held == [s for s in range(8) if s % world == rank] and bool(torch.allclose(loss, mse(plain(x), x)))


def example_losses(rank: int, world: int) -> List[float]:
    """A few training steps whose losses go down, and whose loss every rank returns."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 6))
    pipe = Pipeline(model, [3, 2], chunks=4, loss_fn=mse, group=dist.group.WORLD)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05)
    x = torch.randn(32, 6)
    losses = []
    for _ in range(5):
        losses.append(_step(pipe, x, rank, world).item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _warm_pipeline(rank: int, world: int, **options: Any) -> Tuple[Pipeline, Tensor, Tensor]:
    """A pipeline of one Linear per rank that ran a step (the messages' layouts are known), its input (also the
    target), and the plain module's loss on it (no step changes the parameters: every step's loss is it)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(world)])
    x = torch.randn(4, 6)
    with torch.no_grad():
        expected = mse(model(x), x)
    pipe = Pipeline(model, [1] * world, chunks=2, loss_fn=mse, group=dist.group.WORLD, **options)
    _step(pipe, x, rank, world)
    return pipe, x, expected


def _gives_the_plain_loss(pipe: Pipeline, x: Tensor, rank: int, world: int, expected: Tensor) -> bool:
    """Whether one more step, on every rank, gives the plain module's loss."""
    loss = _step(pipe, x, rank, world)
    return bool(torch.allclose(loss, expected, rtol=1e-5, atol=1e-6))


def mismatched_modes(rank: int, world: int, evaluating: int = 1) -> Dict[str, Any]:
    """Rank ``evaluating`` calls step() in eval mode while the other trains: both raise, nobody waits; then a
    step in the same mode everywhere works."""
    pipe, x, expected = _warm_pipeline(rank, world)
    if rank == evaluating:
        pipe.eval()
    report = _failing_step(pipe, x, rank, world)
    pipe.train()
    report["next step"] = _gives_the_plain_loss(pipe, x, rank, world, expected)
    return report


def start_fails(rank: int, world: int, shared: bool = False) -> Dict[str, Any]:
    """The first stage's rank fails before it publishes the second step's start (it forgot its input): the
    other ranks, blocked in the store on that start, raise; a third step works everywhere. With ``shared``,
    the waits block on the store's shared connection, as where PyTorch cannot clone it."""
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(*[nn.Linear(6, 6) for _ in range(world)]), [1] * world, chunks=2, loss_fn=mse,
                    group=dist.group.WORLD)
    if shared:
        assert pipe._channel is not None
        pipe._channel.waits = pipe._channel.store
    x = torch.randn(4, 6)
    _step(pipe, x, rank, world)
    report = _failing_step(pipe, x, rank, world, no_input=True)  # rank 0's input is missing
    report["next step"] = float(_step(pipe, x, rank, world))
    return report


def begin_fails(rank: int, world: int, failing: int, where: str) -> Dict[str, Any]:
    """Rank ``failing`` fails after the second step's start is known and before its first action: making the
    step's state (``where="step"``) or its transport (``"transport"``). The other ranks, already in the step,
    waiting for its messages, raise; a third step works everywhere."""
    from torchpipe.distributed import step as distributed_step
    from torchpipe.runtime import runner

    pipe, x, expected = _warm_pipeline(rank, world, schedule="1f1b")
    module, name = {"step": (runner, "Step"), "transport": (distributed_step, "DistributedTransport")}[where]
    original = getattr(module, name)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected: no {where} on rank {rank}")

    if rank == failing:
        setattr(module, name, broken)
    try:
        report = _failing_step(pipe, x, rank, world)
    finally:
        setattr(module, name, original)
    if where == "step":  # the failing rank still made a transport to abort with: the pairs are in step
        report["next step"] = _gives_the_plain_loss(pipe, x, rank, world, expected)
    return report


def waits_in_vain(rank: int, world: int) -> Dict[str, Any]:
    """Rank 1 waits for the second step's start longer than the pipeline's timeout (1 s here): it raises, and so
    does rank 0, whose step then finds the failure; then a step with the usual timeout works everywhere."""
    pipe, x, expected = _warm_pipeline(rank, world)
    channel = pipe._channel
    assert channel is not None
    channel.waits.set_timeout(datetime.timedelta(seconds=1))
    if rank == 0:
        time.sleep(3)
    report = _failing_step(pipe, x, rank, world)
    channel.waits.set_timeout(datetime.timedelta(seconds=60))
    report["next step"] = _gives_the_plain_loss(pipe, x, rank, world, expected)
    return report


class _Interrupting:
    """The store connection a rank waits on, interrupted (KeyboardInterrupt) at its next wait: before the wait,
    or just after it got what it waited for."""

    def __init__(self, waits: Any, after: bool) -> None:
        self.waits, self.after, self.armed = waits, after, True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.waits, name)

    def multi_get(self, keys: List[str]) -> Any:
        if not self.armed:
            return self.waits.multi_get(keys)
        self.armed = False
        if self.after:
            self.waits.multi_get(keys)
        raise KeyboardInterrupt


def interrupted_start(rank: int, world: int, after: bool) -> Dict[str, Any]:
    """Rank 1 is interrupted while it waits for the second step's start (Ctrl-C in a notebook: the process goes
    on): before the start was published (rank 0 is a second late), or ``after`` it came. Both ranks raise
    within seconds; then a step works everywhere."""
    pipe, x, expected = _warm_pipeline(rank, world)
    channel = pipe._channel
    assert channel is not None
    if rank == 1:
        channel.waits = _Interrupting(channel.waits, after)
    elif not after:
        time.sleep(1)
    report = _failing_step(pipe, x, rank, world)
    if rank == 1:
        channel.waits = channel.waits.waits
    report["next step"] = _gives_the_plain_loss(pipe, x, rank, world, expected)
    return report


class StoreSpy:
    """A store connection that counts its calls by name and answers each ``delay`` seconds late (a rank that
    uses a slow one still needs the store after the others are done)."""

    def __init__(self, store: Any, delay: float = 0.0) -> None:
        self.store, self.delay = store, delay
        self.calls: Dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def spied(*args: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            answer = method(*args)
            time.sleep(self.delay)
            return answer

        return spied


def host_leaves_first(rank: int, world: int) -> float:
    """One step, then the process ends; every rank but 0 (the store's host) looks at the store slowly."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(world)])
    pipe = Pipeline(model, [1] * world, chunks=2, loss_fn=nn.MSELoss(), group=dist.group.WORLD)
    channel = pipe._channel
    assert channel is not None
    if rank != 0:
        channel.store, channel.waits = StoreSpy(channel.store, 0.3), StoreSpy(channel.waits, 0.3)
    x = torch.randn(4, 6)
    loss = _step(pipe, x, rank, world)
    return float(loss)


def host_ends_the_job_first(rank: int, world: int) -> Dict[str, Any]:
    """Two steps, then rank 0 (the store's host) ends; rank 1 goes on a while, its stderr (the C++ logs too)
    captured until its liveness ring has seen rank 0 go."""
    from torchpipe.distributed import liveness

    pipe, x, _ = _warm_pipeline(rank, world)
    _step(pipe, x, rank, world)
    if rank == 0:
        return {}
    ring = liveness._rings[tuple(range(world))]
    with tempfile.TemporaryFile() as log:
        sys.stderr.flush()
        kept = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            deadline = time.monotonic() + 20
            while ring.gone is None and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)  # what the ring does about it
        finally:
            os.dup2(kept, 2)
            os.close(kept)
        log.seek(0)
        return {"gone": ring.gone, "log": log.read().decode(errors="replace")}


def layouts_change(rank: int, world: int) -> List[str]:
    """Messages whose layout changes between steps: batch sizes, a mask's dtype, a skip not stashed (a failed
    step), then the first layout again. Every successful step's loss and gradients equal the plain module's."""
    torch.manual_seed(0)
    layers: List[nn.Module] = [Stash(), WithMask(), UseMask(), Pop()]
    model = nn.Sequential(*layers)
    plain = copy.deepcopy(model)
    pipe = Pipeline(model, [2, 2], chunks=3, loss_fn=mse, group=dist.group.WORLD)
    held = dict(pipe.named_parameters())
    problems: List[str] = []
    for step, (batch, dtype, stashes) in enumerate([
        (8, torch.int64, True), (5, torch.int64, True), (8, torch.int32, True), (8, torch.int32, False),
        (7, torch.int64, True), (8, torch.int64, True),
    ]):
        for m in (model, plain):
            m[0].stashes = stashes
            m[1].dtype = dtype
        torch.manual_seed(step)
        x, y = torch.randn(batch, 6), torch.randn(batch, 6)
        pipe.zero_grad()
        plain.zero_grad()
        try:
            loss = pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)
        except (RuntimeError, PipelineError) as exc:
            if stashes:
                problems.append(f"step {step}: {type(exc).__name__}: {exc}")
            elif "skip" not in str(exc):
                problems.append(f"step {step} failed for another reason than the missing stash: {exc}")
            continue
        if not stashes:
            problems.append(f"step {step}: popping a skip that was not stashed did not fail")
            continue
        expected = mse(plain(x), y)
        expected.backward()
        problems += _differences(f"step {step}", loss, expected, plain, held)
    return problems


def outboxes_refilled(rank: int, world: int) -> Dict[str, Any]:
    """Steps of one shape with new values each time (a skip and an integer mask among the messages), then another
    shape and the first again: every step's loss and gradients against the plain module's, and whether the packed
    buffers of the messages sent were the last step's, refilled."""
    model = model_for(world)
    plain = copy.deepcopy(model)
    pipe = Pipeline(model, [2] * world, chunks=4, loss_fn=mse, group=dist.group.WORLD)
    held = dict(pipe.named_parameters())
    channel = pipe._channel
    assert channel is not None
    problems: List[str] = []
    buffers: List[Dict[Any, int]] = []
    for step, batch in enumerate([8, 8, 8, 6, 8, 8]):
        torch.manual_seed(100 + step)
        x = torch.randn(batch, 6)
        loss = _step(pipe, x, rank, world)
        expected = mse(plain(x), x)
        expected.backward()
        problems += _differences(f"step {step} (batch {batch})", loss, expected, plain, held)
        buffers.append({key: box.buffer.data_ptr() for key, box in memory_of(channel).outboxes.items()})
    # The first crossing of each message sends fillers first (see [Note: expected layouts]): the buffers are kept
    # from the second step.
    return {"problems": problems, "kept": len(buffers[1]), "refilled": buffers[2] == buffers[1],
            "refilled after a change": buffers[5] == buffers[4]}


def busy_looks(rank: int, world: int) -> Dict[str, Any]:
    """A step of about 0.7 s in which each rank is busy most of the time (16 micro-batches, a layer per stage
    takes 40 ms a forward): how often each rank looked at the store for a failure, and whether the step gave the
    plain module's loss."""
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(world):
        layers += [nn.Linear(6, 6), Sleep(0.04)]  # busy with its actions, not waiting
    model = nn.Sequential(*layers)
    x = torch.randn(16, 6)
    with torch.no_grad():
        expected = mse(model(x), x)
    pipe = Pipeline(model, [2] * world, chunks=16, loss_fn=mse, group=dist.group.WORLD)
    _step(pipe, x, rank, world)
    channel = pipe._channel
    assert channel is not None
    channel.store = counting = StoreSpy(channel.store)
    start = time.monotonic()
    loss = _step(pipe, x, rank, world)
    seconds = time.monotonic() - start
    channel.store = counting.store
    return {"looks": counting.calls.get("check", 0), "seconds": seconds,
            "plain loss": bool(torch.allclose(loss, expected, rtol=1e-5, atol=1e-6))}


def keys_stay_few(rank: int, world: int) -> Dict[str, Any]:
    """The number of keys in the store after a few steps, and after 30 more (one of which fails): each step
    writes keys of its own, which must go as steps go."""
    pipe, x, expected = _warm_pipeline(rank, world)
    store = dist.distributed_c10d._get_default_store()
    for _ in range(4):
        _step(pipe, x, rank, world)
    before = int(store.num_keys())
    for step in range(30):
        if step == 10:
            _failing_step(pipe, x, rank, world, no_input=True)
        else:
            _step(pipe, x, rank, world)
    after = int(store.num_keys())
    return {"before": before, "after": after, "next step": _gives_the_plain_loss(pipe, x, rank, world, expected)}
