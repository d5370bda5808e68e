"""What each rank runs in the tests of tied weights across ranks and of pipelines on a 2-D mesh (issue 16, 17)."""
import copy
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.distributed.ranks import reported
from tests.test_ties import lm_loss, tied_lm, tokens
from torchpipe import Pipeline


def mesh_of(dp: int, pp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))


def balance_for(layers: int, stages: int) -> List[int]:
    return [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]


def _compare(case: str, pipe: Pipeline, plain: nn.Module, problems: List[str], rtol: float = 1e-7) -> None:
    """Every gradient this rank holds against the plain module's (by plain key, tied keys included)."""
    expected = {name: p.grad for name, p in plain.named_parameters(remove_duplicate=False)}
    for name, param in pipe.named_parameters(remove_duplicate=False):
        want = expected[name]
        if (param.grad is None) != (want is None):
            problems.append(f"{case}: gradient of {name} is {param.grad} but the plain module's is {want}")
        elif want is not None and not torch.allclose(_full(param.grad), want, rtol=rtol, atol=1e-9):
            problems.append(f"{case}: gradient of {name} differs by {(_full(param.grad) - want).abs().max()}")


def drifted(case: str, pipe: Pipeline, plain: nn.Module) -> List[str]:
    """The plain module's values this rank holds that its pipeline's no longer equal (after the same steps)."""
    state = pipe.state_dict()
    return [f"{case} {key} drifted from the plain module's" for key, value in plain.state_dict().items()
            if key in state and not torch.allclose(state[key], value)]


def _full(tensor: Tensor) -> Tensor:
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def tied_across_ranks(rank: int, world: int) -> List[str]:
    """The embedding on the first rank, the head (the same weight) on the last: every schedule, several Adam
    steps; loss, every gradient and the copies' values equal the plain module's."""
    problems: List[str] = []
    for schedule in ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]:
        stages = 2 * world if schedule == "interleaved_1f1b" else world
        model = tied_lm(layers=stages * 2)
        plain = copy.deepcopy(model)
        if rank == world - 1:
            with torch.no_grad():  # the last rank's copy starts elsewhere: the first holder's values win
                model[-1].weight.add_(1.0)
        pipe = Pipeline(model, balance_for(len(model), stages), chunks=3, schedule=schedule, loss_fn=lm_loss,
                        group=dist.group.WORLD)
        optimizer = torch.optim.Adam(pipe.parameters(), lr=0.05)
        reference = torch.optim.Adam(plain.parameters(), lr=0.05)
        for step in range(3):
            x, y = tokens(batch=5, seed=step)
            loss = pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)
            expected = lm_loss(plain(x), y)
            expected.backward()
            if not torch.allclose(loss, expected.detach()):
                problems.append(f"{schedule} step {step}: loss {loss.item()} != {expected.item()}")
            _compare(f"{schedule} step {step}", pipe, plain, problems)
            norm = pipe.clip_grad_norm_(0.05)  # the whole model's norm, the tie counted once
            expected_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
            if not torch.allclose(norm, expected_norm):
                problems.append(f"{schedule} step {step}: norm {norm.item()} != {expected_norm.item()}")
            _compare(f"{schedule} step {step} clipped", pipe, plain, problems)
            optimizer.step()
            reference.step()
            optimizer.zero_grad()
            reference.zero_grad()
        problems += drifted(f"{schedule}: after 3 steps", pipe, plain)
        state = pipe.state_dict()
        # The head's rank also holds its copy under the first holder's name, first (the name the optimizer's
        # state and DCP key it by, whatever the layout): docs/language_models.md, "State dicts".
        head = f"{len(model) - 1}.weight"
        held = [key for key in state if key in ("0.weight", head)]
        expected_keys = ["0.weight"] if rank == 0 else ["0.weight", head]
        if held != expected_keys:
            problems.append(f"{schedule}: rank {rank} holds the tied weight under {held}, not {expected_keys}")
    return problems


def _mesh_data(replica: int, step: int, sizes: Tuple[int, ...]) -> Tuple[Tensor, Tensor]:
    return tokens(batch=sizes[replica], seed=100 * step + replica)


def replicate_transparency(rank: int, world: int, mode: str, dp: int, pp: int) -> List[str]:
    """dp replicas of a pp-stage pipeline: loss on every rank and every gradient equal the plain module's on the
    concatenation of all replicas' batches (of different sizes), for several schedules, with gradients
    accumulated over two steps, then after an optimizer step."""
    mesh = mesh_of(dp, pp)
    replica, position = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    problems: List[str] = []
    for schedule, chunks in [("1f1b", 3), ("gpipe", 2), ("zero_bubble", 4)]:
        model = tied_lm(layers=2 * pp)
        plain = copy.deepcopy(model)
        pipe = Pipeline(model, balance_for(len(model), pp), chunks=chunks, schedule=schedule, loss_fn=lm_loss,
                        mesh=mesh, data_parallel=mode)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        reference = torch.optim.SGD(plain.parameters(), lr=0.1)
        for round in range(2):
            for step in range(2):  # two steps' gradients accumulate before the optimizer step
                sizes = (5, 3, 4, 2)[:dp] if step == 0 else (2, 6, 1, 3)[:dp]
                x, y = _mesh_data(replica, step + 2 * round, sizes)
                loss = pipe.step(x if position == 0 else None, y if position == pp - 1 else None)
                every = [_mesh_data(r, step + 2 * round, sizes) for r in range(dp)]
                expected = lm_loss(plain(torch.cat([x for x, _ in every])), torch.cat([y for _, y in every]))
                expected.backward()
                case = f"{mode} {schedule} round {round} step {step}"
                if not torch.allclose(loss, expected.detach()):
                    problems.append(f"{case}: loss {loss.item()} != {expected.item()}")
                _compare(case, pipe, plain, problems)
            norm = pipe.clip_grad_norm_(0.05, norm_type=3.0)  # over both dimensions
            expected_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05, norm_type=3.0)
            if not torch.allclose(norm, expected_norm):
                problems.append(f"{mode} {schedule} round {round}: norm {norm.item()} != {expected_norm.item()}")
            _compare(f"{mode} {schedule} round {round} clipped", pipe, plain, problems)
            optimizer.step()
            reference.step()
            optimizer.zero_grad()
            reference.zero_grad()
    return problems


def failure_on_one_replica(rank: int, world: int, mode: str, first_stage_sleeps: float = 0.0) -> Dict[str, Any]:
    """A layer raises on one rank of replica 1 (its second stage's first layer): every rank of both replicas
    ends the step within seconds; the next step works everywhere.

    ``first_stage_sleeps``: replica 0's first stage sleeps that long in the first step's first forward, so that
    replica 0's second stage learns of the failure before it ever ran a forward.
    """
    mesh = mesh_of(2, 2)
    replica, position = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")

    class Sleeps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sleep = first_stage_sleeps if replica == 0 else 0.0

        def forward(self, x: Tensor) -> Tensor:
            time.sleep(self.sleep)
            self.sleep = 0.0
            return x

    class Fails(nn.Module):
        failing = True

        def forward(self, x: Tensor) -> Tensor:
            if self.failing and replica == 1:
                raise ValueError("layer failed on purpose")
            return x

    layers: List[nn.Module] = list(tied_lm(layers=2))
    model = nn.Sequential(Sleeps(), *layers[:3], Fails(), *layers[3:])
    pipe = Pipeline(model, [4, 4], chunks=2, loss_fn=lm_loss, mesh=mesh, data_parallel=mode)
    x, y = tokens(batch=4, seed=replica)
    report = reported(lambda: pipe.step(x if position == 0 else None, y if position == 1 else None))
    model[4].failing = False
    pipe.zero_grad()
    loss = pipe.step(x if position == 0 else None, y if position == 1 else None)
    report["next step"] = bool(torch.isfinite(loss))
    return report


def start_fails_on_one_replica(rank: int, world: int) -> Dict[str, Any]:
    """Replica 1's first stage forgets its input in the second step, a second after replica 0's first stage
    published its start: every rank raises within seconds (the ranks of replica 0 had all it takes to run
    their part of the step but the other replica's start); the next step works everywhere."""
    mesh = mesh_of(2, 2)
    replica, position = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    model = tied_lm(layers=2)
    pipe = Pipeline(model, balance_for(len(model), 2), chunks=2, loss_fn=lm_loss, mesh=mesh)
    x, y = tokens(batch=4, seed=replica)
    pipe.step(x if position == 0 else None, y if position == 1 else None)
    forgets = replica == 1 and position == 0
    if forgets:
        time.sleep(1)
    report = reported(lambda: pipe.step(x if position == 0 and not forgets else None, y if position == 1 else None))
    report["next step"] = float(pipe.step(x if position == 0 else None, y if position == 1 else None))
    return report


def bad_arguments(rank: int, world: int) -> List[str]:
    """Bad meshes and data_parallel values are a ValueError on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    errors = []
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for mesh, mode in [
        (init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")), "zero"),
        (init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "pipe")), "replicate"),
        (init_device_mesh("cpu", (4,), mesh_dim_names=("pp",)), "replicate"),
    ]:
        try:
            Pipeline(model, [1, 1], mesh=mesh, data_parallel=mode)
            errors.append("no error")
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def parameter_bytes(rank: int, world: int, mode: str) -> int:
    """The bytes of the parameters this rank holds after a training step (DTensors: the local shard)."""
    mesh = mesh_of(2, 2)
    replica, position = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    pipe = Pipeline(model, [2, 2], chunks=2, loss_fn=nn.functional.mse_loss, mesh=mesh, data_parallel=mode)
    x = torch.randn(4, 64)
    pipe.step(x if position == 0 else None, x if position == 1 else None)
    total = 0
    for param in pipe.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    assert replica in (0, 1)
    return total


# --- checkpoints with torch.distributed.checkpoint ----------------------------------------------------------


def _layout_pipeline(layout: str, model: nn.Sequential, rank: int) -> Tuple[Pipeline, int, int]:
    """``'2x2-shard'`` (dp x pp, mode), ``'1x4-replicate'``, ``'group-2'`` (a pipeline over the world), or
    ``'local-3'`` (3 stages in one process); with the replica's and stage's index of this rank (-1: all)."""
    kind, _, rest = layout.partition("-")
    if kind == "group":
        stages = int(rest)
        pipe = Pipeline(model, balance_for(len(model), stages), chunks=2, loss_fn=lm_loss, group=dist.group.WORLD)
        return pipe, 0, rank
    if kind == "local":
        stages = int(rest)
        return Pipeline(model, balance_for(len(model), stages), chunks=2, loss_fn=lm_loss,
                        devices=["cpu"] * stages), 0, -1
    dp, pp = (int(n) for n in kind.split("x"))
    mesh = mesh_of(dp, pp)
    pipe = Pipeline(model, balance_for(len(model), pp), chunks=2, loss_fn=lm_loss, mesh=mesh, data_parallel=rest)
    return pipe, mesh.get_local_rank("dp"), mesh.get_local_rank("pp")


def _local_state(pipe: Pipeline, optimizer: torch.optim.Optimizer) -> Dict[str, Tensor]:
    """This rank's parameters and Adam states by plain name, whole (a sharded one gathered: a collective)."""
    names = {id(p): n for n, p in pipe.named_parameters()}
    state: Dict[str, Tensor] = {f"model.{n}": _full(p.detach()).clone() for n, p in pipe.named_parameters()}
    for param, values in optimizer.state.items():
        for key, value in values.items():
            state[f"optim.{names[id(param)]}.{key}"] = _full(value).clone()
    return state


def dcp_save(rank: int, world: int, path: str, layout: str, background: bool = False) -> Dict[str, Tensor]:
    """Trains two steps under ``layout``, saves model and Adam state with DCP; returns this rank's values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model = tied_lm(layers=4)
    pipe, replica, position = _layout_pipeline(layout, model, rank)
    stages = len(pipe.balance)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.05)
    for step in range(2):
        x, y = tokens(batch=4, seed=10 * step + replica)
        pipe.step(x if position in (0, -1) else None, y if position in (stages - 1, -1) else None)
        optimizer.step()
        optimizer.zero_grad()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state, optim_state = get_state_dict(pipe, optimizer, options=options)
    if background and hasattr(dcp, "async_save"):
        dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=path).result()
    else:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return _local_state(pipe, optimizer)


def dcp_load(rank: int, world: int, path: str, layout: str) -> Dict[str, Tensor]:
    """Loads the checkpoint into a fresh pipeline of ``layout`` (and Adam); returns this rank's values."""
    torch.manual_seed(123)
    model = tied_lm(layers=4)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()  # nothing of the saved values
    pipe, replica, position = _layout_pipeline(layout, model, rank)
    stages = len(pipe.balance)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.05)
    # Adam's state exists after a step; make it, then overwrite it from the checkpoint.
    x, y = tokens(batch=4, seed=99)
    pipe.step(x if position in (0, -1) else None, y if position in (stages - 1, -1) else None)
    optimizer.step()
    optimizer.zero_grad()
    load_checkpoint(pipe, optimizer, path)
    return _local_state(pipe, optimizer)


def load_checkpoint(pipe: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Loads the DCP checkpoint at ``path`` into ``pipe`` and ``optimizer`` (flattened optimizer state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state, optim_state = get_state_dict(pipe, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(pipe, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)


def full_state_on_a_mesh(rank: int, world: int, mode: str) -> Dict[str, Any]:
    """full_state_dict() on a 2 x 2 mesh: the whole plain state dict on global rank 0 only."""
    model = tied_lm(layers=2)
    pipe, replica, position = _layout_pipeline(f"2x2-{mode}", model, rank)
    x, y = tokens(batch=4, seed=replica)
    pipe.step(x if position == 0 else None, y if position == 1 else None)
    with torch.no_grad():
        for param in pipe.parameters():
            param.add_(1.0)
    state = pipe.full_state_dict()
    if not state:
        return {"keys": 0}
    plain = tied_lm(layers=2)
    plain.load_state_dict(state)
    expected = {n: p + 1.0 for n, p in tied_lm(layers=2).named_parameters()}
    return {"keys": len(state), "equal": all(torch.equal(p, expected[n]) for n, p in plain.named_parameters())}


def reductions_on_the_timeline(rank: int, world: int, mode: str) -> List[str]:
    """The timeline of two steps on a 2 x 2 mesh: one 'reduce' span per stage per step."""
    from torchpipe import trace

    model = tied_lm(layers=2)
    pipe, replica, position = _layout_pipeline(f"2x2-{mode}", model, rank)
    x, y = tokens(batch=4, seed=replica)
    with trace.record_timeline() as timeline:
        for _ in range(2):
            pipe.step(x if position == 0 else None, y if position == 1 else None)
    return [span.label for span in timeline if span.kind == "reduce"]
