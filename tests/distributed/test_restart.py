"""A job that loses a rank (SIGKILL) under ``torchrun --max-restarts 1`` is restarted and resumes from its last
complete checkpoint, with the weights of an uninterrupted run (tests/distributed/resume.py; issue 34).

Each test runs torchrun once, under a hard timeout that kills torchrun and every rank.
"""
import importlib.util
import json
import random
import re
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchpipe
from tests.distributed import resume
from tests.distributed.launch import ROOT, launch, ok, torchrun

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

SCRIPT = str(ROOT / "tests" / "distributed" / "resume.py")


def restarted(tmp_path: Path, ranks: int, *arguments: str, timeout: float = 240) -> List[Dict[str, Any]]:
    """Runs resume.py under torchrun --max-restarts 1; rank 0's record of each attempt."""
    out = tmp_path / "attempts.jsonl"
    done = torchrun([SCRIPT, "--dir", str(tmp_path / "ckpt"), "--out", str(out), *arguments], ranks, timeout,
                    "--max-restarts", "1", "--monitor-interval", "0.1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert out.exists(), done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def plain_weights(steps: int, stages: int) -> Dict[str, torch.Tensor]:
    """The plain module trained on the whole batches, uninterrupted."""
    plain = resume.model(stages)
    optimizer = resume.optimizer_of(plain.parameters())
    for step in range(steps):
        x, y = resume.batch(step)
        F.cross_entropy(plain(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return plain.state_dict()


def check_weights(record: Dict[str, Any], steps: int, stages: int) -> None:
    saved = torch.load(record["state"], weights_only=True)
    expected = plain_weights(steps, stages)
    assert list(saved) == list(expected)
    for key, value in expected.items():
        # The pipeline's gradients are the plain module's up to the order of the micro-batches' sums.
        torch.testing.assert_close(saved[key], value, rtol=1e-10, atol=1e-12, msg=key)


@pytest.mark.timeout(300)
def test_a_rank_killed_at_a_random_step_restarts_and_resumes(tmp_path: Path) -> None:
    # Regression (issue 34): the restarted ranks read the dead attempt's keys in the store (the default group's:
    # "Connection refused" or a hang; the pipeline's own: a failure record of the dead step) and never trained.
    every, steps = 3, 10
    kill = random.randint(1, steps - 1)
    attempts = restarted(tmp_path, 2, "--steps", str(steps), "--every", str(every), "--kill-step", str(kill))
    assert [a["attempt"] for a in attempts] == [1], attempts  # attempt 0 never ended: rank 1 died
    # The newest complete checkpoint: the last multiple of `every` before the kill, or the one before it where
    # that save was still being written when rank 1 died (it dies in its next step).
    last = kill // every * every
    assert attempts[0]["start"] in {last, max(0, last - every)}, (kill, attempts)
    assert len(attempts[0]["losses"]) == steps - attempts[0]["start"]
    check_weights(attempts[0], steps, stages=2)


@pytest.mark.timeout(300)
def test_a_rank_killed_while_it_writes_a_checkpoint_resumes_from_the_one_before(tmp_path: Path) -> None:
    # Rank 1 dies while its share of step 6's checkpoint is written: step 6 is never marked complete, so the
    # restart resumes from step 3, and its next save (step 6 again) replaces the half-written one.
    attempts = restarted(tmp_path, 2, "--steps", "8", "--every", "3", "--kill-step", "6", "--kill-in", "save")
    assert [(a["attempt"], a["start"]) for a in attempts] == [(1, 3)], attempts
    check_weights(attempts[0], 8, stages=2)
    folders = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert folders == ["step-3", "step-6"], folders  # keep=2; step 6 rewritten whole, and marked
    assert all((tmp_path / "ckpt" / name / "torchpipe-complete.json").exists() for name in folders)


@pytest.mark.timeout(400)
def test_a_rank_killed_on_a_two_by_two_mesh_restarts_and_resumes(tmp_path: Path) -> None:
    # 2 sharded replicas (FSDP2) of a 2-stage pipeline; rank 3 (replica 1's last stage) dies in step 4.
    attempts = restarted(tmp_path, 4, "--steps", "6", "--every", "2", "--kill-step", "4", "--kill-rank", "3",
                         "--dp", "2", "--data-parallel", "shard", timeout=360)
    assert [a["attempt"] for a in attempts] == [1] and attempts[0]["start"] in {2, 4}, attempts
    check_weights(attempts[0], 6, stages=2)


def test_a_restarted_attempt_reads_none_of_the_dead_ones_keys() -> None:
    # Regression (issue 34), for a default group made by torch's own call: the pipeline's keys in the store were
    # named by its ranks and its number alone, which a restarted attempt's fresh processes give it again, so the
    # new attempt read the dead one's group addresses and its failure records.
    reports = ok(launch("tests.distributed.ranks_restart:a_second_attempt_reads_none_of_the_first", 2, timeout=90))
    assert [r["raised"] for r in reports] == ["PipelineError", "ValueError"], reports
    for report in reports:
        first, second = report["prefixes"]
        assert first.startswith("torchpipe/attempt0/") and second.startswith("torchpipe/attempt1/"), report
        assert first[len("torchpipe/attempt0/"):] == second[len("torchpipe/attempt1/"):], report  # same number
    assert reports[0]["loss"] == reports[1]["loss"]


def test_a_checkpoint_saved_by_two_ranks_resumes_in_one_process(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    assert ok(launch("tests.distributed.ranks_restart:checkpointer_save", 2, timeout=120, directory=str(directory),
                     steps=5)) == [True, True]
    pipe = torchpipe.Pipeline(resume.model(2), [1, 2, 2], chunks=3, loss_fn=F.cross_entropy,
                              devices=["cpu"] * 3)
    optimizer = resume.optimizer_of(pipe.parameters())
    with torchpipe.Checkpointer(directory, pipe, optimizer, every=2) as ckpt:
        assert ckpt.checkpoints() == [2, 4]
        assert ckpt.restore() == 4
        assert ckpt.extra == {"rank": 0, "step": 4}  # rank 0's
        x, y = resume.batch(4)
        pipe.step(x, y)
        optimizer.step()
    expected = plain_weights(5, stages=2)
    for key, value in pipe.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-10, atol=1e-12, msg=key)


def test_a_bad_directory_on_one_rank_is_an_error_on_every_rank(tmp_path: Path) -> None:
    reports = ok(launch("tests.distributed.ranks_restart:bad_directory_on_one_rank", 2, timeout=90,
                        folder=str(tmp_path)))
    for report in reports:
        assert report["raised"] == "ValueError", reports
        assert "is a file; pass a directory" in report["message"], reports


@pytest.mark.timeout(300)
def test_the_example_resumes_after_a_rank_is_killed(tmp_path: Path) -> None:
    # make run-resume, briefly: examples/train_distributed.py with --checkpoint-dir, rank 1 killed at step 5.
    spec = importlib.util.spec_from_file_location("train_distributed", ROOT / "examples" / "train_distributed.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    batches, size = 8, 64
    flags = ["--epochs", "1", "--batches", str(batches), "--batch", str(size), "--chunks", "4", "--timeline", "",
             "--checkpoint-dir", str(tmp_path / "ckpt"), "--every", "2", "--die-at-step", "5",
             "--save", str(tmp_path / "model.pt")]
    done = torchrun([str(ROOT / "examples" / "train_distributed.py"), *flags], 2, 240, "--max-restarts", "1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "attempt 0: no checkpoint" in done.stdout and "rank 1: killing itself (SIGKILL) at step 5" in done.stdout
    assert re.search(r"attempt 1: resumed from step (2|4), the newest complete checkpoint", done.stdout), done.stdout
    plain = example.model(2)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    for x, y in example.data(batches, size):
        F.cross_entropy(plain(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(saved[key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("where, dead", [("between steps", 1), ("in a collective", 2)])
def test_a_rank_that_dies_outside_a_step_ends_the_pipeline_on_the_others(where: str, dead: int) -> None:
    # Story: where the store outlives a dead rank (torchrun's agent hosts it), a rank waiting in the store for the
    # start of a step that the dead first stage would never publish, or for the dead rank's norm in
    # clip_grad_norm_, waited for the pipeline's timeout (30 minutes), so a restart waited for it (across hosts,
    # where no agent stops it). Now the ranks hold a ring of connections that tells them at once.
    results = launch("tests.distributed.ranks_restart:dies_outside_a_step", 3, timeout=90, where=where)
    assert results[dead] is None  # it died
    survivor = results[3 - dead]
    assert survivor is not None and "ok" in survivor, survivor
    report = survivor["ok"]
    assert report["raised"] == "PipelineError", report
    assert f"rank {dead - 1} died or ended" in report["message"], report  # its rank in the pipeline's group
    assert report["seconds"] < 5, report


def test_init_process_group_under_torchrun_keys_the_store_by_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun's agent hosts the store (here: this test); rank 0 of a world of 1, in restart attempt 2.
    import datetime

    import torchpipe.distributed
    from tests.distributed.launch import free_port

    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    for name, value in [("TORCHELASTIC_RESTART_COUNT", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)),
                        ("RANK", "0"), ("WORLD_SIZE", "1"), ("TORCHELASTIC_USE_AGENT_STORE", "True")]:
        monkeypatch.setenv(name, value)
    torchpipe.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    try:
        assert dist.get_world_size() == 1
        dist.distributed_c10d._get_default_store().set("mine", "1")
        keys = [bytes(k).decode() if isinstance(k, bytes) else str(k) for k in agent.list_keys()]
        assert keys and all(key.startswith("attempt2/") for key in keys), keys
        assert any(key.endswith("/mine") for key in keys), keys
        pipe = torchpipe.Pipeline(resume.model(1), [3], loss_fn=F.cross_entropy, group=dist.group.WORLD)
        assert pipe._channel is not None and pipe._channel.prefix.startswith("torchpipe/attempt2/")
    finally:
        dist.destroy_process_group()


def test_init_process_group_outside_torchrun_is_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchpipe.distributed
    from tests.distributed.launch import free_port

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    torchpipe.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                             world_size=1)
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1
        store = dist.distributed_c10d._get_default_store()
        store.set("mine", "1")
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        keys = [bytes(k).decode() if isinstance(k, bytes) else str(k) for k in store.list_keys()]
        assert any(key.endswith("/mine") for key in keys) and not any("attempt" in key for key in keys), keys
    finally:
        dist.destroy_process_group()
