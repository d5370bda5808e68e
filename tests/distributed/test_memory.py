"""Activation memory across processes: what a rank holds of the outputs it sent (gloo ranks on 127.0.0.1, hard
timeouts). Peaks are resident-set sizes with every large block from mmap, so they follow the tensors; each is the
median of three steps, and the bounds leave several outputs' worth of margin."""
import sys

import pytest
import torch.distributed as dist

from tests.distributed.launch import launch, ok

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
