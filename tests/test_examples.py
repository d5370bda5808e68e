"""Every script in examples/ runs to the end on CPU, with small flags (each as a subprocess, like a user)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# Small flags per example; scripts without flags run as they are.
FLAGS: Dict[str, List[str]] = {
    "quickstart.py": ["--steps", "11"],
    "recomputation.py": ["--chunks", "3"],
    "skip_connections.py": ["--checkpoint", "always", "--chunks", "2"],
    "resnet.py": ["--width", "4", "--image-size", "32", "--batch-size", "8", "--chunks", "2", "--steps", "2",
                  "--balance-timeout", "0.1"],
    "transformer.py": ["--layers", "3"],
}


def run(script: str, *args: str, timeout: float = 120.0) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{script} failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    return done.stdout


# Every script but train.py (tested below with its own flags), train_distributed.py (launched by torchrun
# in tests/distributed) and train_lm.py (tests/test_lm_example.py), found on disk so a new one is not missed.
SIMPLE = sorted(p.name for p in EXAMPLES.glob("*.py")
                if p.name not in ("train.py", "train_distributed.py", "train_lm.py"))


def test_the_documented_examples_exist() -> None:
    assert set(SIMPLE) >= {"quickstart.py", "recomputation.py", "skip_connections.py", "balancing.py", "resnet.py",
                           "transformer.py"}


@pytest.mark.parametrize("script", SIMPLE)
def test_example_runs(script: str) -> None:
    out = run(script, *FLAGS.get(script, []))
    if script in ("quickstart.py", "transformer.py"):
        losses = [float(line.split("loss")[1]) for line in out.splitlines() if line.startswith("step")]
        assert losses[-1] < losses[0]
    if script == "resnet.py":
        assert "the Sequential computes what the model computes: True" in out
        assert "largest relative difference" in out


def test_train_small_run(tmp_path: Path) -> None:
    out = run("train.py", "--epochs", "2", "--steps-per-epoch", "3", "--batch-size", "16", "--width", "8",
              "--chunks", "2", "--speed-rounds", "1", "--balance-timeout", "0.2", "--no-progress",
              "--out", str(tmp_path))
    lines = out.strip().splitlines()
    assert "balance_by_time" in lines[0]
    epochs = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("epoch ")]
    assert len(epochs) == 2
    figures, last = lines[-2], lines[-1]
    assert figures.startswith("throughput: GPipe ") and "samples/s vs plain" in figures
    assert "peak step memory" in figures
    # The last line says in words what pipelining bought in this run, from the same figures.
    assert last.startswith("summary: on 2 CPU cores, GPipe trained at ") and "pipelining bought" in last
    assert (tmp_path / "timeline.json").stat().st_size > 0
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_train_without_timeline(tmp_path: Path) -> None:
    out = run("train.py", "--epochs", "1", "--steps-per-epoch", "1", "--batch-size", "8", "--width", "4",
              "--partitions", "3", "--chunks", "2", "--speed-rounds", "1", "--balance-timeout", "0.1",
              "--no-progress", "--no-timeline", "--out", str(tmp_path / "none"))
    assert "3 partitions" in out.strip().splitlines()[-2]
    assert out.strip().splitlines()[-1].startswith("summary: on 3 CPU cores")
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("speed, memory, said", [
    (0.88, 0.42, "bought memory here, not speed: 2.4x the batch (or the model) fits in the same memory, at 12% less"),
    (0.99, 0.50, "bought memory here, not speed: 2.0x the batch (or the model) fits in the same memory, at about the "
                 "same speed"),
    (1.30, 0.95, "bought speed here, at about the same memory"),
    (1.30, 0.40, "bought both speed and memory here"),
    (0.80, 1.00, "bought neither here"),
])
def test_the_summary_line_says_what_pipelining_bought(speed: float, memory: float, said: str) -> None:
    spec = importlib.util.spec_from_file_location("train_summary", EXAMPLES / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    line = module.summary(speed, memory, "2 CPU cores")
    assert line.startswith(f"summary: on 2 CPU cores, GPipe trained at {speed:.2f}x") and said in line, line


def test_train_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("train_example", EXAMPLES / "train.py")
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    with pytest.raises(SystemExit) as exit:
        train.parse_args(["--chunks", "0"])
    assert exit.value.code == 2 and "--chunks must be at least 1" in capsys.readouterr().err
