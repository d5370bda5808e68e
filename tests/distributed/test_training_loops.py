"""Training loops across processes: ranks that disagree fail at construction, token-level losses and accumulation
equal the plain model on 2 ranks and on a (2, 2) mesh, a missing target is named (gloo on 127.0.0.1, hard
timeouts)."""
import pytest
import torch.distributed as dist

from tests.distributed.launch import launch, ok

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]


@pytest.mark.parametrize("what, message", [
    # A balance measured on each rank is a natural thing to write; it used to run a model with a layer
    # held by no rank, silently skipped (the loss was the model's without it).
    ("balance", "rank 0 has balance [2, 3], rank 1 has [3, 2]: every rank must pass the same balance"),
    ("chunks", "rank 0 has chunks 2, rank 1 has 4: every rank must pass the same chunks"),
    ("schedule", "rank 0 has schedule '1f1b', rank 1 has 'gpipe': every rank must pass the same schedule"),
    ("layer", "rank 0 has layer '0' as Linear(weight (6, 4) float32, bias (6,) float32), rank 1 has "
              "Linear(weight (5, 4) float32, bias (5,) float32): every rank must build the same model"),
])
def test_ranks_built_from_different_arguments_fail_at_construction_on_every_rank(what: str, message: str) -> None:
    reports = ok(launch("tests.distributed.ranks_loops:disagreeing", 2, timeout=120, what=what))
    assert reports == [{"raised": "ValueError", "message": message}] * 2, reports


def test_a_token_level_loss_and_accumulation_equal_the_plain_model_on_two_ranks() -> None:
    transformers = pytest.importorskip("transformers")
    assert transformers is not None
    assert ok(launch("tests.distributed.ranks_loops:token_loss_across_ranks", 2, timeout=300)) == [[], []]


@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_a_token_level_loss_on_a_mesh_weighs_the_replicas_by_their_tokens(mode: str) -> None:
    pytest.importorskip("transformers")
    assert ok(launch("tests.distributed.ranks_loops:token_loss_on_a_mesh", 4, timeout=300, mode=mode)) == [[]] * 4


def test_a_target_missing_on_the_last_stages_rank_is_named_there() -> None:
    reports = ok(launch("tests.distributed.ranks_loops:missing_target", 2, timeout=120))
    assert reports[1]["raised"] == "ValueError", reports
    assert "rank 1, the last stage's, must pass the target" in reports[1]["message"], reports
    assert reports[0]["raised"] == "PipelineError", reports
    assert "rank 1, the last stage's, must pass the target" in reports[0]["message"], reports
    assert reports[0]["next"] == reports[1]["next"], reports
