"""examples/train_lm.py (``make run-lm``) trains its language model: in one process, and over 2 ranks under torchrun.

Each run is a subprocess with a hard timeout, on a tiny configuration; the
loss must fall (the training loss printed every few steps, and the held-out
loss after against before), a continuation is printed, and the timeline
picture is written.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_lm.py"
#: A model and a run small enough for a test; --balance size is measured without timing, so it is deterministic.
TINY = ["--steps", "16", "--batch", "8", "--length", "32", "--layers", "2", "--width", "32", "--heads", "2",
        "--chunks", "2", "--lr", "1e-2", "--print-every", "4", "--eval-batches", "2", "--generate", "8",
        "--balance", "size"]


def environment() -> "dict[str, str]":
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def check_the_loss_fell(out: str) -> List[float]:
    losses = [float(m) for m in re.findall(r"^step +\d+/\d+: loss ([0-9.]+)", out, re.MULTILINE)]
    assert len(losses) == 4, out
    assert losses[-1] < losses[0] - 0.3, out
    before = float(re.search(r"held-out loss before training: ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    after = float(re.search(r"held-out loss after \d+ steps: ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert after < before - 0.3, out
    assert "continuation of 'def ' (sampled at temperature 0.7)" in out
    return losses


def in_one_process(picture: Path) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLE), *TINY, "--timeline", str(picture)], cwd=ROOT,
                          env=environment(), capture_output=True, text=True, timeout=300, start_new_session=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_language_model_example_trains_in_one_process(tmp_path: Path) -> None:
    picture = tmp_path / "timeline.png"
    out = in_one_process(picture)
    check_the_loss_fell(out)
    assert "balance_by_size: [" in out and "on ['cpu', 'cpu']" in out
    assert picture.read_bytes()[:4] == b"\x89PNG" and picture.with_suffix(".json").stat().st_size > 0


@pytest.mark.slow
def test_the_language_model_example_trains_under_torchrun(tmp_path: Path) -> None:
    from tests.distributed.launch import free_port

    picture = tmp_path / "timeline.png"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(EXAMPLE), "--distributed", *TINY, "--timeline", str(picture),
    ]
    done = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=400,
                          start_new_session=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = check_the_loss_fell(done.stdout)
    assert "on ranks [0, 1]" in done.stdout
    assert done.stdout.count("held-out loss before training") == 1, "only rank 0 prints"
    assert picture.read_bytes()[:4] == b"\x89PNG"
    # The same seed and balance in one process: the same model, data and updates, so the same losses (the tied
    # weight's gradient is summed in another order across ranks: equal up to rounding).
    alone = check_the_loss_fell(in_one_process(tmp_path / "alone.png"))
    assert all(abs(a - b) < 0.02 for a, b in zip(losses, alone)), (losses, alone)


@pytest.mark.slow
def test_the_language_model_example_trains_on_a_pp_x_tp_mesh(tmp_path: Path) -> None:
    # make run-3d: a Llama by its own tensor-parallel plan on (pp, tp) = (2, 2), 4 processes. A stage's tp ranks
    # compute what one rank would (up to the rounding of sums over shards): the losses of the 2-rank pipeline.
    from tests.distributed.launch import free_port

    def torchrun(ranks: int, *flags: str) -> str:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), str(EXAMPLE), "--distributed", "--model", "llama",
            *TINY, "--timeline", "", *flags,
        ]
        done = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=400,
                              start_new_session=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    split = torchrun(4, "--tp", "2")
    assert "model: Llama" in split and split.count("held-out loss before training") == 1, "only rank 0 prints"
    losses = check_the_loss_fell(split)
    whole = check_the_loss_fell(torchrun(2))
    assert all(abs(a - b) < 0.01 for a, b in zip(losses, whole)), (losses, whole)


def test_bad_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import train_lm
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    for flags, message in [(["--chunks", "0"], "--chunks must be at least 1"),
                           (["--width", "30", "--heads", "4"], "multiple of --heads"),
                           (["--tp", "2"], "add --distributed"),
                           (["--distributed", "--tp", "2"], "--tp needs --model llama")]:
        with pytest.raises(SystemExit) as exit:
            train_lm.parse_args(flags)
        assert exit.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_the_language_model_example_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    # Saved at steps 8 and 16; the second run finds step 16 gone (as if the job had died before it) and goes on
    # from step 8: weights, AdamW's state, the LR schedule, the data generator and the RNG as they were, so it
    # prints what the first run printed from there on.
    flags = [*TINY, "--timeline", "", "--checkpoint-dir", str(tmp_path / "ckpt"), "--every", "8"]

    def run() -> str:
        done = subprocess.run([sys.executable, str(EXAMPLE), *flags], cwd=ROOT, env=environment(),
                              capture_output=True, text=True, timeout=300, start_new_session=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    first = run()
    check_the_loss_fell(first)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-16", "step-8"]
    shutil.rmtree(tmp_path / "ckpt" / "step-16")
    second = run()
    assert "resumed from step 8, the newest complete checkpoint" in second, second

    def after_step_8(out: str) -> List[str]:
        lines = out.splitlines()
        kept = [line for line in lines if re.match(r"step +(12|16)/16: loss", line)]
        ending = lines[next(k for k, line in enumerate(lines) if line.startswith("held-out loss after")):]
        assert len(kept) == 2 and ending[1].startswith("continuation of"), out
        return [re.sub(r"\(\d+ tokens/s.*\)|; trained in.*", "", line) for line in kept + ending[:1]] + ending[1:-1]

    assert after_step_8(second) == after_step_8(first), (first, second)
