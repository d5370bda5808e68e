"""Shared fixtures: a seeded RNG for every test, the ``cuda`` marker that skips without a GPU, and a watchdog that
ends a hung run naming the test."""
import faulthandler
import os
import sys
import threading
from typing import Generator

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "torchpipe",
    deadline=None,
    max_examples=int(os.environ.get("TORCHPIPE_HYPOTHESIS_EXAMPLES", "25")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("torchpipe")


@pytest.fixture(autouse=True)
def manual_seed_zero() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


#: How long past its timeout a test may run before the watchdog ends the run: pytest-timeout's signal comes first
#: (it fails the one test and the run goes on) where the main thread can still take it.
WATCHDOG_GRACE = float(os.environ.get("TORCHPIPE_WATCHDOG_GRACE", "30"))


def _limit(item: pytest.Item) -> float:
    """The test's timeout: its ``timeout`` marker's, else the configured one (pyproject.toml)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
        if value is not None:
            return float(value)
    try:
        return float(item.config.getini("timeout") or 600)
    except (ValueError, KeyError):
        return 600.0


def _end_the_run(config: pytest.Config, nodeid: str, limit: float) -> None:
    """A test is still running long past its timeout: a wait that nothing breaks (issue 33: the main thread
    inside the autograd engine, where pytest-timeout's signal never lands). Name the test, show every thread,
    and end the process, so the run fails here instead of freezing CI."""
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)  # else what follows goes to the test's captured output
    stream = sys.stderr
    if stream is not None:
        stream.write(
            f"\n\ntorchpipe watchdog: {nodeid} is still running {limit + WATCHDOG_GRACE:.0f} s after it started "
            f"(its timeout: {limit:.0f} s); it hangs. Every thread's stack:\n"
        )
        stream.flush()
        faulthandler.dump_traceback(file=stream, all_threads=True)
        stream.write(f"\ntorchpipe watchdog: ending the test run: {nodeid} hangs\n")
        stream.flush()
    os._exit(3)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: object) -> Generator[None, None, None]:
    limit = _limit(item)
    timer = threading.Timer(limit + WATCHDOG_GRACE, _end_the_run, args=(item.config, item.nodeid, limit))
    timer.daemon = True
    timer.name = "pytest-watchdog"
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
