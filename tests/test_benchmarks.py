"""The benchmarks import, their models build and train on a tiny batch, and the U-Net variants agree.

No timing is asserted: these only keep the benchmark code from rotting.
"""
import importlib
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import models  # noqa: E402
from benchmarks.harness.cpu import THREAD_KINDS, thread_cpu  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.output import format_table  # noqa: E402
from benchmarks.harness.steps import drop_grads, microbatched_train_step, pipeline_step, train_step  # noqa: E402
from benchmarks.harness.timing import Variant, compare, median_ratio, rotated, round_robin  # noqa: E402

HARNESS = ["harness", "harness.machine", "harness.steps", "harness.timing", "harness.memory", "harness.cpu",
           "harness.processes", "harness.output"]
MODULES = HARNESS + ["models", "speed", "memory", "unet_skip", "overhead", "run_all", "schedules", "distributed",
                     "data_parallel", "language_model", "lm_pipeline", "mesh", "gpu_check", "gpu_sections",
                     "gpu_report", "split_backward", "merged_backwards", "cost_model"]


def has(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_module_imports(name: str) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.__doc__


def tiny(shape: Tuple[int, ...], batch: int = 2) -> torch.Tensor:
    return torch.randn((batch,) + shape[1:])


@pytest.mark.parametrize("name", ["resnet101", "amoebanet"])
def test_model_builders_train_on_a_tiny_batch(name: str) -> None:
    workload = models.build(name, "small")
    assert isinstance(workload.module, nn.Sequential)
    x = tiny(workload.input_shape)
    output = workload.module(x)
    assert output.shape[0] == 2
    output.mean().backward()
    assert all(p.grad is not None for p in workload.module.parameters())


@pytest.mark.parametrize("variant", ["plain", "tuple", "skip"])
def test_unet_variants_build_and_train(variant: str) -> None:
    if variant == "skip" and not has("torchpipe.skip"):
        pytest.skip("torchpipe.skip is not importable yet")
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
    apis = ["torchpipe", "torchgpipe"]
    built = {"tuple": models.unet("small", "tuple").module}
    for api in apis:
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
    if variant == "skip" and not has("torchpipe.skip"):
        pytest.skip("torchpipe.skip is not importable yet")
    import torchpipe

    torch.manual_seed(0)
    plain = models.unet("small", "plain").module.eval()
    sequential = models.unet("small", variant).module
    models.copy_weights(plain, sequential)
    assert isinstance(sequential, nn.Sequential)
    pipe = torchpipe.GPipe(sequential.eval(), [10, 10, 7], devices=["cpu"] * 3, chunks=2)
    x = tiny(models.unet("small", "plain").input_shape, batch=4)
    torch.testing.assert_close(pipe(x), plain(x))


def test_harness_compare_and_table() -> None:
    calls = []
    plain = Variant("plain", lambda: calls.append("p"))
    other = Variant("other", lambda: calls.append("o"), threads=1)
    [result] = compare(plain, [other], rounds=3, warmup=1, quiet=True)
    assert calls == ["p", "o"] * 4
    assert result.name == "other" and len(result.ratios) == 3
    table = format_table(["a", "b"], [["x", 1.5], ["y", None]])
    assert "1.500" in table and "n/a" in table
    assert "torch" in machine_description()


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


def test_speed_runs_the_traced_resnet50(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import speed

    results = speed.main(["--models", "resnet50-traced", "--configs", "2x2", "--rounds", "1", "--warmup", "0",
                          "--balance", "even", "--quiet", "--resnet50-image", "32"])
    row = results["models"]["resnet50-traced"]["configs"][0]
    assert {"torchpipe", "hand-written", "traced_vs_hand"} <= set(row)
    assert "traced/hand time" in capsys.readouterr().out


def test_the_schedules_benchmark_runs_its_steps_on_a_tiny_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import models, schedules

    monkeypatch.setattr(schedules, "workload", lambda name: (models.mlp(4, 8), torch.randn(16, 8),
                                                             torch.randn(16, 8)))
    for _, schedule, stages in schedules.CONFIGS:
        pipe, x, y = schedules.pipeline("mlp", schedule, stages, 4)
        pipeline_step(pipe, x, y)()
        # zero_bubble's placement is still being decided here: its schedule may change after the timed step,
        # whose own schedule is the one simulated (simulating the next one's failed on a cost never measured).
        simulated, idle = schedules.timeline_figures(pipe, x, y)
        assert 0.0 <= simulated < 1.0 and 0.0 <= idle < 1.0
    schedules.by_hand_step("mlp", 4)()
    # The whole run's rows (its memory figures come from child processes, left out here).
    monkeypatch.setattr(schedules, "step_memory", lambda *args: 1)
    rows = {row["schedule"]: row for row in schedules.run("mlp", rounds=2, chunks=4)}
    assert set(rows) == ({"plain, 4 micro-batches by hand", schedules.GPIPE}
                         | {name for name, _, _ in schedules.CONFIGS})
    assert rows["1f1b"]["vs_1f1b"] == 1.0 and rows["zero_bubble"]["vs_1f1b"] > 0
    # Each schedule's machine line: the two bare threads' step times twice its ideal, from its simulated bubble;
    # GPipe, which runs the 'gpipe' order, shares that schedule's.
    for row in rows.values():
        if "vs_line" in row:
            assert row["ideal"] == pytest.approx(1 / (2 * (1 - row["simulated_bubble"]))) and row["vs_line"] > 0
    assert rows[schedules.GPIPE]["ideal"] == rows["gpipe"]["ideal"]
    # The ideals come from each step's measured costs, on a 4 x 8 MLP mostly noise: their order is not asserted
    # (under CI's load zbv's came out 0.696 against gpipe's 0.654, which failed a clean run).
    by_hand = rows["plain, 4 micro-batches by hand"]
    assert by_hand["two_threads"] > 0 and by_hand["machine_line"] == by_hand["two_threads"] * 2 * (4 + 1) / 8
    assert all(row["split_stages"] == [] for name, row in rows.items() if name in ("gpipe", "1f1b"))
    # The memory figure (in-process here): zero_bubble's after its placement's steps, on every schedule a size.
    threads = torch.get_num_threads()
    try:
        for _, schedule, stages in schedules.CONFIGS:
            assert schedules.memory("mlp", schedule, stages, 4)["step_bytes"] >= 0
    finally:
        torch.set_num_threads(threads)


def test_the_distributed_benchmark_measures_both_libraries_round_by_round(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import distributed

    configs = [("torchpipe", "1f1b"), ("pipelining", "Schedule1F1B"), ("torchpipe", "gpipe"), ("torchpipe", "zbv"),
               ("pipelining", "ScheduleZBVZeroBubble"), ("torchpipe", "auto"), ("torchpipe", "auto-4"),
               ("torchpipe", "looped_bfs")]
    assert set(configs) <= set(distributed.CONFIGS) and distributed.RIVALS[configs[0]] == configs[1]
    figures = distributed.measure(configs, batch=16, rounds=2, timeout=180, burst=2)
    assert set(figures) == {"torchpipe 1f1b", "pipelining Schedule1F1B", "torchpipe gpipe", "torchpipe zbv",
                            "pipelining ScheduleZBVZeroBubble", "torchpipe auto", "torchpipe auto-4",
                            "torchpipe looped_bfs"}
    # 'auto' chose within its placement; every torchpipe schedule's step was predicted from the costs the 'auto'
    # on stages of its size measured; 'auto' is compared with every fixed schedule round by round.
    assert figures["torchpipe auto"]["schedule"] in ("1f1b", "zero_bubble", "gpipe")
    assert figures["torchpipe auto-4"]["schedule"] in ("zbv", "dualpipev")
    for name, result in figures.items():
        assert (result.get("predicted_ms", 0) > 0) == name.startswith("torchpipe"), name
        assert (result.get("predicted_round_ms", 0) > 0) == name.startswith("torchpipe"), name
        assert ("round_error" in result) == name.startswith("torchpipe"), name
        # The calibrated time around each action on the schedule's own map (the loop's measured by a pipeline of
        # its own): at set-up and over the rounds.
        assert (len(result.get("map_overhead_ms", ())) == 2) == name.startswith("torchpipe"), name
        assert all(ms >= 0 for ms in result.get("map_overhead_ms", ())), name
    # Each on its own map: the loop's schedules from a measuring pipeline on the loop, not in the V.
    assert figures["torchpipe looped_bfs"]["measured_on"] == [0, 1, 0, 1]
    assert figures["torchpipe zbv"]["measured_on"] == figures["torchpipe auto-4"]["measured_on"] == [0, 1, 1, 0]
    assert figures["torchpipe 1f1b"]["measured_on"] == [0, 1]
    assert figures["torchpipe auto"]["overhead_ms"] >= 0 and figures["torchpipe auto"]["measured_costs_ms"]
    assert figures["torchpipe auto"]["relayout_ms"] > 0, "its first step's messages waited for their layouts"
    assert figures["torchpipe auto-4"]["may_choose"] == ["zbv"], "dualpipev holds more than 1F1B"
    assert figures["torchpipe auto"]["schedule"] in figures["torchpipe auto"]["may_choose"]
    assert set(figures["torchpipe auto-4"]["vs_fixed"]) == {"torchpipe 1f1b", "torchpipe gpipe", "torchpipe zbv",
                                                            "torchpipe looped_bfs"}
    distributed._print_model(figures, 16)
    printed = capsys.readouterr().out
    assert "fastest first: measured" in printed and "torchpipe auto (ran " in printed
    assert "fixed schedule it may choose (within 1F1B's activations), torchpipe zbv" in printed
    assert "vs_rival" in figures["torchpipe zbv"], "the V's two stages per rank, beside pipelining's same class"
    for name, result in figures.items():
        assert result["speedup"] > 0 and result["plain_ms"] > 0 and result["pipe_ms"] > 0, name
        assert result["pipe_burst_ms"] > 0  # steps back to back: the fixed cost's figure
        assert 0 < result["first_step_s"] < 120 and 0 < result["start_s"] < 120
        # Two processes each doing half the work at once take more than a quarter and less than twice the time
        # of one doing both halves; the machine line is the ideal's share that allows.
        assert 0.25 < result["two_processes"] < 2 and result["machine_line"] == 0.5 / result["two_processes"]
        # The CPU of the steps back to back, per rank and kind of thread: every rank has its main thread, which
        # waited for messages (context switches), and gloo's threads.
        assert len(result["cpu"]) == distributed.WORLD
        for rank in result["cpu"]:
            assert {"main", "gloo"} <= set(rank) <= set(THREAD_KINDS), (name, rank)
            assert all(ms >= 0 and switches >= 0 for ms, switches in rank.values()), (name, rank)
            assert rank["main"][1] > 0, (name, rank)
    # One pair of processes ran them all, round by round: the machine line and yardsticks are shared.
    assert len({result["two_processes"] for result in figures.values()}) == 1
    assert len({result["hand_ms"] for result in figures.values()}) == 1
    # torchpipe's 1f1b against Schedule1F1B in the same rounds; gpipe's rival was not measured.
    for key in ("vs_rival", "burst_vs_rival"):
        against = figures["torchpipe 1f1b"][key]
        assert against["rounds"] == 2 and 0 <= against["ahead"] <= 2 and against["ratio"] > 0
        assert key not in figures["torchpipe gpipe"] and key not in figures["pipelining Schedule1F1B"]


def test_the_prediction_is_judged_on_the_pairs_the_measurement_orders() -> None:
    from benchmarks.distributed import ordered_pairs

    measured = {"a": 100.0, "b": 101.0, "c": 110.0}
    # Right about a < c and b < c; wrong about a < b, which only 1 % separates: noise at a 3 % threshold.
    predicted = {"a": 95.0, "b": 94.0, "c": 120.0}
    assert ordered_pairs(measured, predicted) == (2, 3)
    assert ordered_pairs(measured, predicted, 0.03) == (2, 2)
    assert ordered_pairs(measured, {"a": 1.0, "b": 2.0, "c": 0.5}, 0.03) == (0, 2)


def test_the_cost_model_finds_the_charge_the_steps_took() -> None:
    # Steps whose workers spent a time around each action (as on 2 gloo ranks, issue 36): for every schedule of a
    # map the time per action comes out the same, and predicts the others' steps from the first's; the hop that
    # explains each schedule's own steps differs from schedule to schedule.
    from benchmarks import cost_model
    from torchpipe.schedule import Kind, build, merge_backwards, simulate

    own = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.2, Kind.BACKWARD_INPUT: 1.0, Kind.BACKWARD_WEIGHT: 1.3}
    around = 0.1

    def charged(action: Any) -> float:
        return own[action.kind] + around

    ranks: List[Any] = [{"steps": {}, "schedules": {}}, {"steps": {}, "schedules": {}}]
    for name in [name for names in cost_model.MAPS.values() for name in names]:
        schedule = merge_backwards(build(name, 8, 4, 2), charged)
        ran = simulate(schedule, charged)
        spans = [[str(a), ran.start[a], ran.start[a] + own[a.kind]] for a in schedule.actions()]  # the work alone
        ranks[0]["steps"][name] = [spans, spans]
        ranks[1]["steps"][name] = [[], []]
        ranks[0]["schedules"][name] = [[str(a) for a in actions] for actions in schedule.workers]
    results = cost_model.analyse(ranks)
    for name, result in results.items():
        assert result["per_action_ms"] == pytest.approx([around * 1e3] * 3, rel=1e-6), name
        assert result["error_per_action"] == pytest.approx(0.0, abs=1e-9), name
    loop = [results[name]["hop_ms"][0] for name in cost_model.MAPS["loop"]]
    assert max(loop) > 1.2 * min(loop), f"a hop's time depends on the schedule: {loop}"
    assert max(abs(results[name]["error_by_hop"]) for name in cost_model.MAPS["loop"]) > 0.01


def test_the_cost_model_tells_what_runs_of_one_stage_save() -> None:
    # looped_bfs runs a stage's actions of a kind back to back; on 2 gloo ranks at batch 256 the third and later
    # of a run took 0.88 to 0.94 of their typical time, its first 1.08 to 1.12 (issue 36, the twenty-first
    # session). The measuring step's runs are two long at most, so its costs cannot tell: here steps whose later
    # actions in a run are cheaper are mispredicted per action, and predicted exactly once each place's factor is
    # known, which the table finds.
    from benchmarks import cost_model
    from torchpipe.schedule import Kind, build, merge_backwards, simulate

    own = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.2, Kind.BACKWARD_INPUT: 1.0, Kind.BACKWARD_WEIGHT: 1.3}
    later, around = 0.8, 0.1
    ranks: List[Any] = [{"steps": {}, "schedules": {}}, {"steps": {}, "schedules": {}}]
    for name in [name for names in cost_model.MAPS.values() for name in names]:
        schedule = merge_backwards(build(name, 8, 4, 2), lambda a: own[a.kind])
        places = cost_model.run_places(schedule)

        def work(action: Any, places: Dict[Any, int] = places) -> float:
            return own[action.kind] * (later if places[action] == 2 else 1.0)

        ran = simulate(schedule, lambda a: work(a) + around)
        spans = [[str(a), ran.start[a], ran.start[a] + work(a)] for a in schedule.actions()]
        ranks[0]["steps"][name] = [spans, spans]
        ranks[1]["steps"][name] = [[], []]
        ranks[0]["schedules"][name] = [[str(a) for a in actions] for actions in schedule.workers]
    looped = cost_model.run_places(merge_backwards(build("looped_bfs", 8, 4, 2), lambda a: own[a.kind]))
    assert sorted(looped.values()).count(2) == 4 * (8 - 2) * 2  # each stage's F and B in runs of 8
    assert max(cost_model.run_places(build("interleaved_zero_bubble", 8, 4, 2)).values()) < 2
    results = cost_model.analyse(ranks)
    assert results["looped_bfs"]["runs"]["later"] == [pytest.approx(later), 4 * 6 * 2 * 2]
    assert results["looped_bfs"]["runs"]["first"][0] == pytest.approx(1.0)
    assert results["interleaved_zero_bubble"]["runs"]["later"] == [None, 0]
    assert results["looped_bfs"]["error_per_action"] > 0.02  # simulated slower than it ran
    for name in cost_model.MAPS["loop"]:
        assert results[name]["error_runs_known"] == pytest.approx(0.0, abs=1e-9), name


def test_the_cost_model_benchmark_runs_on_two_ranks() -> None:
    from benchmarks import cost_model

    results = cost_model.measure(batch=16, rounds=1, timeout=240, layers=4, width=8)
    assert set(results) == {name for names in cost_model.MAPS.values() for name in names}
    for name, result in results.items():
        assert result["step_ms"] > 0 and result["per_action_ms"][0] >= 0 and result["hop_ms"][0] >= 0, name
        assert result["predicted_from"] == cost_model.MAPS[result["map"]][0]


def test_rounds_rotate_the_order_of_their_steps() -> None:
    orders = [rotated("abcd", round_) for round_ in range(8)]
    assert orders[:4] == [list("abcd"), list("bcda"), list("cdab"), list("dabc")] and orders[4:] == orders[:4]
    # Over 4 rounds each configuration runs once in each place.
    assert all(sorted(order[place] for order in orders[:4]) == list("abcd") for place in range(4))


def test_the_distributed_benchmark_against_figures() -> None:
    from benchmarks import distributed

    against = distributed._against([2.0, 1.0, 3.0], [1.0, 2.0, 2.0])  # rival / ours: 2.0, 0.5, 1.5
    assert against == {"ratio": 1.5, "ahead": 2, "rounds": 3}
    assert distributed._versus({"vs_rival": against}, "vs_rival") == "1.500 (2/3)"
    assert distributed._versus({}, "vs_rival") == ""
    # Each schedule is simulated from the costs measured on its own map: the loop's are not the V's (issue 36:
    # 5 of the 9 pairs the simulation misordered held looped_bfs, simulated from the V's costs).
    from torchpipe.schedule import Kind, build, simulate

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


def test_the_language_model_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from benchmarks import language_model

    results = language_model.main(["--rounds", "1", "--layers", "1", "--width", "16", "--batch", "2", "--length", "4"])
    assert set(results["ratios"]) == {"as_sequential (tied), as a module", "GPipe, 1 partition (untied)"}
    assert all(row["ratio"] > 0 for row in results["ratios"].values())
    assert "ratio" in capsys.readouterr().out


@pytest.mark.slow
def test_the_language_model_pipeline_benchmark_runs_quick(capsys: pytest.CaptureFixture[str]) -> None:
    # Two gloo ranks, every variant once on a tiny GPT-2; also checks the gradients against the plain model's.
    pytest.importorskip("transformers")
    from benchmarks import lm_pipeline

    results = lm_pipeline.main(["--quick"])
    assert set(results["variants"]) == {name for name, _ in lm_pipeline.VARIANTS}
    for name, row in results["variants"].items():
        assert row["tokens_per_s"] > 0 and row["vs_plain"] > 0, name
        assert (row["vs_pipelining"] is not None) == (name.startswith("torchpipe") and name.endswith("2 ranks"))
        assert (row["of_ideal"] is not None) == name.startswith(("torchpipe", "pipelining"))
        assert len(row["peak_mib"]) == 2 and (row["peak_mib"][1] is None) == lm_pipeline.in_process(name)
    gradients = results["tied_gradient_equals_plain"]
    assert all(rank["torchpipe"] == {"tied": True, "others": True} for rank in gradients), gradients
    assert all(rank["pipelining"]["others"] for rank in gradients), gradients
    out = capsys.readouterr().out
    assert "machine:" in out and "vs pipelining" in out


@pytest.mark.slow
def test_the_mesh_benchmark_measures_every_layout(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import mesh

    results = mesh.main(["--quick", "--quiet", "--models", "wide", "--timeout", "180"])
    result = results["models"]["wide"]
    times = {row["variant"]: row for row in result["times"]}
    layouts = [mesh.LAYOUTS[k].name for k in mesh.DEFAULT_LAYOUTS]
    assert set(times) >= {"plain", "by hand", "half batch", *layouts}
    assert all(row["step_s"] > 0 and row["speedup"] > 0 for row in times.values())
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
        assert 0 < reduction[name]["exposed_s"] <= reduction[name]["reduce_s"] <= reduction[name]["step_s"], reduction
    assert "exposed reduce / step" in capsys.readouterr().out


def test_the_split_backward_benchmark_times_backwards_that_agree() -> None:
    """Every backward it times gives the one backward's parameter gradients (checked before it times them), and a
    backward that does not is refused: a timing of different work would mean nothing."""
    from benchmarks import split_backward

    result = split_backward.run(rounds=2, layers=2, batch=4)
    names = {name for name, _ in split_backward.backwards()}
    assert {split_backward.ONE, split_backward.SPLIT, "one backward, graph kept"} <= names
    assert set(result["ratios"]) == names == set(result["backward_ms"])
    assert all(ratio > 0 for ratio in result["ratios"].values())
    assert (result["vs_anchor"] is None) == (split_backward.ANCHOR not in names) and result["vs_before"] > 0

    def halved(out: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, params: Any) -> None:
        torch.autograd.backward([out], [grad / 2])

    module, x, grad = split_backward.stage(2, 4, width=8)
    with pytest.raises(AssertionError, match="'halved' gives other parameter gradients"):
        split_backward.check_gradients(module, x, grad, [(split_backward.ONE, split_backward.one_backward),
                                                         ("halved", halved)])


def test_the_merged_backwards_benchmark_compares_the_same_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each split schedule runs merged (its name) and as generated (its Schedule, run as it is); both give the same
    loss and gradients before they are timed, and a pair that does not is refused."""
    from benchmarks import merged_backwards, models, schedules

    monkeypatch.setattr(schedules, "workload", lambda name: (models.mlp(8, 8), torch.randn(16, 8),
                                                             torch.randn(16, 8)))
    threads = torch.get_num_threads()
    try:
        rows = merged_backwards.run(rounds=2, chunks=4)
    finally:
        torch.set_num_threads(threads)
    assert [row["schedule"] for row in rows] == [name for name, _ in merged_backwards.SCHEDULES]
    for row in rows:
        assert 0 <= row["whole"] <= row["split"] and row["simulated"] > 0 and row["measured"] > 0
        assert row["quartiles"][0] <= row["quartiles"][1]
    zbv = next(row for row in rows if row["schedule"] == "zbv")
    assert zbv["whole"] > 0
    one, _, _ = schedules.pipeline("mlp", "zbv", 4, 4)
    other, x, y = schedules.pipeline("mlp", "zbv", 4, 4)
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    with pytest.raises(AssertionError, match="differ"):
        merged_backwards.check_same_work(one, other, x, y)
