"""Tied weights across ranks and pipelines on a 2-D mesh (issues 16, 17): gloo ranks on 127.0.0.1, hard timeouts."""
import pytest
import torch.distributed as dist

from tests.distributed.launch import launch, ok

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


def test_bad_meshes_are_a_value_error_on_every_rank() -> None:
    for errors in ok(launch("tests.distributed.ranks_mesh:bad_arguments", 4)):
        assert "data_parallel must be 'replicate' or 'shard'" in errors[0]
        assert "dimensions named 'pp' and 'dp'" in errors[1] and "dimensions named 'pp' and 'dp'" in errors[2]
