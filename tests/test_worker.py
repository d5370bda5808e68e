"""Workers: long-lived threads, intra-op thread counts, exceptions carried back."""
import gc
import threading

import pytest
import torch

from torchpipe.worker import WorkerGroup, default_intra_op_threads


def test_tasks_run_in_order_on_one_long_lived_thread() -> None:
    group = WorkerGroup([torch.device("cpu")], "test")
    names = [group[0].submit(lambda: threading.current_thread().name).result(timeout=10) for _ in range(3)]
    assert names == ["torchpipe-test-0"] * 3
    group.close()


def test_each_worker_sets_its_intra_op_thread_count() -> None:
    group = WorkerGroup([torch.device("cpu")] * 2, "test", num_threads=[1, 1])
    assert [w.submit(torch.get_num_threads).result(timeout=10) for w in group.workers] == [1, 1]
    group.close()


def test_default_split_of_threads() -> None:
    cpu = torch.device("cpu")
    total = torch.get_num_threads()
    assert default_intra_op_threads([cpu]) == [total]
    assert default_intra_op_threads([cpu] * 64) == [1] * 64


def test_exception_keeps_its_type_and_the_worker_survives() -> None:
    group = WorkerGroup([torch.device("cpu")], "test")

    def fail() -> None:
        raise KeyError("missing thing")

    with pytest.raises(KeyError, match="missing thing"):
        group[0].submit(fail).result(timeout=10)
    assert group[0].submit(lambda: 42).result(timeout=10) == 42
    group.close()


def test_workers_stop_when_their_group_is_collected() -> None:
    group = WorkerGroup([torch.device("cpu")] * 2, "test")
    threads = [w.thread for w in group.workers]
    del group
    gc.collect()
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_submitting_to_a_stopped_worker_raises_instead_of_waiting() -> None:
    group = WorkerGroup([torch.device("cpu")], "test")
    worker = group[0]
    group.close()
    worker.thread.join(timeout=10)
    with pytest.raises(RuntimeError, match="was stopped"):
        worker.submit(lambda: 1)
    assert not group.alive
