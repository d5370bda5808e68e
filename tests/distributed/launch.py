"""Runs a function on several ranks, each a fresh Python process with a gloo process group on 127.0.0.1.

Every child is killed when the launch's hard timeout passes (they are in a
process group of their own), so a hang fails the test and never the suite.
Each rank's result, or the exception it raised (type and message), comes back
through a file.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import datetime, faulthandler, importlib, json, os, signal, sys, traceback
import torch, torch.distributed as dist
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks for the stacks of a rank that hangs
module, name, rank, world, port, folder, kwargs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
    sys.argv[5], sys.argv[6], json.loads(sys.argv[7])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
try:
    result = {"ok": getattr(importlib.import_module(module), name)(rank=rank, world=world, **kwargs)}
except BaseException as exc:
    result = {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
torch.save(result, os.path.join(folder, f"{rank}.pt"))
try:
    dist.destroy_process_group()
except Exception:
    pass
os._exit(0)
"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(function: str, world: int, *, timeout: float = 120.0, **kwargs: Any) -> List[Optional[Dict[str, Any]]]:
    """Runs ``module:function(rank=, world=, **kwargs)`` on ``world`` ranks; each rank's result (None: no result,
    e.g. the rank was killed).

    Raises:
        AssertionError: the ranks did not all end within ``timeout`` seconds (they are killed).
    """
    module, name = function.split(":")
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    with tempfile.TemporaryDirectory() as folder:
        logs = [open(Path(folder) / f"{rank}.log", "wb") for rank in range(world)]  # a pipe could fill and block
        children = [
            subprocess.Popen(
                [sys.executable, "-c", _CHILD, module, name, str(rank), str(world), str(port), folder,
                 json.dumps(kwargs)],
                cwd=ROOT, env=env, stdout=logs[rank], stderr=subprocess.STDOUT, start_new_session=True,
            )
            for rank in range(world)
        ]
        deadline = time.monotonic() + timeout
        try:
            for child in children:
                child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            # Where each rank that is still running hangs: Python's stacks of all its threads, into its log.
            running = [child for child in children if child.poll() is None]
            for child in running:
                try:
                    os.kill(child.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            time.sleep(2.0 if running else 0.0)
            # Read before killing: the first rank killed takes the store with it, and the others' logs fill
            # with its complaints.
            outputs = [(Path(folder) / f"{rank}.log").read_bytes().decode(errors="replace")[-6000:]
                       for rank in range(world)]
            for child in children:
                _kill(child)
            states = ["still running" if child in running else "ended" for child in children]
            shown = "\n".join(f"--- rank {rank} ({states[rank]}) ---\n{text}" for rank, text in enumerate(outputs))
            raise AssertionError(f"{function} on {world} ranks did not end within {timeout} s:\n{shown}") from None
        finally:
            for child in children:
                _kill(child)
            for log in logs:
                log.close()
        results: List[Optional[Dict[str, Any]]] = []
        for rank in range(world):
            path = Path(folder) / f"{rank}.pt"
            if path.exists():
                results.append(torch.load(path, weights_only=False))
            else:  # the rank died (a crash, a signal): None, and what it printed, for a failing test to show
                log = (Path(folder) / f"{rank}.log").read_bytes().decode(errors="replace")[-6000:]
                print(f"--- rank {rank} of {function} ended without a result (exit code "
                      f"{children[rank].returncode}) ---\n{log}", file=sys.stderr)
                results.append(None)
        return results


def torchrun(arguments: List[str], ranks: int, timeout: float, *options: str) -> "subprocess.CompletedProcess[str]":
    """``torchrun --nproc-per-node ranks *options *arguments`` on 127.0.0.1 (a free port); torchrun and every rank
    are killed (their process group) after ``timeout`` seconds, and an AssertionError shows their output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), *options, *arguments]
    child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        stdout, stderr = child.communicate()
        raise AssertionError(f"torchrun {arguments} did not end within {timeout} s:\n{stdout[-3000:]}"
                             f"\n{stderr[-3000:]}") from None
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # ranks left behind by torchrun, if any
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


def _kill(child: "subprocess.Popen[bytes]") -> None:
    if child.poll() is None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait(5)


def ok(results: List[Optional[Dict[str, Any]]]) -> List[Any]:
    """Every rank's returned value, or an AssertionError showing the ranks that failed."""
    failed = [(rank, r) for rank, r in enumerate(results) if r is None or "ok" not in r]
    if failed:
        lines = [f"rank {rank}: {r.get('traceback') if r else 'no result'}" for rank, r in failed]
        raise AssertionError("\n".join(lines))
    return [r["ok"] for r in results if r is not None]
