"""Child processes of a benchmark: a free port, the environment of a child that imports ``benchmarks``, ranks
started and waited for, and a function run in a fresh interpreter."""
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, Mapping, Sequence

from benchmarks.harness import ROOT

__all__ = ["free_port", "child_environment", "rank_environment", "run_ranks", "run_in_child"]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a process group's store)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_environment(**extra: str) -> Dict[str, str]:
    """This process's environment with ``extra``, and the repository first on ``PYTHONPATH`` (so that a child
    imports ``benchmarks``)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def rank_environment(port: int, **extra: str) -> Dict[str, str]:
    """The environment of a benchmark's rank: this one, with the store on 127.0.0.1:``port``, one OpenMP
    thread, ``benchmarks`` importable, and ``extra``."""
    return child_environment(**{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                                **extra})


def run_ranks(commands: Sequence[Sequence[str]], env: Mapping[str, str], timeout: float, what: str) -> None:
    """Runs one process per command (its rank) and waits for all; every one still running is killed when
    ``timeout`` seconds have passed or one fails.

    Raises:
        RuntimeError: a rank exited with an error (``what`` names the run).
        subprocess.TimeoutExpired: the ranks did not all end in time.
    """
    children = [subprocess.Popen(list(command), cwd=ROOT, env=dict(env), start_new_session=True)
                for command in commands]
    try:
        deadline = time.monotonic() + timeout
        for child in children:
            if child.wait(timeout=max(0.1, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"{what}: a rank exited with {child.returncode}")
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()


def run_in_child(target: str, kwargs: Mapping[str, Any], *, timeout: float = 600.0) -> Any:
    """Runs ``module:function(**kwargs)`` in a fresh Python process and returns its JSON-able result.

    A fresh process per call is what makes
    :func:`~benchmarks.harness.memory.cpu_peak_rss_bytes` a per-measurement peak. The child's intra-op thread
    count is inherited through ``OMP_NUM_THREADS`` only if the caller set it; the function decides.

    Raises:
        RuntimeError: the child failed; its stderr's tail is in the message.
    """
    module, function = target.split(":")
    code = (
        "import json, sys\n"
        f"from {module} import {function} as f\n"
        "result = f(**json.loads(sys.argv[1]))\n"
        "print('\\n' + json.dumps(result))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, json.dumps(dict(kwargs))], cwd=ROOT,
                          env=child_environment(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"{target}({dict(kwargs)}) failed in a child process (exit {done.returncode}):\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])
