"""torchpipe.Checkpointer in one process: saves, restores across balances, the bit-level claim, bad input.

The multi-process behaviour (ranks killed under torchrun, during a save, on a
mesh) is in tests/distributed/test_restart.py.
"""
import json
import os
import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy
import pytest
import torch
from torch import Tensor, nn

import torchpipe
from torchpipe.checkpointer import MARK

pytest.importorskip("torch.distributed.checkpoint.state_dict")


def model(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    ).double()


def batch(step: int) -> Tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(10, 6, generator=generator, dtype=torch.float64), torch.randint(0, 3, (10,), generator=generator)


def pipeline(balance: Sequence[int], dropout: float = 0.0) -> torchpipe.Pipeline:
    return torchpipe.Pipeline(model(dropout), list(balance), chunks=3, loss_fn=nn.functional.cross_entropy,
                              devices=["cpu"] * len(balance))


def train(
    directory: Path,
    balance: Sequence[int],
    steps: int,
    *,
    every: int = 3,
    stop: Optional[int] = None,
    dropout: float = 0.0,
    keep: int = 3,
) -> Dict[str, Any]:
    """Trains to ``steps`` (resuming from ``directory``), or until ``stop`` steps, as a job that then dies; what it
    saw: where it started, its losses, draws from the RNGs after each step, its final weights."""
    pipe = pipeline(balance, dropout)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
    ckpt = torchpipe.Checkpointer(directory, pipe, optimizer, every=every, keep=keep)
    start = ckpt.restore()
    position = ckpt.extra["position"] if ckpt.extra is not None else 0
    assert position == start
    losses: List[float] = []
    draws: List[Tuple[float, float, float]] = []
    for step in range(start, steps if stop is None else stop):
        loss = pipe.step(*batch(step))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        draws.append((torch.rand(()).item(), random.random(), float(numpy.random.rand())))
        ckpt.step(step + 1, extra={"position": step + 1})
    if stop is None:
        ckpt.close()
    else:
        ckpt.wait()  # the job dies after its last save has been written (as a crash would, a step later)
    return {"start": start, "losses": losses, "draws": draws,
            "state": {k: v.clone() for k, v in pipe.state_dict().items()}, "ckpt": ckpt}


def seed_everything() -> None:
    torch.manual_seed(5)
    random.seed(5)
    numpy.random.seed(5)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_a_resumed_run_equals_the_uninterrupted_one_to_1e_12(tmp_path: Path, dropout: float) -> None:
    seed_everything()
    whole = train(tmp_path / "whole", [2, 2, 2], 8, dropout=dropout)
    seed_everything()
    first = train(tmp_path / "resumed", [2, 2, 2], 8, stop=5, dropout=dropout)  # dies after step 5; saved at 3
    assert first["start"] == 0
    torch.manual_seed(99)  # a restarted process starts with other RNG states: the checkpoint's must win
    random.seed(99)
    numpy.random.seed(99)
    second = train(tmp_path / "resumed", [2, 2, 2], 8, dropout=dropout)
    assert second["start"] == 3
    losses = first["losses"][:3] + second["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(whole["losses"]), rtol=0, atol=1e-12)
    assert first["draws"][:3] + second["draws"] == whole["draws"]  # every RNG goes on as it would have
    for key, value in whole["state"].items():
        torch.testing.assert_close(second["state"][key], value, rtol=0, atol=1e-12, msg=key)


@pytest.mark.parametrize("saved, restored", [([2, 2, 2], [4, 2]), ([3, 3], [1, 2, 2, 1]), ([2, 2, 2], [6])])
def test_a_checkpoint_resumes_under_another_balance(tmp_path: Path, saved: List[int], restored: List[int]) -> None:
    seed_everything()
    whole = train(tmp_path / "whole", saved, 7)
    seed_everything()
    train(tmp_path / "resumed", saved, 7, stop=4)
    second = train(tmp_path / "resumed", restored, 7)
    assert second["start"] == 3
    for key, value in whole["state"].items():
        torch.testing.assert_close(second["state"][key], value, rtol=0, atol=1e-12, msg=key)


def test_without_a_checkpoint_restore_returns_0_and_changes_nothing(tmp_path: Path) -> None:
    pipe = pipeline([3, 3])
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    rng = torch.get_rng_state()
    ckpt = torchpipe.Checkpointer(tmp_path / "new" / "folder", pipe, optimizer, every=2)
    assert ckpt.restore() == 0 and ckpt.extra is None
    assert not optimizer.state  # DCP makes an optimizer state to load into: not here, where nothing is loaded
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())
    assert (tmp_path / "new" / "folder").is_dir()
    ckpt.close()


def test_saves_every_n_steps_and_keeps_the_newest(tmp_path: Path) -> None:
    result = train(tmp_path, [3, 3], 11, every=2, keep=2)
    assert result["ckpt"].checkpoints() == [8, 10]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-8"]
    mark = json.loads((tmp_path / "step-10" / MARK).read_text())
    assert mark["step"] == 10 and mark["ranks"] == 1


def test_an_incomplete_checkpoint_is_ignored_then_removed(tmp_path: Path) -> None:
    train(tmp_path, [3, 3], 6, every=3)  # complete: 3, 6
    # A crash while step 9 was written: files, no mark. And a complete one whose mark was removed half way.
    (tmp_path / "step-9").mkdir()
    (tmp_path / "step-9" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "step-6" / MARK).unlink()
    seed_everything()
    resumed = train(tmp_path, [3, 3], 7, every=3, stop=6)
    assert resumed["start"] == 3  # not 9, not 6
    # The next save (step 6) removed what the dead attempt left.
    assert not (tmp_path / "step-9").exists()
    assert resumed["ckpt"].checkpoints() == [3, 6]


def test_the_save_is_of_the_state_when_step_was_called(tmp_path: Path) -> None:
    # step() returns while the write goes on: what it writes is what the model held when step() was called.
    pipe = pipeline([3, 3])
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    pipe.step(*batch(0))
    optimizer.step()
    optimizer.zero_grad()
    saved = {k: v.clone() for k, v in pipe.state_dict().items()}
    with torchpipe.Checkpointer(tmp_path, pipe, optimizer, every=1) as ckpt:
        assert ckpt.step(1)
        with torch.no_grad():
            for param in pipe.parameters():
                param.add_(1.0)  # right away, while the save may still be writing
        assert not ckpt.step(1)  # the step just saved: not again
    other = pipeline([2, 4])
    with torchpipe.Checkpointer(tmp_path, other, torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)) as ckpt:
        assert ckpt.restore() == 1
    for key, value in saved.items():
        assert torch.equal(other.state_dict()[key], value), key


@pytest.mark.parametrize("layers, expected", [
    # Other widths and a layer more: the shapes differ, and the checkpoint lacks the new layer's keys.
    ([nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.0), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3), nn.Tanh(),
      nn.Linear(3, 3)],
     ["keys it lacks: 'model.7.bias', 'model.7.weight'", "'model.3.weight': (16, 16) in the checkpoint, (8, 16) here",
      "'model.5.weight': (3, 16) in the checkpoint, (3, 8) here"]),
    # A layer less: the checkpoint has keys of the model that no rank here holds.
    ([nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.0), nn.Linear(16, 3)],
     ["model keys no rank here holds: 'model.5.bias', 'model.5.weight'",
      "'model.3.weight': (16, 16) in the checkpoint, (3, 16) here"]),
])
def test_a_checkpoint_of_another_model_is_refused_naming_the_keys(
    tmp_path: Path, layers: List[nn.Module], expected: List[str]
) -> None:
    train(tmp_path, [3, 3], 3, every=3)
    other = torchpipe.Pipeline(nn.Sequential(*layers).double(), [2, len(layers) - 2], chunks=3,
                               loss_fn=nn.functional.cross_entropy, devices=["cpu", "cpu"])
    optimizer = torch.optim.Adam(other.parameters(), lr=0.01)
    other.step(*batch(0))
    optimizer.step()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    moments = [v.clone() for state in optimizer.state.values() for v in state.values()]
    ckpt = torchpipe.Checkpointer(tmp_path, other, optimizer, every=3)
    with pytest.raises(ValueError) as error:
        ckpt.restore()
    message = str(error.value)
    assert message.startswith("the checkpoint is not of this model"), message
    for part in expected:
        assert part in message, (part, message)
    assert "Nothing was loaded" in message
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    now = [v for state in optimizer.state.values() for v in state.values()]
    assert len(now) == len(moments) and all(torch.equal(a, b) for a, b in zip(now, moments))
    ckpt.close()


@pytest.mark.parametrize("every, keep, what", [
    (0, 3, "every must be an integer of at least 1"), (-2, 3, "every must be"), (2.5, 3, "every must be"),
    (2, 0, "keep must be an integer of at least 1"),
])
def test_bad_every_and_keep_are_a_value_error(tmp_path: Path, every: Any, keep: Any, what: str) -> None:
    pipe = pipeline([6])
    with pytest.raises(ValueError, match=what):
        torchpipe.Checkpointer(tmp_path, pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), every=every, keep=keep)
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_file_in_place_of_the_directory_is_a_value_error(tmp_path: Path) -> None:
    pipe = pipeline([6])
    (tmp_path / "ckpt").write_text("not a directory")
    with pytest.raises(ValueError, match="is a file; pass a directory"):
        torchpipe.Checkpointer(tmp_path / "ckpt", pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), every=2)


def test_a_directory_that_cannot_be_made_or_written_is_an_os_error(tmp_path: Path) -> None:
    pipe = pipeline([6])
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match="cannot make the checkpoint directory"):
        torchpipe.Checkpointer(tmp_path / "file" / "ckpt", pipe, optimizer, every=2)
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
    elif Path("/sys").is_dir() and not os.access("/sys", os.W_OK | os.X_OK) or _read_only("/sys"):
        locked = Path("/sys")  # root writes anywhere a mode allows; /sys is mounted read-only
    else:
        pytest.skip("no directory this process cannot write")
    with pytest.raises(OSError, match="cannot write in the checkpoint directory"):
        torchpipe.Checkpointer(locked, pipe, optimizer, every=2)


def _read_only(path: str) -> bool:
    try:
        with open(os.path.join(path, ".torchpipe-test-probe"), "wb"):
            pass
    except OSError:
        return True
    os.remove(os.path.join(path, ".torchpipe-test-probe"))
    return False


def test_a_closed_checkpointer_takes_no_more_calls(tmp_path: Path) -> None:
    pipe = pipeline([6])
    ckpt = torchpipe.Checkpointer(tmp_path, pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), every=2)
    ckpt.close()
    ckpt.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        ckpt.step(2)
