"""What each rank runs in the test of the loop-placed and V-shaped schedules across processes (issue 36)."""
import copy
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.distributed.ranks import _differences, model_for, mse
from tests.distributed.ranks_mesh import _compare, balance_for, drifted, mesh_of
from tests.test_ties import lm_loss, tied_lm, tokens
from torchpipe import Pipeline
from torchpipe.distributed.transport import DistributedTransport
from torchpipe.schedule.auto import AutoTuner

NEW = ["looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev"]


def _step(pipe: Pipeline, rank: int, x: Tensor, y: Tensor) -> Tensor:
    """A step with the input on the first stage's rank and the target on the last stage's, whichever they are."""
    placement = pipe.schedule.stage_workers
    return pipe.step(x if rank == placement[0] else None, y if rank == placement[-1] else None)


def new_schedules(rank: int, world: int) -> List[str]:
    """Each new schedule over 2 * world stages, one worker per rank: a skip-and-mask model under every checkpoint
    mode and a tied embedding and head (the same rank's in the V), on the WORLD group, then a V on a mesh
    (dp = 1). Returns what differed from the plain module (empty: nothing), and where the placement is wrong."""
    problems: List[str] = []
    stages = 2 * world
    for schedule in NEW:
        for checkpoint in ("never", "always", "except_last"):
            model = model_for(stages)
            plain = copy.deepcopy(model)
            pipe = Pipeline(model, [2] * stages, chunks=4, schedule=schedule, loss_fn=mse, checkpoint=checkpoint,
                            group=dist.group.WORLD)
            expected_stages = [rank, stages - 1 - rank] if schedule in ("zbv", "dualpipev") else [rank, rank + world]
            held = [s for s, stage in enumerate(pipe.stages) if stage is not None]
            if sorted(held) != sorted(expected_stages):
                problems.append(f"{schedule}: rank {rank} holds stages {held}, not {expected_stages}")
            params = dict(pipe.named_parameters())
            for batch in (8, 3):  # 3 rows: 3 micro-batches, fewer than dualpipev's 2 * world
                torch.manual_seed(batch)
                x, y = torch.randn(batch, 6), torch.randn(batch, 6)
                loss = _step(pipe, rank, x, y)
                expected = mse(plain(x), y)
                expected.backward()
                problems += _differences(f"{schedule} {checkpoint} batch={batch}", loss, expected, plain, params)
        problems += _tied(schedule, rank, world, lambda model, schedule=schedule: Pipeline(
            model, balance_for(len(model), stages), chunks=4, schedule=schedule, loss_fn=lm_loss,
            group=dist.group.WORLD))
    problems += _tied("zbv on a mesh", rank, world, lambda model: Pipeline(
        model, balance_for(len(model), stages), chunks=4, schedule="zbv", loss_fn=lm_loss,
        mesh=mesh_of(1, world)))
    return problems


def _tied(case: str, rank: int, world: int, make: Callable[[nn.Sequential], Pipeline]) -> List[str]:
    """Two SGD steps of a tied language model: the loss, every gradient and the weights stay the plain module's."""
    problems: List[str] = []
    model = tied_lm(layers=4 * world)
    plain = copy.deepcopy(model)
    pipe = make(model)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    reference = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(2):
        x, y = tokens(batch=8, seed=step)
        loss = _step(pipe, rank, x, y)
        expected = lm_loss(plain(x), y)
        expected.backward()
        if not torch.allclose(loss, expected.detach()):
            problems.append(f"{case} tied step {step}: loss {loss.item()} != {expected.item()}")
        _compare(f"{case} tied step {step}", pipe, plain, problems)
        optimizer.step()
        reference.step()
        optimizer.zero_grad()
        reference.zero_grad()
    problems += drifted(f"{case} tied: after 2 steps", pipe, plain)
    return problems


def v_balance_that_does_not_fit(rank: int, world: int) -> str:
    """A V whose balance has not 2 * world entries: the ValueError's message."""
    try:
        Pipeline(model_for(world), [2] * world, chunks=4, schedule="zbv", loss_fn=mse, group=dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return "no error"


def auto_choice(rank: int, world: int) -> Dict[str, Any]:
    """schedule='auto' over 2 * world stages (the V's placement) and over world stages: every step's loss and
    gradients, the costs every rank decided from, and its choice."""
    problems: List[str] = []
    choices: List[str] = []
    costs: List[List[Any]] = []
    relayouts: List[float] = []
    # Per step, how many messages this rank took whose layout it did not expect (each waited for a relayout).
    per_step: List[int] = []
    finish = DistributedTransport.finish

    def counted(transport: DistributedTransport) -> None:
        per_step.append(len(transport.relayouts))
        finish(transport)

    DistributedTransport.finish = counted  # type: ignore[method-assign]  # this rank's process only
    for stages in (2 * world, world):
        model = model_for(stages)
        plain = copy.deepcopy(model)
        pipe = Pipeline(model, [2] * stages, chunks=4, schedule="auto", loss_fn=mse, group=dist.group.WORLD)
        params = dict(pipe.named_parameters())
        for step in range(3):
            torch.manual_seed(step)
            x, y = torch.randn(8, 6), torch.randn(8, 6)
            loss = _step(pipe, rank, x, y)
            expected = mse(plain(x), y)
            expected.backward()
            problems += _differences(f"auto {stages} stages step {step}", loss, expected, plain, params)
        tuner = pipe._tuner
        assert isinstance(tuner, AutoTuner)
        choices.append(pipe.schedule_name)
        costs.append(sorted((s, kind.value, cost) for (s, kind), cost in tuner.costs.items()))
        relayouts.append(tuner.relayout)
    return {"problems": problems, "choices": choices, "costs": costs, "relayouts": relayouts,
            "relayouts_per_step": per_step}
