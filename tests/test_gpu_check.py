"""benchmarks/gpu_check.py: its dry run writes a report with every section's figures, and a section or a unit that
fails or hangs is recorded without stopping the check."""
import json
import math
import os
import platform
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check, gpu_report, gpu_sections  # noqa: E402
from benchmarks.gpu_sections import BY_HAND, PLAIN  # noqa: E402


def environment() -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_the_dry_run_writes_a_report_with_every_section_and_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check"
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert sorted(path.name for path in out.iterdir()) == ["report.json", "report.md"]
    report = json.loads((out / "report.json").read_text())

    header = report["header"]
    assert header["dry_run"] is True and header["device"] == "cpu (dry run)"
    assert header["torch"] == torch.__version__ and header["python"] == platform.python_version()
    assert header["source_fingerprint"] == gpu_check.source_fingerprint()
    assert report["finished"] is True and 0 < report["wall_s"] <= time.monotonic() - started

    sections = report["sections"]
    assert list(sections) == list(gpu_check.SECTIONS)
    for name, entry in sections.items():
        assert entry["status"] == "ok" and entry["errors"] == [], (name, entry["errors"], entry["log"])
        assert 0 < entry["seconds"] <= entry["budget_s"] + gpu_check.GRACE_S, name

    # 1. Every test that was asked for, each with its outcome; the CUDA one is skipped without a GPU.
    tests = sections["tests"]["results"]
    assert tests["exit_code"] == 0
    outcomes = {test: entry["outcome"] for test, entry in tests["tests"].items()}
    asked = [arg for arg in gpu_sections.DRY.pytest_args if "::" in arg]
    assert sorted(outcomes) == sorted(asked)
    for test, outcome in outcomes.items():
        assert outcome == ("skipped" if "test_cuda.py" in test and not torch.cuda.is_available() else "passed"), test
    assert sum(tests["counts"].values()) == len(asked)

    # 2. A row per model, precision and configuration, each with its step time and ratios.
    rows = sections["gpipe"]["results"]["rows"]
    configurations = [PLAIN, BY_HAND] + [name for name, _, _, _ in gpu_sections.GPIPE_CONFIGS]
    assert [(r["model"], r["precision"], r["configuration"]) for r in rows] == [
        (model, precision, name) for model in ("mlp", "transformer") for precision in gpu_sections.PRECISIONS
        for name in configurations]
    for row in rows:
        assert positive(row["step_ms"]), row
        assert (row["vs_plain"] is None) == (row["configuration"] == PLAIN) and (
            row["vs_plain"] is None or positive(row["vs_plain"])), row
        has_yardstick = row["chunks"] > 1 and row["configuration"] != BY_HAND
        assert (row["vs_by_hand"] is not None) == has_yardstick and (
            not has_yardstick or positive(row["vs_by_hand"])), row
        assert row["peak_mib"] is None or row["peak_mib"] >= 0, row

    # 3. Every built-in schedule: its step, and its loss and gradients are the plain module's.
    results = sections["schedules"]["results"]
    from torchpipe.schedule import LOOPED, NAMES, V_SHAPED

    recomputing = [f"1f1b checkpoint=always recompute={recompute}" for recompute in ("full", "selective")]
    assert [row["schedule"] for row in results["rows"]] == [PLAIN, BY_HAND, *NAMES, *recomputing]
    assert all(positive(row["step_ms"]) for row in results["rows"])
    assert set(results["checks"]) == set(NAMES) | set(recomputing)
    for name, check in results["checks"].items():
        assert check["loss_rel_diff"] <= gpu_sections.FLOAT32_RTOL, (name, check)
        assert check["grad_max_rel_err"] is not None and check["grad_max_rel_err"] <= gpu_sections.FLOAT32_RTOL
        assert check["stages"] == (4 if name in LOOPED + V_SHAPED else 2), "two stages per worker there"
        assert check["predicted_mib"] > 0, (name, check)  # pipe.memory()'s prediction, both workers
    # In the prediction full recomputation holds the least, and selective more (the Linear outputs it keeps; in
    # this ReLU MLP as many as no checkpoint holds, since ReLU saves its result, not its input).
    predicted = {name: results["checks"][name]["predicted_mib"] for name in ["1f1b", *recomputing]}
    assert predicted[recomputing[0]] < min(predicted[recomputing[1]], predicted["1f1b"]), predicted
    # ... and one zbv stage's split backward against its one backward (where zbv's CPU time goes, asked of a GPU).
    split = results["split_backward"]
    assert {"one backward", "split", "pipelining"} <= set(split["ratios"]) and split["ratios"]["one backward"] == 1
    assert all(math.isfinite(ratio) for ratio in split["ratios"].values())
    assert "One zbv stage's backward" in (out / "report.md").read_text()

    # 4. GPT-2 and Llama: within the bf16 tolerances, in bf16 indeed (the plain model's gradients are not float32's),
    # and both tokens/s.
    language_models = sections["language_models"]["results"]["models"]
    assert set(language_models) == set(gpu_sections.LANGUAGE_MODELS)
    for name, check in language_models.items():
        assert check["ok"] is True and check["missing_gradients"] == [], (name, check)
        assert positive(check["loss_plain"]) and check["loss_rel_diff"] <= gpu_sections.LOSS_RTOL
        assert 0 <= check["grad_max_rel_err"] <= gpu_sections.GRAD_RTOL
        assert check["bf16_vs_float32_grad_max_rel_err"] > 1e-4, (name, check)
        assert positive(check["tokens_per_s_plain"]) and positive(check["tokens_per_s_pipeline"]), (name, check)
        assert positive(check["pipeline_vs_plain_time"])

    # 5. The multi-process benchmark's configurations, and why there is no run at 4 ranks.
    distributed = sections["distributed"]
    from benchmarks import distributed as benchmark

    assert list(distributed["results"]["runs"]) == [f"batch {b}" for b in gpu_sections.DRY.distributed_batches]
    for measured in distributed["results"]["runs"].values():
        assert set(measured) == {" ".join(config) for config in benchmark.CONFIGS}
        assert all(positive(r["speedup"]) and positive(r["pipe_ms"]) and positive(r["plain_ms"])
                   for r in measured.values()), measured
    assert any("no figures at 4 ranks" in note for note in distributed["notes"])

    text = (out / "report.md").read_text()
    assert text.count("\n## ") == len(gpu_check.SECTIONS)
    assert all(f"## {section.title}" in text for section in gpu_check.SECTIONS.values())
    assert "**ok**" in text and "gpt2" in text and "zero_bubble" in text


def test_a_section_that_raises_is_recorded_with_the_end_of_its_traceback(tmp_path: Path) -> None:
    code = "def inner():\n    raise ValueError('the section broke')\ninner()"
    outcome = gpu_check.run_child([sys.executable, "-c", code], tmp_path / "result.json", 60, environment())
    assert outcome.status == "failed"
    assert "ValueError: the section broke" in outcome.errors[-1]["error"] and "in inner" in outcome.log
    assert outcome.notes == ["the section's process saved nothing"]


@pytest.mark.parametrize("ignores_sigterm", [False, True])
def test_a_section_that_hangs_is_stopped_and_keeps_what_it_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ignores_sigterm: bool
) -> None:
    monkeypatch.setattr(gpu_check, "GRACE_S", 1.0)  # a child that ignores SIGTERM gets SIGKILL after it
    result = tmp_path / "result.json"
    code = textwrap.dedent(f"""
        import json, signal, sys, time
        if {ignores_sigterm}:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(sys.argv[1], "w").write(json.dumps({{"results": {{"rows": [1, 2]}}, "errors": [], "notes": ["half"]}}))
        time.sleep(120)
    """)
    started = time.monotonic()
    outcome = gpu_check.run_child([sys.executable, "-c", code, str(result)], result, 3, environment())
    assert time.monotonic() - started < 30
    assert outcome.status == "timed out" and outcome.results == {"rows": [1, 2]}
    assert outcome.notes[0] == "half" and "stopped after" in outcome.notes[-1]


def test_a_unit_that_raises_loses_only_its_own_figures(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    child = gpu_sections.Child(path, gpu_sections.DRY, torch.device("cpu"), time.time() + 60)

    def broken() -> int:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    assert child.attempt("first", broken) is None
    assert child.attempt("second", lambda: 2) == 2
    saved = json.loads(path.read_text())
    assert [e["unit"] for e in saved["errors"]] == ["first"]
    assert "RuntimeError: CUDA error: an illegal memory access" in saved["errors"][0]["error"]
    child.deadline = time.time() - 1
    assert child.attempt("third", lambda: 3) is None
    assert json.loads(path.read_text())["notes"] == ["third: not run, the section's time was spent"]


def test_the_test_recorder_tells_every_outcome_apart(tmp_path: Path) -> None:
    (tmp_path / "test_outcomes.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.fixture
        def broken():
            raise OSError("no device")

        def test_passes():
            pass

        def test_fails():
            assert 1 == 2, "one is not two"

        def test_errors(broken):
            pass

        @pytest.mark.skip(reason="not here")
        def test_skipped():
            pass

        @pytest.mark.xfail(strict=True)
        def test_xfails():
            assert False
    """))
    code = textwrap.dedent(f"""
        import dataclasses, time, torch
        from pathlib import Path
        from benchmarks import gpu_sections
        sizes = dataclasses.replace(gpu_sections.DRY, pytest_args=({str(tmp_path / "test_outcomes.py")!r},))
        result = Path({str(tmp_path / "result.json")!r})
        child = gpu_sections.Child(result, sizes, torch.device("cpu"), time.time() + 60)
        gpu_sections.run_tests(child)
    """)
    outcome = gpu_check.run_child([sys.executable, "-c", code], tmp_path / "result.json", 120, environment())
    tests = {test.split("::")[1]: entry for test, entry in outcome.results["tests"].items()}
    assert {name: entry["outcome"] for name, entry in tests.items()} == {
        "test_passes": "passed", "test_fails": "failed", "test_errors": "error", "test_skipped": "skipped",
        "test_xfails": "xfailed"}
    assert tests["test_skipped"]["reason"] == "not here"
    assert outcome.results["exit_code"] == 1 and outcome.status == "failed"
    errors = {e["unit"].split("::")[1]: e["error"] for e in outcome.errors}
    assert set(errors) == {"test_fails", "test_errors"}
    assert "one is not two" in errors["test_fails"] and "OSError: no device" in errors["test_errors"]


def test_a_test_that_hangs_is_left_running_and_the_ones_before_it_are_kept(tmp_path: Path) -> None:
    (tmp_path / "test_hang.py").write_text(textwrap.dedent("""
        import time

        def test_first():
            pass

        def test_hangs():
            time.sleep(300)
    """))
    code = textwrap.dedent(f"""
        import dataclasses, time, torch
        from pathlib import Path
        from benchmarks import gpu_check, gpu_sections
        sizes = dataclasses.replace(gpu_sections.DRY, pytest_args=({str(tmp_path / "test_hang.py")!r}, "-p",
                                                                    "no:timeout"))
        result = Path({str(tmp_path / "result.json")!r})
        gpu_check.SECTIONS["tests"].run(gpu_sections.Child(result, sizes, torch.device("cpu"), time.time() + 60))
    """)
    outcome = gpu_check.run_child([sys.executable, "-c", code], tmp_path / "result.json", 12, environment())
    assert outcome.status == "timed out"
    assert {test.split("::")[1]: entry["outcome"] for test, entry in outcome.results["tests"].items()} == {
        "test_first": "passed", "test_hangs": "running"}


def test_each_section_gets_its_share_and_what_the_others_left() -> None:
    assert gpu_check.allowance(0.1, 480, 0, 400) == pytest.approx(48)
    assert gpu_check.allowance(0.1, 480, 30, 400) == pytest.approx(78)
    assert gpu_check.allowance(0.1, 480, 30, 20) == 20
    assert gpu_check.allowance(0.1, 480, 0, -3) == 0
    # The shares leave room for the report and the children's starts.
    assert sum(s.share for s in gpu_check.SECTIONS.values()) * gpu_check.BUDGET_S + gpu_check.RESERVE_S < 470


def test_a_spent_budget_skips_the_sections_and_still_writes_the_report(tmp_path: Path) -> None:
    assert gpu_check.main(["--dry-run", "--budget", "1", "--out", str(tmp_path), "--sections", "gpipe", "tests"]) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["sections"]) == ["tests", "gpipe"] and report["finished"] is True
    for entry in report["sections"].values():
        assert entry["status"] == "skipped" and entry["notes"] == ["the budget (1 s) was spent before it"]
    assert "**skipped**" in (tmp_path / "report.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check without a GPU")
def test_without_cuda_the_check_says_so_and_runs_nothing(tmp_path: Path) -> None:
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["header"]["device"] == "no CUDA device"
    for entry in report["sections"].values():
        assert entry["status"] == "skipped" and "sees no CUDA device" in entry["notes"][0] and entry["seconds"] is None


def test_the_markdown_shows_what_went_wrong_and_survives_figures_cut_short() -> None:
    report: Dict[str, Any] = {
        "header": {"dry_run": False, "device": "NVIDIA H100 80GB HBM3 (cuda:0 of 1)", "torch": "2.11.0+cu130",
                   "cuda": "13.0", "cudnn": 91000, "python": "3.12.3", "transformers": None, "pytest": "8.4.0",
                   "commit": None, "source_fingerprint": "0123456789abcdef", "machine": "x", "started": "now",
                   "budget_s": 480.0, "command": "python3 benchmarks/gpu_check.py"},
        "finished": False, "wall_s": 100.0,
        "sections": {
            "gpipe": {"title": "2. GPipe on the GPU", "status": "timed out", "seconds": 72.0, "budget_s": 70.0,
                      "results": {"rows": [{"model": "mlp"}]}, "notes": ["stopped after 72 s"],
                      "errors": [{"unit": "mlp, float32", "error": "Traceback ...\nRuntimeError: CUDA error"}],
                      "log": "the end of the output"},
            "language_models": {"title": "4. as_sequential", "status": "skipped", "seconds": 1.0, "budget_s": 90.0,
                                "results": {}, "notes": ["skipped: transformers is not installed here"],
                                "errors": [], "log": ""},
        },
    }
    text = gpu_report.markdown(report)
    assert "NVIDIA H100 80GB HBM3" in text and "unknown (no git checkout here)" in text and "(not finished)" in text
    assert "**timed out** in 72 s of 70 s" in text and "- stopped after 72 s" in text
    assert "Error in mlp, float32:" in text and "RuntimeError: CUDA error" in text and "the end of the output" in text
    assert "could not be laid out" in text  # a row without its figures: the JSON keeps them
    assert "**skipped**" in text and "transformers is not installed here" in text


def test_sigterm_stops_a_section_so_that_it_saves_and_cleans_up(tmp_path: Path) -> None:
    # A section's child turns SIGTERM into KeyboardInterrupt: `finally` blocks run (the distributed benchmark
    # stops its ranks in one) and the child saves what it has.
    code = textwrap.dedent("""
        import sys, time
        from benchmarks import gpu_check, gpu_sections

        def hang(child):
            child.results["started"] = True
            child.save()
            try:
                time.sleep(120)
            finally:
                child.notes.append("cleaned up")

        gpu_check.SECTIONS["gpipe"] = gpu_check.Section("gpipe", "hangs", 0.1, hang)
        sys.exit(gpu_check.main(sys.argv[1:]))
    """)
    result = tmp_path / "result.json"
    child = subprocess.Popen([sys.executable, "-c", code, "--section", "gpipe", "--result", str(result), "--deadline",
                              repr(time.time() + 60), "--dry-run"], cwd=ROOT, env=environment())
    deadline = time.monotonic() + 60
    while not (result.exists() and json.loads(result.read_text())["results"].get("started")):
        assert time.monotonic() < deadline and child.poll() is None
        time.sleep(0.1)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 3
    saved = json.loads(result.read_text())
    assert saved["results"] == {"started": True}
    assert saved["notes"] == ["cleaned up", "stopped: the section's time was spent"]
