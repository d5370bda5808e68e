"""Tied weights across ranks and pipelines on a 2-D mesh (issues 16, 17): gloo ranks on 127.0.0.1, hard timeouts."""
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Dict

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from tests.distributed.launch import ROOT, launch, ok, torchrun
from tests.test_ties import tied_lm

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]


def test_a_weight_tied_across_ranks_is_transparent_and_its_copies_stay_equal() -> None:
    assert ok(launch("tests.distributed.ranks_mesh:tied_across_ranks", 2, timeout=240)) == [[], []]


@pytest.mark.parametrize("mode, dp, pp", [
    ("replicate", 2, 2), ("shard", 2, 2), ("replicate", 4, 1), ("shard", 4, 1), ("replicate", 1, 4),
])
def test_replicas_on_a_mesh_are_transparent(mode: str, dp: int, pp: int) -> None:
    # Several schedules; replicas' batches of different sizes; gradients accumulated over two steps; a weight
    # tied between the first and last stage (across ranks when pp > 1), also under FSDP2.
    problems = ok(launch("tests.distributed.ranks_mesh:replicate_transparency", dp * pp, timeout=300,
                         mode=mode, dp=dp, pp=pp))
    assert problems == [[]] * (dp * pp), problems


def test_sharded_replicas_hold_half_the_parameters() -> None:
    replicated = ok(launch("tests.distributed.ranks_mesh:parameter_bytes", 4, mode="replicate"))
    sharded = ok(launch("tests.distributed.ranks_mesh:parameter_bytes", 4, mode="shard"))
    for full, half in zip(replicated, sharded):
        assert half == full // 2, (replicated, sharded)


@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_a_failure_on_one_replica_ends_the_step_on_every_rank(mode: str) -> None:
    reports = ok(launch("tests.distributed.ranks_mesh:failure_on_one_replica", 4, timeout=180, mode=mode))
    for rank, report in enumerate(reports):
        assert report["raised"] in ("ValueError", "PipelineError"), (rank, report)
        assert "layer failed on purpose" in report["message"], (rank, report)
        assert report["seconds"] < 10, (rank, report)
        assert report["next step"], (rank, report)


def test_a_failure_before_a_sharded_stage_ever_ran_forward_ends_the_step_on_every_rank() -> None:
    # Seen in CI under load: replica 1's second stage failed in the first step's first forward while replica
    # 0's second stage was still waiting for its input. FSDP2 initialises a module's state at its first
    # forward; the stage that had never run one had none, so its abort issued no reduce-scatter (and then
    # raised, skipping the tied weight's sum), while its peer on replica 1, whose forward had begun, issued
    # one and waited for it forever. Replica 0's first stage sleeps here to make that order certain.
    reports = ok(launch("tests.distributed.ranks_mesh:failure_on_one_replica", 4, timeout=60, mode="shard",
                        first_stage_sleeps=3.0))
    for rank, report in enumerate(reports):
        assert report["raised"] in ("ValueError", "PipelineError"), (rank, report)
        assert "layer failed on purpose" in report["message"], (rank, report)
        assert report["seconds"] < 15, (rank, report)
        assert report["next step"], (rank, report)


def test_a_start_that_fails_on_one_replica_ends_the_step_on_every_rank() -> None:
    # Each rank waits for every replica's start (the loss weighs every replica's samples). Replica 0's start was
    # published when replica 1's failed: replica 0's ranks leave the step as failed ranks do (with abort
    # messages in place of theirs), so their pairs are in step for the next one.
    reports = ok(launch("tests.distributed.ranks_mesh:start_fails_on_one_replica", 4, timeout=120))
    failing = reports[2]  # replica 1's first stage
    assert failing["raised"] == "ValueError", failing
    assert "rank 0 of replica 1 runs the first stage: it must pass the mini-batch's input" in failing["message"]
    for rank, report in enumerate(reports):
        if rank != 2:
            assert report["raised"] == "PipelineError", (rank, report)
            assert "rank 0 of replica 1 could not split its input" in report["message"], (rank, report)
        assert report["seconds"] < 8, (rank, report)
    assert len({report["next step"] for report in reports}) == 1, reports  # the same loss everywhere


def test_bad_meshes_are_a_value_error_on_every_rank() -> None:
    for errors in ok(launch("tests.distributed.ranks_mesh:bad_arguments", 4)):
        assert "data_parallel must be 'replicate' or 'shard'" in errors[0]
        wanted = "dimensions named ('dp', 'pp'), ('pp', 'tp') or ('dp', 'pp', 'tp')"
        assert wanted in errors[1] and wanted in errors[2], errors


@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_full_state_dict_on_a_mesh_is_whole_on_global_rank_0(mode: str) -> None:
    reports = ok(launch("tests.distributed.ranks_mesh:full_state_on_a_mesh", 4, mode=mode))
    assert reports[0]["keys"] == len(tied_lm(layers=2).state_dict()) and reports[0]["equal"], reports
    assert all(report["keys"] == 0 for report in reports[1:]), reports


@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_the_timeline_shows_one_reduction_per_stage_per_step(mode: str) -> None:
    labels = ok(launch("tests.distributed.ranks_mesh:reductions_on_the_timeline", 4, mode=mode))
    assert labels == [["0reduce", "0reduce"], ["1reduce", "1reduce"]] * 2, labels


LAYOUTS = {"2x2-shard": 4, "1x4-replicate": 4, "4x1-shard": 4, "group-2": 2, "2x2-replicate": 4, "local-3": 1}


@pytest.mark.parametrize("saved, loaded", [
    ("2x2-shard", "1x4-replicate"), ("4x1-shard", "group-2"), ("group-2", "2x2-replicate"), ("2x2-shard", "local-3"),
])
def test_a_dcp_checkpoint_moves_between_layouts_bit_for_bit(tmp_path: Path, saved: str, loaded: str) -> None:
    # Issue 16: model and Adam state through torch.distributed.checkpoint, keyed by the plain module's names (a
    # tied weight by its first holder's), saved under one layout (pp x dp, replicate or shard, group=, one
    # process) and loaded under another: every value this rank then holds equals the saved one, in float64.
    path = str(tmp_path / "checkpoint")
    saving = ok(launch("tests.distributed.ranks_mesh:dcp_save", LAYOUTS[saved], timeout=180, path=path,
                       layout=saved, background=saved == "2x2-shard"))
    expected: Dict[str, Tensor] = {}
    for values in saving:
        expected.update(values)
    loading = ok(launch("tests.distributed.ranks_mesh:dcp_load", LAYOUTS[loaded], timeout=180, path=path,
                        layout=loaded))
    checked = 0
    for rank, values in enumerate(loading):
        for key, value in values.items():
            assert key in expected, f"rank {rank} holds {key}, which the saved layout had not"
            assert torch.equal(value, expected[key]), f"rank {rank}: {key} differs after loading"
            checked += 1
    assert checked >= len(expected) // 2
    if saved == "2x2-shard":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(path, str(tmp_path / "plain.pt"))
        whole = torch.load(tmp_path / "plain.pt", weights_only=False)
        plain = tied_lm(layers=4)
        plain.load_state_dict(whole["model"])
        assert plain[-1].weight is plain[0].weight
        for key, value in plain.named_parameters():
            assert torch.equal(value, expected[f"model.{key}"]), key


@pytest.mark.parametrize("name", ["gpt2-tied", "llama-tied"])
def test_a_transformers_language_model_across_two_ranks(name: str) -> None:
    pytest.importorskip("transformers")
    problems = ok(launch("tests.distributed.ranks_lm:language_model", 2, timeout=300, name=name))
    assert problems == [[], []], problems

def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_distributed", ROOT / "examples" / "train_distributed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_the_example_trains_two_replicas_of_a_two_stage_pipeline(tmp_path: Path, mode: str) -> None:
    # make run-mesh, briefly: 4 ranks as a 2 x 2 mesh. Each replica reads its half of every batch, so the model
    # it saves is the plain model trained on the whole batches, with the same optimizer.
    example = _example()
    batches, batch = 3, 64
    done = torchrun([str(ROOT / "examples" / "train_distributed.py"), "--dp", "2", "--data-parallel", mode,
                      "--epochs", "1", "--batches", str(batches), "--batch", str(batch), "--chunks", "4",
                      "--timeline", str(tmp_path / "timeline.json"), "--save", str(tmp_path / "model.pt")],
                     ranks=4, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"mesh dp 2 x pp 2 ({mode})" in done.stdout and "batch 64 (32 per replica)" in done.stdout, done.stdout
    assert "epoch 1/1: loss" in done.stdout and "timeline of one step of replica 0" in done.stdout, done.stdout

    events = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    kinds = {(e["pid"], e["cat"]) for e in events if e.get("ph") == "X"}
    # Every stage's gradient reduction over 'dp' is on the timeline, under both modes.
    expected = {(rank, kind) for rank in (0, 1) for kind in ("forward", "backward", "reduce")}
    assert expected <= kinds, kinds

    plain = example.model(2)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    for x, y in example.data(batches, batch):
        F.cross_entropy(plain(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    trained = plain.state_dict()
    assert list(saved) == list(trained)
    for key, value in trained.items():
        assert type(saved[key]) is torch.Tensor and saved[key].shape == value.shape, (key, type(saved[key]))
        torch.testing.assert_close(saved[key], value, rtol=1e-4, atol=1e-5, msg=key)
