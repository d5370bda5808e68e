"""Activation memory across processes: what a rank holds of the outputs it sent (gloo ranks on 127.0.0.1, hard
timeouts). Peaks are resident-set sizes with every large block from mmap, so they follow the tensors; each is the
median of three steps, and the bounds leave several outputs' worth of margin."""
import sys

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launch import launch, ok
from torchpipe.distributed.wire import packed_bytes

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak resident sets from /proc (Linux)"),
]


@pytest.mark.slow
def test_the_first_stage_keeps_no_output_it_has_sent_under_gpipe() -> None:
    # 'gpipe', 8 micro-batches, a first stage whose output is 32 MiB per micro-batch and whose backward needs
    # little (a linear layer's input). Each output stayed until the step's end, and so did the message buffer it
    # was copied into: the first rank's peak was 17 outputs' worth (553 MiB). The buffer now goes once its send
    # is over and the output's data once it is copied (its graph stays for the backward): about 9 outputs' worth
    # (300 MiB), the messages the second rank has not taken yet.
    first, _ = ok(launch("tests.distributed.ranks_memory:step_peaks", 2, timeout=300, schedule="gpipe", chunks=8,
                         checkpoint="never"))
    if "skip" in first:
        pytest.skip(first["skip"])
    assert first["peak"] < 12 * first["output"], first


def test_memory_limit_chooses_alike_on_every_rank_from_every_ranks_bytes() -> None:
    # Enough for 1F1B's peak but not GPipe's: every rank chooses the same schedule, within the limit on its own
    # worker, from both ranks' measured bytes; loss and gradients are the plain module's.
    roomy = ok(launch("tests.distributed.ranks_memory:planned", 2, timeout=240, memory_limit=1 << 30))
    assert all("nothing measured yet" in r["before"] for r in roomy)
    first_stage = roomy[0]["held"][0][0]  # bytes per micro-batch of stage 0, on rank 0
    # 1F1B's peaks, at each rank's second backward: two micro-batches on rank 0, one on rank 1, each with its
    # stage's gradients (made by its first backward), what the second makes on its way, and the receives its
    # transport posts ahead (8 messages over gloo).
    for rank, result in enumerate(roomy):
        assert result["gradients"] == {rank: 8 * (8 * 64 + 64 + 64 * 8 + 8)}, result  # float64 weights, biases
        # Each message 4 rows of 8 float64 after its header (256 int64s): activations to rank 1, gradients back.
        assert result["buffers"] == {rank: 8 * packed_bytes(((torch.float64, (4, 8)),))} == {rank: 8 * 2304}, result
        assert result["temporaries"][rank][1] > 0, result
    extra = [r["gradients"][rank] + r["temporaries"][rank][1] + r["buffers"][rank] for rank, r in enumerate(roomy)]
    limit = max(2 * first_stage + extra[0], roomy[1]["held"][1][0] + extra[1])
    results = ok(launch("tests.distributed.ranks_memory:planned", 2, timeout=240, memory_limit=limit))
    assert len({r["schedule"] for r in results}) == 1 and results[0]["schedule"] != "gpipe", results
    for rank, result in enumerate(results):
        assert result["peak"][rank] <= limit, result
        assert result["loss"] < 1e-12 and result["grads"] < 1e-12, result


def test_memory_limit_too_small_is_the_same_error_on_every_rank() -> None:
    results = ok(launch("tests.distributed.ranks_memory:planned", 2, timeout=240, memory_limit=100,
                        recompute="selective"))
    for result in results:
        assert "no schedule within memory_limit=100 bytes" in result["error"], result
        assert "smallest predicted peak" in result["error"]
