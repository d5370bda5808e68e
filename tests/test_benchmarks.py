"""The benchmarks: their models and harness, and every benchmark run once on the tiny preset of run_all.py, which
writes a RESULTS.md with one table per benchmark.

No test asserts how large a measured figure is, or how two compare (a busy machine moves them): only that each
figure is there, of its kind, and that what holds by construction holds.
"""
import importlib
import json
import math
import re
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import models, run_all  # noqa: E402
from benchmarks.harness.cpu import THREAD_KINDS, thread_cpu  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.output import Summary, cell, format_table, markdown_table  # noqa: E402
from benchmarks.harness.steps import drop_grads, microbatched_train_step, train_step  # noqa: E402
from benchmarks.harness.timing import Variant, compare, median_ratio, rotated, round_robin  # noqa: E402

HARNESS = ["harness", "harness.machine", "harness.steps", "harness.timing", "harness.memory", "harness.cpu",
           "harness.processes", "harness.output"]
MODULES = HARNESS + ["models", "run_all", "gpu_check", "gpu_sections", "gpu_report"] + run_all.NAMES
#: The tiny run takes minutes on a loaded 2-core machine: the tests that wait for it get this long.
TINY_TIMEOUT = 1800


def has(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def figure(value: Any) -> bool:
    """A measured figure: a finite number (of any sign: a difference of two timings may come out below 0)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --- the modules, models and harness ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_module_imports(name: str) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.__doc__
    if name in run_all.NAMES:
        assert callable(getattr(module, "summary", None)), f"benchmarks/{name}.py has no summary() for RESULTS.md"


def test_every_benchmark_script_is_run_by_run_all_or_is_a_part() -> None:
    # A script a user runs is in run_all.py (and so in RESULTS.md); the rest are the GPU check's parts, the
    # models and run_all itself. Experiments live in benchmarks/experiments/, outside both.
    scripts = {path.stem for path in (ROOT / "benchmarks").glob("*.py")} - {"__init__"}
    parts = {"models", "run_all", "gpu_check", "gpu_sections", "gpu_report"}
    assert scripts - parts == set(run_all.NAMES)


def tiny(shape: Tuple[int, ...], batch: int = 2) -> torch.Tensor:
    return torch.randn((batch,) + shape[1:])


@pytest.mark.parametrize("name", ["resnet101", "amoebanet"])
@pytest.mark.parametrize("preset", ["small", "tiny"])
def test_model_builders_train_on_a_tiny_batch(name: str, preset: str) -> None:
    workload = models.build(name, preset)
    assert isinstance(workload.module, nn.Sequential)
    x = tiny(workload.input_shape)
    output = workload.module(x)
    assert output.shape[0] == 2
    output.mean().backward()
    assert all(p.grad is not None for p in workload.module.parameters())


@pytest.mark.parametrize("variant", ["plain", "tuple", "skip"])
def test_unet_variants_build_and_train(variant: str) -> None:
    workload = models.unet("small", variant)
    x = tiny(workload.input_shape)
    output = workload.module(x)
    assert output.shape == (2, 1) + workload.input_shape[2:]
    output.mean().backward()


def test_unet_variants_agree_given_the_same_weights() -> None:
    torch.manual_seed(0)
    workload = models.unet("small", "plain")
    reference = workload.module
    x = tiny(workload.input_shape)
    built = {"tuple": models.unet("small", "tuple").module}
    for api in ["torchpipe", "torchgpipe"]:
        if has(f"{api}.skip"):
            built[f"skip-{api}"] = models.unet("small", "skip", api=api).module
    x.requires_grad_(True)
    expected = reference(x)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    for name, module in built.items():
        models.copy_weights(reference, module)
        output = module(x)
        (grad,) = torch.autograd.grad(output.sum(), x)
        torch.testing.assert_close(output, expected, msg=f"{name} output differs from the plain U-Net")
        torch.testing.assert_close(grad, expected_grad, msg=f"{name} input grad differs from the plain U-Net")


def test_same_seed_gives_the_same_unet_weights() -> None:
    torch.manual_seed(0)
    plain = models.unet("small", "plain").module
    torch.manual_seed(0)
    carried = models.unet("small", "tuple").module
    for a, b in zip(plain.parameters(), carried.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant", ["tuple", "skip"])
def test_unet_under_gpipe_equals_plain(variant: str) -> None:
    import torchpipe

    torch.manual_seed(0)
    plain = models.unet("small", "plain").module.eval()
    sequential = models.unet("small", variant).module
    models.copy_weights(plain, sequential)
    assert isinstance(sequential, nn.Sequential)
    pipe = torchpipe.GPipe(sequential.eval(), [10, 10, 7], devices=["cpu"] * 3, chunks=2)
    x = tiny(models.unet("small", "plain").input_shape, batch=4)
    torch.testing.assert_close(pipe(x), plain(x))


def test_harness_compare_and_tables() -> None:
    calls = []
    plain = Variant("plain", lambda: calls.append("p"))
    other = Variant("other", lambda: calls.append("o"), threads=1)
    [result] = compare(plain, [other], rounds=3, warmup=1, quiet=True)
    assert calls == ["p", "o"] * 4
    assert result.name == "other" and len(result.ratios) == 3
    table = format_table(["a", "b"], [["x", 1.5], ["y", None]])
    assert "1.500" in table and "n/a" in table
    assert "torch" in machine_description()
    assert [cell(v) for v in (0.9876, 12.34, 1234.5, None, True, [1.0, 2], "a|b")] == [
        "0.988", "12.3", "1234", "n/a", "yes", "1.000, 2", "a|b"]
    assert markdown_table(["a", "b"], [["x|y", 1.5]]) == "| a | b |\n|---|---|\n| x\\|y | 1.500 |"
    assert Summary(["a"], [[1]], ["a note"]).markdown() == "| a |\n|---|\n| 1 |\n\na note"


def test_round_robin_runs_every_step_once_a_round_in_a_rotating_order() -> None:
    calls: List[str] = []
    steps = [Variant(name, lambda name=name: calls.append(name)) for name in "abc"]
    times = round_robin(steps, rounds=3, warmup=1, quiet=True)
    assert calls == list("abc" "bca" "cab" "abc")  # a warm-up round, then three; each starts one later
    assert {name: len(values) for name, values in times.items()} == {"a": 3, "b": 3, "c": 3}
    fixed = {"a": [1.0, 2.0, 4.0], "b": [2.0, 2.0, 2.0]}
    assert median_ratio(fixed, "a", "b") == 1.0  # per round: 0.5, 1, 2
    with pytest.raises(AssertionError, match="distinct names"):
        round_robin([steps[0], steps[0]], rounds=1, quiet=True)
    calls.clear()
    round_robin(steps, rounds=2, warmup=0, quiet=True, rotate=False)
    assert calls == list("abc" "abc")


def test_rounds_rotate_the_order_of_their_steps() -> None:
    orders = [rotated("abcd", round_) for round_ in range(8)]
    assert orders[:4] == [list("abcd"), list("bcda"), list("cdab"), list("dabc")] and orders[4:] == orders[:4]
    # Over 4 rounds each configuration runs once in each place.
    assert all(sorted(order[place] for order in orders[:4]) == list("abcd") for place in range(4))


def test_the_by_hand_yardstick_gives_the_whole_batchs_gradients() -> None:
    # Micro-batches weighed by their share: the gradients of a 'mean' loss on the whole batch, for the default
    # loss (the output's mean), a loss of the output alone, and a loss with a target; uneven micro-batches too.
    torch.manual_seed(0)
    model = models.mlp(2, 4)
    x, y = torch.randn(10, 4), torch.randn(10, 4)
    losses = [{}, {"loss_fn": lambda output: output.pow(2).mean()},
              {"target": y, "loss_fn": nn.functional.mse_loss}]
    for loss in losses:
        train_step(model, x, keep_grads=True, **loss)()
        whole = [p.grad.clone() for p in model.parameters()]
        drop_grads(model)
        microbatched_train_step(model, x, 3, keep_grads=True, **loss)()
        for p, expected in zip(model.parameters(), whole):
            torch.testing.assert_close(p.grad, expected)
        drop_grads(model)
        microbatched_train_step(model, x, 3, **loss)()  # the step timed: its gradients dropped
        assert all(p.grad is None for p in model.parameters())
    with pytest.raises(AssertionError, match="loss_fn"):
        train_step(model, x, target=y)()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread_cpu reads /proc")
def test_thread_cpu_counts_each_kind_of_thread() -> None:
    stop = threading.Event()
    spun = threading.Event()

    def spin() -> None:
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        spun.set()
        stop.wait()

    before = thread_cpu()
    thread = threading.Thread(target=spin)
    thread.start()
    try:
        assert spun.wait(30)
        after = thread_cpu()  # the thread is still there: its CPU counts
    finally:
        stop.set()
        thread.join()
    assert after["other threads"][0] - before.get("other threads", (0.0, 0))[0] >= 0.2, (before, after)
    assert after["main"][0] >= before["main"][0] and after["main"][1] >= before["main"][1]


def test_speed_helpers() -> None:
    from benchmarks import speed

    assert speed.parse_config("2x8") == (2, 8)
    assert models.even_balance(10, 3) == [4, 3, 3]


def test_resnet50_is_an_ordinary_module_and_by_hand_the_same_model() -> None:
    workload = models.resnet50("small")
    module = workload.module
    assert not isinstance(module, nn.Sequential)
    hand = models.resnet_by_hand(module)
    assert len(hand) == 4 + 16 + 3
    x = tiny(workload.input_shape)
    module.eval()
    torch.testing.assert_close(hand(x), module(x))
    assert sum(1 for _ in module.parameters()) == 53 + 2 * 53 + 2  # convolutions, BatchNorms, the classifier


def test_traced_resnet50_is_cut_like_the_hand_written_one() -> None:
    from benchmarks import speed

    entry = speed.traced_resnet50("small")
    traced, hand = entry.workload.module, entry.hand
    assert hand is not None and entry.hand_names is not None
    assert len(traced) == 107
    cut = speed.same_cut(traced, entry.hand_names, [11, 12])
    # The second partition starts with the block that starts the hand-written one's second partition.
    first = traced[cut[0]].name
    assert first.startswith(entry.hand_names[11] + ".") and not traced[cut[0] - 1].name.startswith(
        entry.hand_names[11] + ".")
    x = tiny(entry.workload.input_shape)
    entry.plain.eval()
    torch.testing.assert_close(traced.eval()(x), entry.plain(x))
    torch.testing.assert_close(hand.eval()(x), entry.plain(x))


def test_the_distributed_benchmark_compares_round_by_round_and_simulates_each_map() -> None:
    from benchmarks import distributed
    from torchpipe.schedule import Kind, build, simulate

    against = distributed._against([2.0, 1.0, 3.0], [1.0, 2.0, 2.0])  # rival / ours: 2.0, 0.5, 1.5
    assert against == {"ratio": 1.5, "ahead": 2, "rounds": 3}
    assert distributed._versus({"vs_rival": against}, "vs_rival") == "1.500 (2/3)"
    assert distributed._versus({}, "vs_rival") == ""
    # Each schedule is simulated from the costs measured on its own placement: the loop's are not the V's.

    def cost(stage: int, kind: Kind) -> float:
        return 2.0 if kind is Kind.BACKWARD else 1.0

    cost_models = {"auto": (cost, 0.5), "auto-4": (cost, 1.0), "auto-loop": (cost, 2.0)}
    for name, stages, overhead in [("1f1b", 2, 0.5), ("zbv", 4, 1.0), ("dualpipev", 4, 1.0), ("looped_bfs", 4, 2.0),
                                   ("interleaved_1f1b", 4, 2.0)]:
        schedule = build(name, 8, stages, 2)
        expected = simulate(schedule, lambda a, extra=overhead: cost(a.stage, a.kind) + extra).step_time
        assert distributed._predicted(schedule, cost_models) == expected, name
        assert distributed._measured_by(name) == {2: "auto", 4: "auto-4" if name in ("zbv", "dualpipev")
                                                  else "auto-loop"}[stages], name
    assert distributed._predicted(build("looped_bfs", 8, 4, 2), {"auto-4": (cost, 1.0)}) is None
    # The prediction is judged on the pairs the measurement orders: a < c and b < c right, a < b wrong, but only
    # 1 % separates a and b: noise at a 3 % threshold.
    measured = {"a": 100.0, "b": 101.0, "c": 110.0}
    predicted = {"a": 95.0, "b": 94.0, "c": 120.0}
    assert distributed.ordered_pairs(measured, predicted) == (2, 3)
    assert distributed.ordered_pairs(measured, predicted, 0.03) == (2, 2)
    assert distributed.ordered_pairs(measured, {"a": 1.0, "b": 2.0, "c": 0.5}, 0.03) == (0, 2)


# --- run_all.py and RESULTS.md ---------------------------------------------------------------------------------


def test_results_keep_every_section_but_the_ones_run_again(tmp_path: Path) -> None:
    facts = {"machine": "a machine", "load": 1.0, "commit": "abc", "date": "today", "preset": "small", "seconds": 3,
             "command": "python benchmarks/overhead.py"}
    path = tmp_path / "RESULTS.md"
    sections = {name: (dict(facts, preset=name), run_all.section(name, dict(facts, preset=name),
                                                                 Summary(["figure"], [[name]])) + "\n")
                for name in ("overhead", "balance_solver", "speed")}
    run_all.write_results(path, sections)
    text = path.read_text()
    assert "do not edit" in text and text.index("## speed") < text.index("## overhead") < text.index(
        "## balance_solver"), "sections in run_all.BENCHMARKS' order"
    read = run_all.read_sections(path)
    assert read == sections
    read["overhead"] = (dict(facts, preset="again"), run_all.section("overhead", dict(facts, preset="again"),
                                                                     Summary(["figure"], [["new"]])) + "\n")
    run_all.write_results(path, read)
    again = run_all.read_sections(path)
    assert again["speed"] == sections["speed"] and again["balance_solver"] == sections["balance_solver"]
    assert "| new |" in again["overhead"][1] and "| overhead |" not in again["overhead"][1]


def test_a_benchmark_that_fails_keeps_its_last_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "RESULTS.md"
    facts = {"machine": "m", "load": None, "commit": "c", "date": "d", "preset": "small", "seconds": 1, "command": "x"}
    run_all.write_results(path, {"overhead": (facts, run_all.section("overhead", facts, Summary(["a"], [[1]])))})
    before = path.read_text()
    monkeypatch.setattr(run_all, "run", lambda *args, **kwargs: (1, 0.5, "python x"))
    assert run_all.main(["--only", "overhead", "--out", str(tmp_path / "out"), "--results", str(path)]) == 1
    assert path.read_text() == before


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every benchmark of run_all.py on its tiny preset, once: the folder of its JSON, logs and RESULTS.md."""
    out = tmp_path_factory.mktemp("bench")
    run_all.main(["--preset", "tiny", "--out", str(out), "--jobs", "2"])  # figures that mean nothing: at once
    yield out
    shutil.rmtree(out, ignore_errors=True)


def results_of(out: Path, name: str) -> Dict[str, Any]:
    """The JSON the tiny run of benchmark ``name`` wrote, or the end of its log where it wrote none."""
    benchmark = next(b for b in run_all.BENCHMARKS if b.name == name)
    if any(not has(module) for module in benchmark.needs):
        pytest.skip(f"{name} needs {', '.join(benchmark.needs)}")
    path = out / f"{name}.json"
    log = out / f"{name}.log"
    assert path.exists(), f"{name} wrote no results:\n" + (log.read_text()[-4000:] if log.exists() else "no log")
    results: Dict[str, Any] = json.loads(path.read_text())
    assert results["machine"] == machine_description()
    return results


@pytest.mark.timeout(TINY_TIMEOUT)
def test_run_all_writes_one_table_per_benchmark(tiny_run: Path) -> None:
    text = (tiny_run / "RESULTS.md").read_text()
    assert text.startswith("# Benchmark results\n") and "Generated by benchmarks/run_all.py: do not edit" in text
    sections = run_all.read_sections(tiny_run / "RESULTS.md")
    ran = [b.name for b in run_all.BENCHMARKS if all(has(module) for module in b.needs)]
    assert list(sections) == ran, "one section per benchmark, in run_all.BENCHMARKS' order"
    for name, (facts, body) in sections.items():
        assert facts["preset"] == "tiny" and facts["machine"] == machine_description(), name
        assert facts["seconds"] >= 0 and facts["commit"], name
        assert f"\n## {name}\n" in body and f"`python benchmarks/{name}.py " in body, name
        lines = body.splitlines()
        tables = [i for i, line in enumerate(lines) if re.fullmatch(r"\|(---\|)+", line)]
        assert len(tables) == 1, f"{name}: {len(tables)} tables"
        header = lines[tables[0] - 1]
        columns = header.count(" | ") + 1
        rows = [line for line in lines[tables[0] + 1:] if line.startswith("| ")]
        assert rows, f"{name}: a table with no rows"
        assert all(row.count(" | ") + 1 == columns for row in rows), (name, header, rows)


@pytest.mark.timeout(TINY_TIMEOUT)
def test_speed_reports_every_model_and_configuration(tiny_run: Path) -> None:
    results = results_of(tiny_run, "speed")
    assert set(results["models"]) == {"unet-skip", "resnet50-traced"}
    for name, model in results["models"].items():
        [row] = model["configs"]
        assert (row["partitions"], row["chunks"]) == (2, 2) and sum(row["balance"]) == model["layers"], name
        for variant in ("torchpipe", "by hand"):
            assert positive(row[variant]["samples_per_s"]) and positive(row[variant]["throughput_ratio"]), name
    traced = results["models"]["resnet50-traced"]["configs"][0]
    assert positive(traced["hand-written"]["samples_per_s"]) and positive(traced["traced_vs_hand"]["time_ratio"])


@pytest.mark.timeout(TINY_TIMEOUT)
def test_memory_reports_each_mode_and_the_largest_batch(tiny_run: Path) -> None:
    results = results_of(tiny_run, "memory")
    model = results["models"]["unet"]
    assert set(model["peak"]) == {"plain", "torchpipe except_last chunks=2"}
    assert all(m["step_bytes"] >= 0 for m in model["peak"].values())
    assert set(model["largest_batch"]) == {"plain", "torchpipe except_last chunks=8"}
    assert all(found["batch"] % 16 == 0 and found["probes"] for found in model["largest_batch"].values())


@pytest.mark.timeout(TINY_TIMEOUT)
def test_unet_skip_reports_both_ways_of_carrying_skips(tiny_run: Path) -> None:
    results = results_of(tiny_run, "unet_skip")
    [config] = results["configs"]
    for variant in ("torchpipe tuple", "torchpipe skip", "by hand"):
        assert positive(config[variant]["ratio"]) and len(config[variant]["ratios"]) == 1, variant
    assert config["ideal"] == (2 + 2 - 1) / (2 * 2)


@pytest.mark.timeout(TINY_TIMEOUT)
def test_overhead_reports_every_configuration(tiny_run: Path) -> None:
    from benchmarks import overhead

    results = results_of(tiny_run, "overhead")
    assert list(results["ratios"]) == [name for name, _, _, _ in overhead.CONFIGS]
    for (name, partitions, chunks, _), row in zip(overhead.CONFIGS, results["ratios"].values()):
        assert positive(row["plain"]) and positive(row["hand"]) and positive(row["plain_s"]), name
        assert row["ideal"] == (chunks + partitions - 1) / (chunks * partitions), name
    assert positive(results["two_threads"])
    assert results["machine_line"] == pytest.approx(results["two_threads"] * 2 * 9 / 16)
    assert figure(results["fixed_cost_per_task_us"])  # a difference of two timings: any sign


@pytest.mark.timeout(TINY_TIMEOUT)
def test_schedules_reports_every_schedule(tiny_run: Path) -> None:
    from benchmarks import schedules

    results = results_of(tiny_run, "schedules")
    rows = {row["schedule"]: row for row in results["rows"]}
    by_hand = rows.pop("plain, 4 micro-batches by hand")
    ran = {"gpipe", "1f1b", "zero_bubble", "zbv"}  # the tiny preset's
    assert set(rows) == {schedules.GPIPE} | {name for name, schedule, _ in schedules.CONFIGS if schedule in ran}
    assert positive(by_hand["two_threads"])
    assert by_hand["machine_line"] == pytest.approx(by_hand["two_threads"] * 2 * (4 + 1) / 8)
    # Each schedule's machine line: the two bare threads' step times twice its ideal, from its simulated bubble;
    # GPipe, which runs the 'gpipe' order, shares that schedule's. The ideals come from one step's measured costs
    # of a tiny MLP, mostly noise: their order is not asserted.
    for name, row in rows.items():
        assert positive(row["time_ratio"]) and positive(row["vs_by_hand"]) and positive(row["vs_line"]), name
        assert 0 <= row["simulated_bubble"] < 1 and row["ideal"] == pytest.approx(
            1 / (2 * (1 - row["simulated_bubble"]))), name
        assert (row["memory_ratio"] is None) == (name == schedules.GPIPE), name
        assert name == schedules.GPIPE or (row["memory_ratio"] >= 0 and 0 <= row["measured_idle"] < 1), name
    assert rows["1f1b"]["vs_1f1b"] == 1.0 and rows[schedules.GPIPE]["ideal"] == rows["gpipe"]["ideal"]
    assert rows["gpipe"]["split_stages"] == [] and rows["1f1b"]["split_stages"] == []


@pytest.mark.timeout(TINY_TIMEOUT)
def test_distributed_reports_both_libraries_and_the_fixed_cost(tiny_run: Path) -> None:
    from benchmarks import distributed

    results = results_of(tiny_run, "distributed")
    names = ["torchpipe 1f1b", "pipelining Schedule1F1B", "torchpipe auto"]
    figures = results["results"]
    assert set(figures) == {f"{name} batch=16" for name in names} | {f"{name} fixed cost" for name in names}
    for key, result in figures.items():
        name = key.split(" batch=")[0].split(" fixed cost")[0]
        assert positive(result["speedup"]) and positive(result["pipe_ms"]) and positive(result["plain_ms"]), key
        assert positive(result["first_step_s"]) and positive(result["start_s"]), key
        assert positive(result["two_processes"]) and result["machine_line"] == 0.5 / result["two_processes"], key
        # 'auto' chose within its placement; every torchpipe schedule's step was predicted from the costs a
        # measuring pipeline of its placement took.
        torchpipe = name.startswith("torchpipe")
        assert (positive(result.get("predicted_ms")) and "round_error" in result) == torchpipe, key
        assert (len(result.get("map_overhead_ms", ())) == 2) == torchpipe, key
    auto = figures["torchpipe auto batch=16"]
    assert auto["schedule"] in distributed.PLACEMENTS["auto"] and auto["schedule"] in auto["may_choose"]
    assert auto["measured_on"] == [0, 1] and auto["relayout_ms"] >= 0 and auto["overhead_ms"] >= 0
    assert set(auto["vs_fixed"]) == {"torchpipe 1f1b"}
    # torchpipe's 1f1b against Schedule1F1B in the same rounds, its steps back to back too; the CPU of those
    # steps per rank and kind of thread (each rank's main thread waited for messages: context switches).
    one = figures["torchpipe 1f1b batch=16"]
    assert one["vs_rival"]["rounds"] == 1 and 0 <= one["vs_rival"]["ahead"] <= 1 and positive(one["vs_rival"]["ratio"])
    fixed = figures["torchpipe 1f1b fixed cost"]
    assert positive(fixed["pipe_burst_ms"]) and positive(fixed["burst_vs_rival"]["ratio"])
    assert len(fixed["cpu"]) == distributed.WORLD
    for rank in fixed["cpu"]:
        assert {"main", "gloo"} <= set(rank) <= set(THREAD_KINDS) and rank["main"][1] > 0, rank
    log = (tiny_run / "distributed.log").read_text()
    assert "fastest first: measured" in log and "torchpipe auto (ran " in log


@pytest.mark.timeout(TINY_TIMEOUT)
def test_mesh_reports_every_layout(tiny_run: Path) -> None:
    from benchmarks import mesh

    result = results_of(tiny_run, "mesh")["models"]["wide"]
    times = {row["variant"]: row for row in result["times"]}
    layouts = [mesh.LAYOUTS[k].name for k in mesh.DEFAULT_LAYOUTS]
    assert set(times) >= {"plain", "by hand", "half batch", *layouts}
    assert all(positive(row["step_s"]) and positive(row["speedup"]) for row in times.values())
    for name, ranks in result["memory"].items():
        assert len(ranks) == (1 if name == "plain" else 2), (name, ranks)
        assert all(m["params_bytes"] > 0 and m["optimizer_bytes"] == 2 * m["params_bytes"] for m in ranks), ranks
    # Sharded and pipelined ranks hold half the parameters of a replica.
    plain = result["memory"]["plain"][0]["params_bytes"]
    assert result["memory"]["dp 2 x pp 1, replicate"][0]["params_bytes"] == plain
    assert result["memory"]["dp 2 x pp 1, shard"][0]["params_bytes"] == plain // 2
    reduction = result["reduction"]
    assert reduction["pp 2 x dp 1 (pipeline)"]["reduce_s"] == 0
    for name in ("dp 2 x pp 1, replicate", "dp 2 x pp 1, shard"):
        assert 0 <= reduction[name]["exposed_s"] <= reduction[name]["reduce_s"] <= reduction[name]["step_s"], name
        assert reduction[name]["reduce_s"] > 0, name


@pytest.mark.timeout(TINY_TIMEOUT)
def test_the_language_model_benchmark_reports_both_ways(tiny_run: Path) -> None:
    results = results_of(tiny_run, "language_model")
    assert set(results["ratios"]) == {"as_sequential (tied), as a module", "GPipe, 1 partition (untied)"}
    assert all(positive(row["ratio"]) and positive(row["plain_s"]) for row in results["ratios"].values())


@pytest.mark.timeout(TINY_TIMEOUT)
def test_the_language_model_pipeline_reports_every_variant(tiny_run: Path) -> None:
    # Two gloo ranks, every variant once on a tiny GPT-2; the gradients checked against the plain model's.
    from benchmarks import lm_pipeline

    results = results_of(tiny_run, "lm_pipeline")
    assert set(results["variants"]) == {name for name, _ in lm_pipeline.VARIANTS}
    for name, row in results["variants"].items():
        assert positive(row["tokens_per_s"]) and positive(row["vs_plain"]), name
        assert (row["vs_pipelining"] is not None) == (name.startswith("torchpipe") and name.endswith("2 ranks"))
        assert (row["of_ideal"] is not None) == name.startswith(("torchpipe", "pipelining"))
        assert len(row["peak_mib"]) == 2 and (row["peak_mib"][1] is None) == lm_pipeline.in_process(name)
    gradients = results["tied_gradient_equals_plain"]
    assert all(rank["torchpipe"] == {"tied": True, "others": True} for rank in gradients), gradients
    assert all(rank["pipelining"]["others"] for rank in gradients), gradients


@pytest.mark.timeout(TINY_TIMEOUT)
def test_compiled_reports_both_configurations(tiny_run: Path) -> None:
    results = results_of(tiny_run, "compiled")
    assert results["backend"] == "aot_eager"
    # Each row a configuration (of each cut of the model): the example's Pipeline, and the Sequential alone.
    assert {name.split(", ")[-1] for name in results["ratios"]} == {"Pipeline", "Sequential"}
    for name, row in results["ratios"].items():
        assert positive(row["ratio"]) and positive(row["eager_s"]) and positive(row["compiled_s"]), name
        assert positive(row["compiling_s"]), name


@pytest.mark.timeout(TINY_TIMEOUT)
def test_data_parallel_reports_every_step(tiny_run: Path) -> None:
    results = results_of(tiny_run, "data_parallel")
    assert len(results["median_ms"]) == 7 and all(positive(ms) for ms in results["median_ms"].values())
    assert positive(results["vs_plain"]) and positive(results["vs_by_hand"]) and positive(results["two_threads"])
    assert figure(results["chaining_saves"])


@pytest.mark.timeout(TINY_TIMEOUT)
def test_the_balance_solver_reports_every_kind_of_costs(tiny_run: Path) -> None:
    results = results_of(tiny_run, "balance_solver")
    assert len(results["cases"]) == 3
    # The exact solver's bottleneck is at least the average partition's, whatever the machine.
    assert all(positive(case["ms"]) and case["bottleneck_vs_average"] >= 1 for case in results["cases"].values())
    assert positive(results["against_dynamic_programme"]["dynamic_programme_ms"])


def test_stage_memory_says_whether_selective_lies_between_no_checkpoint_and_full() -> None:
    from benchmarks import stage_memory

    never, full, selective = (stage_memory.name_of(config) for config in stage_memory.RECOMPUTING)

    def rank(a: float, b: float, c: float) -> Dict[str, Any]:
        return {never: {"step_ms": a}, full: {"step_ms": b}, selective: {"step_ms": c}}

    note = stage_memory.recomputation_times([rank(160, 213, 182), rank(161, 214, 183)], 15)
    assert "rank 0: no checkpoint 160, 'full' 213, 'selective' 182" in note and "15 rounds" in note
    assert note.endswith("between no checkpoint and 'full' on every rank.")
    note = stage_memory.recomputation_times([rank(160, 213, 150), rank(161, 214, 183)], 1)
    assert "1 round in" in note and note.endswith("on rank 1 only.")
    assert stage_memory.recomputation_times([rank(160, 213, 220)] * 2, 3).endswith("on no rank.")
