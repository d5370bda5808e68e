"""What each rank runs in the tests of training loops across processes: ranks that must agree, token-level losses,
accumulation, a target missing on the last stage's rank (called by tests/distributed/launch.py)."""
import copy
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn

from tests.loops import llama as tiny_llama
from tests.loops import padded_batch, plain_loss, token_loss, tokens, traced_llama
from torchpipe import Pipeline


def _small(width: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 6), nn.Tanh(), nn.Linear(6, 2))


def disagreeing(rank: int, world: int, what: str) -> Dict[str, Any]:
    """Rank 1 builds its Pipeline with another ``what`` than rank 0: the error each rank raises."""
    balance, chunks, width, schedule = [2, 3], 2, 6, "1f1b"
    if rank == 1:
        if what == "balance":
            balance = [3, 2]
        elif what == "chunks":
            chunks = 4
        elif what == "layer":
            width = 5
        elif what == "schedule":
            schedule = "gpipe"
    try:
        Pipeline(_small(width), balance, chunks=chunks, schedule=schedule, loss_fn=nn.functional.mse_loss,
                 group=dist.group.WORLD)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None, "message": ""}


def _held(model: nn.Module, pipe: Pipeline) -> Dict[str, nn.Parameter]:
    """The model's parameters this rank's stages hold, by the model's names."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: p for p in pipe.parameters() if id(p) in names}


def _compare(case: str, loss: torch.Tensor, expected: torch.Tensor, held: Dict[str, nn.Parameter],
             plain: nn.Module, problems: List[str]) -> None:
    if not torch.allclose(loss, expected.detach()):
        problems.append(f"{case}: loss {loss.item()} != {expected.item()}")
    for name, want in plain.named_parameters():
        got = held.get(name)
        if got is not None and not torch.allclose(got.grad, want.grad, atol=1e-10):
            problems.append(f"{case}: gradient of {name} differs by {(got.grad - want.grad).abs().max().item()}")


def token_loss_across_ranks(rank: int, world: int) -> List[str]:
    """A padded Llama on ``world`` ranks with a token-level loss weighted by ``loss_weight``: loss and every
    gradient equal the plain model's mean over the mini-batch's tokens, under several schedules, with uneven
    micro-batches, and two steps accumulated with ``loss_scale`` equal the plain ``(loss / 2).backward()``."""
    problems: List[str] = []
    for schedule, chunks in [("1f1b", 4), ("gpipe", 3), ("zero_bubble", 4)]:
        model = tiny_llama()
        plain = copy.deepcopy(model)
        seq = traced_llama(model)
        cut = len(seq) // 2
        pipe = Pipeline(seq, [cut, len(seq) - cut], chunks=chunks, schedule=schedule, loss_fn=token_loss,
                        loss_weight=tokens, group=dist.group.WORLD)
        first, last = pipe.schedule.stage_workers[0], pipe.schedule.stage_workers[-1]
        held = _held(model, pipe)
        for step in range(2):
            batch, labels = padded_batch(7, seed=10 * step + 1)
            loss = pipe.step(batch if rank == first else None, labels if rank == last else None, loss_scale=0.5)
            expected = plain_loss(plain, batch, labels)
            (expected / 2).backward()
            _compare(f"{schedule} step {step}", loss, expected, held, plain, problems)
    return problems


def token_loss_on_a_mesh(rank: int, world: int, mode: str) -> List[str]:
    """Two replicas of a two-stage padded Llama on a (2, 2) mesh, whose mini-batches hold different numbers of
    tokens (and of rows): loss and gradients equal the plain model's token mean over both mini-batches."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica, position = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    problems: List[str] = []
    model = tiny_llama()
    plain = copy.deepcopy(model)
    seq = traced_llama(model)
    cut = len(seq) // 2
    pipe = Pipeline(seq, [cut, len(seq) - cut], chunks=3, schedule="1f1b", loss_fn=token_loss, loss_weight=tokens,
                    mesh=mesh, data_parallel=mode)
    names = [n for n, _ in seq.named_parameters()]
    for step in range(2):
        every = [padded_batch(rows, seed=100 * step + r) for r, rows in enumerate((5, 3))]
        (ids, mask), labels = every[replica]
        loss = pipe.step((ids, mask) if position == 0 else None, labels if position == 1 else None)
        expected = plain_loss(plain, (torch.cat([b[0][0] for b in every]), torch.cat([b[0][1] for b in every])),
                              torch.cat([b[1] for b in every]))
        expected.backward()
        counts = [int(tokens(b[1])) for b in every]
        if counts[0] == counts[1]:
            problems.append(f"step {step}: the replicas hold the same number of tokens ({counts}): no test")
        if not torch.allclose(loss, expected.detach()):
            problems.append(f"step {step}: loss {loss.item()} != {expected.item()}")
        state = dict(pipe.named_parameters())
        for name, want in plain.named_parameters():
            got = state.get(name) if name in names else None
            if got is None:
                continue
            grad = got.grad.full_tensor() if hasattr(got.grad, "full_tensor") else got.grad
            if not torch.allclose(grad, want.grad, atol=1e-10):
                problems.append(f"step {step}: gradient of {name} differs")
    return problems


def missing_target(rank: int, world: int) -> Dict[str, Any]:
    """The last stage's rank passes no target: it raises ``ValueError`` saying it must, the other a
    ``PipelineError``; the next step, with the target, works."""
    pipe = Pipeline(_small(), [2, 3], chunks=2, loss_fn=nn.functional.mse_loss, group=dist.group.WORLD)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    report: Dict[str, Any] = {}
    try:
        pipe.step(x if rank == 0 else None, None)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        report = {"raised": type(exc).__name__, "message": str(exc)}
    report["next"] = float(pipe.step(x if rank == 0 else None, y if rank == 1 else None))
    return report
