"""The suite's watchdog (tests/conftest.py): a test that hangs where nothing can break the wait ends the run within
seconds of its timeout, naming the test, instead of freezing it (issue 33: a nested GPipe's backward hung inside
the autograd engine, where pytest-timeout's signal never landed)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

DEMO = "TORCHPIPE_WATCHDOG_DEMO"


@pytest.mark.skipif(os.environ.get(DEMO) != "1", reason="a hang on purpose, run only by the test below")
@pytest.mark.timeout(2)
def test_hangs_when_asked() -> None:
    # A wait that swallows what would break it, as the executor's wait for its workers does after a first
    # interruption: pytest-timeout's signal fails nothing here.
    while True:
        try:
            time.sleep(60)
        except BaseException:  # noqa: B036 - the point: nothing ends this wait
            pass


@pytest.mark.timeout(120)
def test_the_watchdog_ends_a_hung_run_naming_the_test() -> None:
    env = {**os.environ, DEMO: "1", "TORCHPIPE_WATCHDOG_GRACE": "1"}
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_watchdog.py::test_hangs_when_asked"],
        cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=90,
    )
    took = time.monotonic() - started
    said = run.stdout + run.stderr
    assert run.returncode == 3, (run.returncode, said[-3000:])
    assert "torchpipe watchdog: tests/test_watchdog.py::test_hangs_when_asked is still running" in said
    assert "ending the test run: tests/test_watchdog.py::test_hangs_when_asked hangs" in said
    assert "in test_hangs_when_asked" in said  # the stacks show where it hangs
    assert took < 60, f"the watchdog took {took:.0f} s"
