"""Runs every benchmark on the small preset (what ``make bench`` runs), each in its own process.

Results (JSON, PNG plots, timelines) go to ``--out`` (default ``out/bench``).

    python benchmarks/run_all.py [--out out/bench] [--only speed memory unet_skip overhead] [--preset small]
"""
import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent


def commands(out: Path, preset: str) -> Dict[str, List[str]]:
    """The command line of each benchmark, writing under ``out``."""
    here = ROOT / "benchmarks"
    return {
        "speed": [str(here / "speed.py"), "--preset", preset, "--json", str(out / "speed.json"),
                  "--plot", str(out / "speed.png"), "--timeline", str(out / "timeline")],
        "memory": [str(here / "memory.py"), "--preset", preset, "--budget-mb", "256", "--budget-models", "unet",
                   "--json", str(out / "memory.json"), "--plot", str(out / "memory.png")],
        "unet_skip": [str(here / "unet_skip.py"), "--preset", preset, "--json", str(out / "unet_skip.json")],
        "overhead": [str(here / "overhead.py"), "--json", str(out / "overhead.json")],
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "out" / "bench"))
    parser.add_argument("--preset", choices=["small", "paper"], default="small")
    parser.add_argument("--only", nargs="+", default=None, help="run only these benchmarks")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name, command in commands(out, args.preset).items():
        if args.only and name not in args.only:
            continue
        print(f"\n=== {name}: {' '.join(Path(c).name if c.endswith('.py') else c for c in command)}", flush=True)
        start = time.perf_counter()
        done = subprocess.run([sys.executable] + command, cwd=ROOT)
        print(f"=== {name}: exit {done.returncode} in {time.perf_counter() - start:.0f} s", flush=True)
        if done.returncode != 0:
            failed.append(name)
    print(f"\nresults in {out}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
