"""Tensor parallelism inside stages on ('pp', 'tp') and ('dp', 'pp', 'tp') meshes of gloo ranks on 127.0.0.1
(hard timeouts); the plan's checks in one process."""
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.distributed import ranks_tp
from tests.distributed.launch import launch, ok
from torchpipe.distributed.tensor_parallel import verify_plan
from torchpipe.runtime.ties import find_ties

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.mark.slow
def test_stages_split_over_tp_ranks_give_the_plain_models_loss_and_gradients() -> None:
    # Every built-in schedule and 'auto'. The cuts carry a plain tensor, a local shard between a colwise and a
    # rowwise layer, a DTensor sharded on its last dimension, and a replicated DTensor whose gradient comes back
    # partial; the head is tied to the embedding and its logits stay sharded on the vocabulary (loss_parallel).
    # Loss, gradients, clipping (2 and inf) and an SGD step equal the plain module's, on uneven micro-batches;
    # also where selective recomputation keeps DTensor matmul outputs and collectives' results.
    runs = [
        ("1f1b", [3, 6], 2, "never"),
        ("1f1b", [3, 6], 2, "always", "selective"),
        ("zero_bubble", [3, 6], 2, "except_last", "selective"),
        ("gpipe", [5, 4], 3, "always"),
        ("interleaved_1f1b", [2, 2, 2, 3], 2, "never"),
        ("zero_bubble", [3, 6], 2, "except_last"),
        ("zbv", [2, 2, 2, 3], 4, "never"),
        ("dualpipev", [2, 2, 2, 3], 4, "except_last"),
        ("looped_bfs", [2, 2, 2, 3], 2, "never"),
        ("interleaved_zero_bubble", [2, 2, 2, 3], 2, "never"),
        ("auto", [3, 6], 4, "never"),
    ]
    problems = ok(launch("tests.distributed.ranks_tp:transparency", 4, timeout=300, shape=[2, 2],
                         names=["pp", "tp"], runs=runs))
    assert problems == [[]] * 4, problems


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_a_3d_mesh_gives_the_plain_models_loss_and_gradients(mode: str) -> None:
    # (dp, pp, tp) = (2, 2, 2): replicas over 'dp' (DDP-like, or FSDP2 on top of the tp shards), each replica's
    # batch of another size; a split backward (zero bubble) and two stages per rank (interleaved) beside 1F1B.
    runs = [("1f1b", [3, 6], 2, "never"),
            ("zero_bubble", [3, 6], 2, "except_last") if mode == "replicate" else
            ("interleaved_1f1b", [2, 2, 2, 3], 2, "always")]
    problems = ok(launch("tests.distributed.ranks_tp:transparency", 8, timeout=400, shape=[2, 2, 2],
                         names=["dp", "pp", "tp"], runs=runs, mode=mode))
    assert problems == [[]] * 8, problems


@pytest.mark.slow
@pytest.mark.parametrize("shape,names,mode", [([2, 2], ["pp", "tp"], None), ([2, 2, 2], ["dp", "pp", "tp"], "shard")])
def test_a_meta_model_is_made_straight_into_shards_and_loads_the_plain_state_dict(
        shape: List[int], names: List[str], mode: Optional[str]) -> None:
    # A model built on the meta device is split there and materialised as shards: every layer's
    # reset_parameters() initialises only the half of its weight that its tp rank keeps, so no rank holds a
    # stage whole. Every rank seeds alike (as jobs do), yet the two halves of one weight are not copies of each
    # other (which would make their units train as one), and what the plan leaves whole (biases of rowwise
    # layers, norms) is the same on both tp ranks. The plain module's state dict then loads, whole tensors
    # into the shards (and FSDP2's on top), and training gives the plain module's loss and gradients.
    world = 1
    for size in shape:
        world *= size
    results = ok(launch("tests.distributed.ranks_tp:on_meta", world, timeout=300, shape=shape, names=names,
                        mode=mode))
    assert [r["problems"] for r in results] == [[]] * world
    for result in results:
        assert result["seen"], "no layer was initialised"
        for kind, whole, local in result["seen"]:
            assert kind == "DTensor" and torch.Size(local).numel() * 2 == torch.Size(whole).numel(), result["seen"]
    if mode is None:  # ranks 2s and 2s + 1 are stage s's tp ranks
        plain = ranks_tp.model().state_dict()
        for s in range(2):
            first, second = results[2 * s]["made"], results[2 * s + 1]["made"]
            assert set(first) == set(second) and first
            for key in first:
                if first[key].shape == plain[key].shape:  # left whole by the plan: tp rank 0's bytes, broadcast
                    assert torch.equal(first[key], second[key]), key
                else:
                    assert not torch.equal(first[key], second[key]), key


@pytest.mark.slow
def test_compiled_layers_on_a_pp_x_tp_mesh_give_the_plain_models_loss_and_gradients() -> None:
    # Each layer of each stage compiles with its DTensor parameters and DTensor boundaries, except the embedding
    # split on its vocabulary: torch.compile fails on DTensor's masked lookup (BackendCompilerFailed on the
    # first step), so that layer stays eager and a warning names it.
    results = ok(launch("tests.distributed.ranks_tp:compiled", 4, timeout=300))
    assert [r["problems"] for r in results] == [[]] * 4
    assert all(r["graphs"] > 0 for r in results), [r["graphs"] for r in results]
    for rank, result in enumerate(results):  # ranks 0 and 1 hold stage 0, with the embedding (layer 0)
        if rank < 2:
            assert len(result["warnings"]) == 1 and "layer(s) 0 uncompiled" in result["warnings"][0], result
        else:
            assert result["warnings"] == [], result


@pytest.mark.slow
def test_a_compiled_hugging_face_model_on_a_pp_x_tp_mesh_gives_the_plain_models_loss_and_gradients() -> None:
    # Traced layers compile their graphs on DTensors; with dimension 0 dynamic (a traced layer's default) DTensor's
    # sharding propagation failed on the attention's views of a symbolic batch size, so a split stage compiles
    # with static shapes unless compile= says otherwise.
    pytest.importorskip("transformers")
    problems = ok(launch("tests.distributed.ranks_tp:llama_transparency", 4, timeout=400, shape=[2, 2],
                         names=["pp", "tp"], runs=[("1f1b", 2, "never")], compile={"backend": "aot_eager"}))
    assert problems == [[]] * 4, problems


@pytest.mark.slow
def test_a_hugging_face_model_trains_with_its_own_plan_on_pp_x_tp() -> None:
    # A tiny Llama traced by as_sequential, split by model._tp_plan as it is (the original model's names, its
    # style names), its embedding tied to its head: every schedule kind, checkpointing, two steps of other
    # sequence lengths.
    pytest.importorskip("transformers")
    runs = [("1f1b", 2, "never"), ("gpipe", 3, "always"), ("zero_bubble", 2, "except_last"),
            ("interleaved_1f1b", 2, "never")]
    problems = ok(launch("tests.distributed.ranks_tp:llama_transparency", 4, timeout=400, shape=[2, 2],
                         names=["pp", "tp"], runs=runs))
    assert problems == [[]] * 4, problems


@pytest.mark.slow
def test_a_hugging_face_model_trains_on_a_3d_mesh_with_fsdp() -> None:
    pytest.importorskip("transformers")
    problems = ok(launch("tests.distributed.ranks_tp:llama_transparency", 8, timeout=400, shape=[2, 2, 2],
                         names=["dp", "pp", "tp"], runs=[("1f1b", 2, "never")], mode="shard"))
    assert problems == [[]] * 8, problems


@pytest.mark.slow
def test_gradients_accumulate_over_steps_on_a_pp_x_tp_mesh() -> None:
    assert ok(launch("tests.distributed.ranks_tp:accumulation", 4, timeout=200)) == [[]] * 4


@pytest.mark.slow
def test_mesh_dimensions_may_come_in_any_order() -> None:
    problems = ok(launch("tests.distributed.ranks_tp:transparency", 4, timeout=300, shape=[2, 2],
                         names=["tp", "pp"], runs=[("1f1b", [3, 6], 2, "never")]))
    assert problems == [[]] * 4, problems


@pytest.mark.slow
def test_bad_tensor_parallel_arguments_are_a_value_error_on_every_rank() -> None:
    errors = ok(launch("tests.distributed.ranks_tp:bad_arguments", 4, timeout=200))
    assert all(e == errors[0] for e in errors), "every rank raises the same"
    expected = {
        "no plan": "the mesh has a 'tp' dimension but no tensor_parallel= plan",
        "no tp": "tensor_parallel= needs a mesh with a 'tp' dimension",
        "no mesh": "tensor_parallel= splits each stage over a mesh's 'tp' dimension",
        "unknown name": "tensor_parallel['0.q_proj'] names no module of the model",
        "unknown style": "tensor_parallel['0'] is 'colwise_rep'",
        "not divisible": "ColwiseParallel splits '0' (Linear) along its out_features of 5, which tp = 2 does not",
        "tie split apart": "the plan splits the holders of one tied parameter differently",
        "shard without dp": "data_parallel='shard' shards over a mesh's 'dp' dimension",
    }
    for case, text in expected.items():
        assert errors[0][case].startswith("ValueError: ") and text in errors[0][case], (case, errors[0][case])


@pytest.mark.slow
def test_tp_ranks_of_the_first_stage_that_split_other_batches_fail_the_step_and_the_next_one_works() -> None:
    results = ok(launch("tests.distributed.ranks_tp:uneven_lanes", 4, timeout=200))
    assert results[1]["first"].startswith("ValueError: rank 0 of tp rank 1, a first stage's, split its input")
    assert all(r["first"].startswith("PipelineError: ") for k, r in enumerate(results) if k != 1), results
    assert len({r["second"] for r in results}) == 1, results


LAYOUTS = {"pp2-tp2": 4, "dp2-pp2-tp2-shard": 8, "pp2-tp1": 2, "dp2-pp2-replicate": 4, "local-3": 1}


@pytest.mark.slow
@pytest.mark.parametrize("saved, loaded", [
    ("pp2-tp2", "dp2-pp2-replicate"), ("dp2-pp2-tp2-shard", "pp2-tp1"), ("local-3", "pp2-tp2"),
    ("pp2-tp2", "local-3"),
])
def test_a_dcp_checkpoint_moves_between_tensor_parallel_layouts(tmp_path: Path, saved: str, loaded: str) -> None:
    # Model and Adam state through torch.distributed.checkpoint, keyed by the plain module's names, saved under
    # one layout and loaded under another (tp = 1 and one process included): every value equals the saved one.
    path = str(tmp_path / "checkpoint")
    expected: Dict[str, Tensor] = {}
    for values in ok(launch("tests.distributed.ranks_tp:dcp_save", LAYOUTS[saved], timeout=300, path=path,
                            layout=saved)):
        expected.update(values)
    checked = 0
    for rank, values in enumerate(ok(launch("tests.distributed.ranks_tp:dcp_load", LAYOUTS[loaded], timeout=300,
                                            path=path, layout=loaded))):
        for key, value in values.items():
            assert key in expected, f"rank {rank} holds {key}, which the saved layout had not"
            # The saved bytes read back, not recomputed: exact on any CPU.
            assert torch.equal(value, expected[key]), f"rank {rank}: {key} differs"
            checked += 1
    assert checked >= len(expected)


@pytest.mark.slow
def test_a_checkpointer_on_a_pp_x_tp_mesh_restores_what_it_saved(tmp_path: Path) -> None:
    results = ok(launch("tests.distributed.ranks_tp:checkpointer", 4, timeout=300, path=str(tmp_path / "ckpt")))
    for rank, result in enumerate(results):
        assert result["start"] == 2, result["start"]
        assert result["saved"].keys() == result["restored"].keys()
        for key, value in result["saved"].items():
            assert torch.equal(value, result["restored"][key]), f"rank {rank}: {key}"  # read back: exact


@pytest.mark.slow
def test_full_state_dict_on_a_3d_mesh_is_whole_on_global_rank_0() -> None:
    results = ok(launch("tests.distributed.ranks_tp:full_state", 8, timeout=300, layout="dp2-pp2-tp2-shard"))
    plain = ranks_tp.model()
    assert results[0]["keys"] == list(plain.state_dict()), "the plain module's keys, in its order"
    assert all(r["keys"] == [] for r in results[1:])
    held: Dict[str, Tensor] = {}
    for r in results:
        held.update(r["local"])
    for key, value in results[0]["values"].items():
        assert value.shape == plain.state_dict()[key].shape and not hasattr(value, "placements"), key
        assert torch.equal(value, held[key]), key  # the same shards gathered, not recomputed: exact


# --- the plan, in one process ---------------------------------------------------------------------------------


def test_a_plan_names_the_plain_modules_modules_with_patterns() -> None:
    module = ranks_tp.model()
    styles = verify_plan(module, ranks_tp.plan(), 2, find_ties(module, [3, 6]))
    assert styles is not None and set(styles) == set(ranks_tp.plan())
    assert verify_plan(module, lambda stage, mesh: stage, 2) is None, "a function is applied as it is"


@pytest.mark.parametrize("plan, message", [
    ({}, "tensor_parallel is an empty plan"),
    ({"9": "colwise"}, "tensor_parallel['9'] names no module of the model"),
    ({"*.nothing": "colwise"}, "tensor_parallel['*.nothing'] names no module"),
    ({"1.q": "local_colwise"}, "tensor_parallel['1.q'] is 'local_colwise'"),
    ({"6.up": "rowwise"}, None),
])
def test_a_bad_plan_is_a_value_error_that_names_the_entry(plan: Dict[str, str], message: str) -> None:
    module = ranks_tp.model()
    if message is None:
        assert verify_plan(module, plan, 2) is not None
        return
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("*", r"\*")):
        verify_plan(module, plan, 2)


def test_a_size_that_tp_does_not_divide_names_the_layer_its_size_and_tp() -> None:
    module = nn.Sequential(nn.Linear(4, 6), nn.Embedding(10, 4))
    with pytest.raises(ValueError, match=r"RowwiseParallel splits '0' \(Linear\) along its in_features of 4, which "
                                         r"tp = 3 does not divide"):
        verify_plan(module, {"0": "rowwise"}, 3)
    with pytest.raises(ValueError, match=r"'1' \(Embedding\) along its num_embeddings of 10, which tp = 4"):
        verify_plan(module, {"1": "embedding_rowwise"}, 4)
    assert verify_plan(module, {"0": "colwise", "1": "embedding_rowwise"}, 2) is not None


def test_a_plan_that_is_neither_a_dict_nor_a_function_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="tensor_parallel must be a dict"):
        verify_plan(ranks_tp.model(), ["colwise"], 2)


def test_a_traced_models_tied_weight_split_two_ways_is_a_value_error() -> None:
    # Llama's embedding and head are one weight: 'embedding_rowwise' and 'colwise_gather_output' both split its
    # vocabulary; a head split 'rowwise' would split the same weight along its width, whose shards' gradients
    # could not be summed across the two stages.
    pytest.importorskip("transformers")
    import torchpipe

    model = ranks_tp.llama()
    seq = torchpipe.as_sequential(model, input_ids=torch.randint(1, 96, (2, 8)), output="logits", use_cache=False)
    ties = find_ties(seq, [11, len(seq) - 11])
    assert verify_plan(seq, model._tp_plan, 2, ties) is not None
    with pytest.raises(ValueError, match=r"0\.model\.embed_tokens\.weight split along dimension 0, "
                                         r"20\.lm_head\.weight split along dimension 1"):
        verify_plan(seq, {**model._tp_plan, "lm_head": "rowwise"}, 2, ties)
    with pytest.raises(ValueError, match=r"tensor_parallel\['model.norm'\] names 'model.norm', which holds no "
                                         "matrix"):
        verify_plan(seq, {**model._tp_plan, "model.norm": "colwise"}, 2, ties)
