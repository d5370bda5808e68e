"""as_sequential on Hugging Face language models (tiny configs, nothing downloaded), traced by torch.export.

torch.fx cannot trace them (their mask and position code branches on shapes), so these are the models the
export tracer is for: GPT-2, Llama, BERT and Qwen2, in float64 so that "equal" means equal. Each model is
converted once per module (export takes seconds); a test that changes a model or its Sequential works on a
deep copy of the pair, which keeps them sharing their parameters.
"""
import copy
import pickle
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchpipe
from torchpipe.rng import streams
from torchpipe.sequential import TracedLayer, UntraceableError
from torchpipe.skip import verify_skippables
from torchpipe_balancing import balance_by_size, balance_by_time
from torchpipe_balancing.profile import profile_sizes

transformers = pytest.importorskip("transformers")

VOCAB = 120
#: A vocabulary large enough that the output projection is the heaviest layer by size.
LARGE_VOCAB = 1000
#: A vocabulary whose output projection takes longer than every other layer together.
HUGE_VOCAB = 16000


def gpt2(tie: bool = False, dropout: float = 0.0, vocab: int = VOCAB) -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=vocab, n_positions=64, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=tie, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=VOCAB,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return transformers.BertModel(config)


def qwen2() -> nn.Module:
    config = transformers.Qwen2Config(
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        tie_word_embeddings=False,
    )
    return transformers.Qwen2ForCausalLM(config)


#: name -> (builder, what output= takes, extra keyword arguments of the call)
MODELS: Dict[str, Tuple[Callable[[], nn.Module], str, Dict[str, Any]]] = {
    "gpt2": (gpt2, "logits", {"use_cache": False}),
    "llama": (llama, "logits", {"use_cache": False}),
    "bert": (bert, "last_hidden_state", {}),
    "qwen2": (qwen2, "logits", {"use_cache": False}),
}


def batch(size: int, length: int, vocab: int = VOCAB) -> Tuple[Tensor, Tensor]:
    """Token ids and an attention mask whose first sequence ends in padding."""
    ids = torch.randint(1, vocab, (size, length))
    mask = torch.ones(size, length, dtype=torch.long)
    mask[0, max(1, length - 2):] = 0
    return ids, mask


def plain(model: nn.Module, name: str, ids: Tensor, mask: Tensor) -> Tensor:
    _, output, extra = MODELS[name]
    return getattr(model(input_ids=ids, attention_mask=mask, **extra), output)  # type: ignore[no-any-return]


Pair = Tuple[nn.Module, nn.Sequential]

_converted: Dict[str, Pair] = {}


def converted(name: str) -> Pair:
    """The model and its Sequential, converted once per module; deep-copy the pair before changing it."""
    if name not in _converted:
        torch.manual_seed(0)
        if name in ("gpt2-tied", "gpt2-huge-head"):
            vocab = LARGE_VOCAB if name == "gpt2-tied" else HUGE_VOCAB
            model = gpt2(tie=True, vocab=vocab).double()
            ids, mask = batch(2, 8, vocab)
            extra, output = MODELS["gpt2"][2], "logits"
        elif name == "gpt2-dropout":
            model = gpt2(dropout=0.1).double()
            ids, mask = batch(2, 8)
            extra, output = MODELS["gpt2"][2], "logits"
        else:
            build, output, extra = MODELS[name]
            model = build().double()
            ids, mask = batch(2, 8)
        seq = torchpipe.as_sequential(model, input_ids=ids, attention_mask=mask, output=output, **extra)
        _converted[name] = (model, seq)
    return _converted[name]


@pytest.fixture(scope="module", autouse=True)
def forget_conversions() -> Any:
    yield
    _converted.clear()


def gradients(parameters: List[nn.Parameter]) -> List[Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in parameters]


def assert_close(expected: List[Tensor], actual: List[Tensor]) -> None:
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        assert torch.allclose(e, a), (e - a).abs().max()


def shifted_cross_entropy(logits: Tensor, ids: Tensor) -> Tensor:
    """The causal language-model loss: each position predicts the next token."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


# --- the Sequential computes what the model computes ------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_outputs_and_every_gradient_equal_the_models_for_several_shapes(name: str) -> None:
    model, seq = converted(name)
    assert all(isinstance(layer, TracedLayer) for layer in seq)
    assert {id(p) for p in seq.parameters()} == {id(p) for p in model.parameters()}
    assert {key.split(".", 1)[1] for key in seq.state_dict()} == set(model.state_dict())
    verify_skippables(seq)
    parameters = list(model.parameters())
    for size, length in [(2, 8), (3, 5), (1, 11), (4, 1)]:  # the example, and other batches and lengths
        ids, mask = batch(size, length)
        model.zero_grad()
        expected = plain(model, name, ids, mask)
        expected.square().sum().backward()
        expected_grads = gradients(parameters)
        model.zero_grad()
        actual = seq((ids, mask))
        actual.square().sum().backward()
        assert actual.shape == expected.shape and torch.allclose(actual, expected)
        assert_close(expected_grads, gradients(parameters))
    model.zero_grad()


@pytest.mark.parametrize("name, block", [("gpt2", "transformer.h"), ("llama", "model.layers"),
                                         ("bert", "encoder.layer"), ("qwen2", "model.layers")])
def test_layers_are_named_after_the_models_submodules_several_per_block(name: str, block: str) -> None:
    model, seq = converted(name)
    names = [layer.name for layer in seq]
    blocks = len(getattr(model.config, "num_hidden_layers", getattr(model.config, "n_layer", 0)) * [0])
    for i in range(blocks):
        inside = [n for n in names if n.startswith(f"{block}.{i}.")]
        assert len(inside) >= 2, names
    # A block's layers are consecutive, so a balancer can cut between blocks.
    starts = [names.index(next(n for n in names if n.startswith(f"{block}.{i}."))) for i in range(blocks)]
    assert starts == sorted(starts)
    for layer in seq:
        assert "device(type=" not in layer.code  # each layer runs on its input's device


def test_training_the_sequential_trains_the_model() -> None:
    model, seq = copy.deepcopy(converted("llama"))
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(seq.parameters(), lr=0.1)
    ids, mask = batch(2, 6)
    shifted_cross_entropy(seq((ids, mask)), ids).backward()
    optimizer.step()
    after = model.state_dict()
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    assert not torch.equal(after["model.layers.1.mlp.up_proj.weight"], before["model.layers.1.mlp.up_proj.weight"])


# --- tied weights ---------------------------------------------------------------------------------------


def test_a_tied_embedding_and_head_hold_the_same_parameter_in_their_own_layers() -> None:
    model, seq = converted("gpt2-tied")
    tied = model.lm_head.weight
    assert tied is model.transformer.wte.weight
    assert len(seq) > 10  # not merged into one layer because the parameter is used at both ends
    assert seq[0].name == "transformer.wte" and seq[-1].name == "lm_head"
    assert seq[0].get_parameter("transformer.wte.weight") is tied
    assert seq[-1].get_parameter("lm_head.weight") is tied
    holders = [k for k, layer in enumerate(seq) if any(p is tied for p in layer.parameters())]
    assert holders == [0, len(seq) - 1]
    assert not any(b is c for b in seq[0].buffers() for c in seq[-1].buffers())  # no buffer is shared


def test_a_tied_model_computes_the_models_outputs_and_gradients() -> None:
    model, seq = converted("gpt2-tied")
    parameters = list(model.parameters())
    for size, length in [(2, 8), (3, 13)]:
        ids, mask = batch(size, length, LARGE_VOCAB)
        model.zero_grad()
        expected = plain(model, "gpt2", ids, mask)
        shifted_cross_entropy(expected, ids).backward()
        expected_grads = gradients(parameters)
        model.zero_grad()
        actual = seq((ids, mask))
        shifted_cross_entropy(actual, ids).backward()
        assert torch.allclose(actual, expected)
        assert_close(expected_grads, gradients(parameters))  # the tied weight's: the sum over both uses
    model.zero_grad()


def test_a_tied_models_state_dict_has_the_models_keys_behind_the_layer_index() -> None:
    model, seq = converted("gpt2-tied")
    keys = {key.split(".", 1)[1] for key in seq.state_dict()}
    assert keys == set(model.state_dict())
    assert "0.transformer.wte.weight" in seq.state_dict() and f"{len(seq) - 1}.lm_head.weight" in seq.state_dict()


def test_gpipe_runs_a_tied_model_as_the_model() -> None:
    # Ties (issue 17): the embedding's weight is the head's, in partitions 0 and 1; gradients are the model's.
    model, seq = converted("gpt2-tied")
    parameters = list(model.parameters())
    ids, mask = batch(5, 7, LARGE_VOCAB)
    model.zero_grad()
    expected = plain(model, "gpt2", ids, mask)
    shifted_cross_entropy(expected, ids).backward()
    expected_grads = gradients(parameters)
    model.zero_grad()
    try:
        pipe = torchpipe.GPipe(seq, balance(len(seq), 2), devices=["cpu", "cpu"], chunks=3)
        actual = pipe((ids, mask))
        shifted_cross_entropy(actual, ids).backward()
        assert torch.allclose(actual, expected)
        assert_close(expected_grads, gradients(parameters))
    finally:
        model.zero_grad()


def test_pipeline_trains_a_tied_model_as_the_model() -> None:
    model, seq = converted("gpt2-tied")
    parameters = list(model.parameters())
    ids, mask = batch(6, 9, LARGE_VOCAB)
    model.zero_grad()
    expected = shifted_cross_entropy(plain(model, "gpt2", ids, mask), ids)
    expected.backward()
    expected_grads = gradients(parameters)
    model.zero_grad()
    try:
        pipe = torchpipe.Pipeline(seq, balance(len(seq), 3), chunks=3, loss_fn=shifted_cross_entropy,
                                  devices=["cpu"] * 3)
        loss = pipe.step((ids, mask), ids)
        assert torch.allclose(loss, expected.detach())
        assert_close(expected_grads, gradients(parameters))
    finally:
        model.zero_grad()


# --- GPipe and Pipeline ---------------------------------------------------------------------------------


def balance(layers: int, partitions: int) -> List[int]:
    base, extra = divmod(layers, partitions)
    return [base + (1 if i < extra else 0) for i in range(partitions)]


@pytest.mark.parametrize("partitions", [2, 3])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_gpipe_equals_the_model_with_uneven_micro_batches(name: str, partitions: int) -> None:
    model, seq = converted(name)
    parameters = list(model.parameters())
    ids, mask = batch(5, 7)  # chunks=3: micro-batches of 2, 2 and 1
    model.zero_grad()
    expected = plain(model, name, ids, mask)
    expected.square().mean().backward()
    expected_grads = gradients(parameters)
    model.zero_grad()
    pipe = torchpipe.GPipe(seq, balance(len(seq), partitions), devices=["cpu"] * partitions, chunks=3,
                           checkpoint="except_last")
    actual = pipe((ids, mask))
    actual.square().mean().backward()
    assert torch.allclose(actual, expected)
    assert_close(expected_grads, gradients(parameters))
    model.zero_grad()


@pytest.mark.parametrize("name, schedule", [("gpt2", "1f1b"), ("llama", "zero_bubble"), ("qwen2", "gpipe")])
def test_pipeline_with_a_language_model_loss_equals_the_model(name: str, schedule: str) -> None:
    model, seq = converted(name)
    parameters = list(model.parameters())
    pipe = torchpipe.Pipeline(seq, balance(len(seq), 3), chunks=4, schedule=schedule, loss_fn=shifted_cross_entropy,
                              checkpoint="except_last", devices=["cpu"] * 3)
    # Batch size and sequence length change from step to step; micro-batches are uneven.
    for size, length in [(6, 9), (5, 4), (4, 12)]:
        ids, mask = batch(size, length)
        model.zero_grad()
        expected = shifted_cross_entropy(plain(model, name, ids, mask), ids)
        expected.backward()
        expected_grads = gradients(parameters)
        model.zero_grad()
        loss = pipe.step((ids, mask), ids)
        assert torch.allclose(loss, expected.detach())
        assert_close(expected_grads, gradients(parameters))
    model.zero_grad()


# --- shapes ---------------------------------------------------------------------------------------------


def test_inputs_outside_the_traced_domain_are_refused_not_computed() -> None:
    model, seq = converted("bert")  # its position embedding has 64 entries: export bounds the length
    ids, mask = batch(2, 64)
    assert torch.allclose(seq((ids, mask)), plain(model, "bert", ids, mask))
    with pytest.raises(ValueError, match=r"input_ids.shape\[1\] is 65 but the graph holds for 0 to 64"):
        seq(batch(2, 65))
    with pytest.raises(ValueError, match=r"attention_mask.shape\[1\] is 5 but must equal input_ids.shape\[1\]"):
        seq((batch(2, 4)[0], batch(2, 5)[1]))
    ids, mask = batch(2, 8)
    with pytest.raises(ValueError, match="input_ids is torch.int32, traced with torch.int64"):
        seq((ids.int(), mask))


def test_a_size_the_model_fixes_is_refused_when_it_changes() -> None:
    class FixedLength(nn.Module):
        """Flattens the sequence into the features: the length must stay the example's."""

        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(10, 4)
            self.head = nn.Linear(4 * 6, 3)

        def forward(self, ids: Tensor) -> Tensor:
            x = self.embedding(ids)
            if x.shape[1] != 6:  # fx cannot trace a branch on a shape; export keeps the length fixed
                raise ValueError("six tokens")
            return self.head(x.flatten(1))

    model = FixedLength()
    seq = torchpipe.as_sequential(model, torch.randint(0, 10, (2, 6)))
    for size in (1, 2, 5):  # any batch size
        ids = torch.randint(0, 10, (size, 6))
        assert torch.allclose(seq(ids), model(ids))
    with pytest.raises(ValueError, match=r"ids.shape\[1\] is 7 but the graph holds for 6 only"):
        seq(torch.randint(0, 10, (2, 7)))


# --- modes and random numbers ---------------------------------------------------------------------------


def test_eval_and_train_run_the_graph_of_their_mode() -> None:
    model, seq = copy.deepcopy(converted("gpt2-dropout"))
    ids, mask = batch(3, 6)
    seq.eval()
    model.eval()
    assert torch.allclose(seq((ids, mask)), plain(model, "gpt2", ids, mask))
    assert "torch.dropout" not in "".join(layer.code for layer in seq) or "False" in seq[1].code
    seq.train()
    assert "torch.dropout(" in "".join(layer.code for layer in seq)
    assert "aten.dropout" not in "".join(layer.code for layer in seq)  # see [Note: export]
    assert not torch.allclose(seq((ids, mask)), plain(model, "gpt2", ids, mask))  # dropout is on
    assert any(layer.torchpipe_draws_random for layer in seq)
    # The dropouts (and the attention's) draw from the generators of torchpipe's random streams, not the global one.
    outputs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        with streams(5):
            outputs.append(seq((ids, mask)))
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dropout_draws_from_torchpipes_streams_and_recomputation_replays_it(schedule: str) -> None:
    model, seq = converted("gpt2-dropout")
    parameters = list(model.parameters())
    seq.train()
    ids, mask = batch(4, 6)
    results = []
    for checkpoint in ("never", "always"):
        model.zero_grad()
        pipe = torchpipe.Pipeline(seq, balance(len(seq), 2), chunks=2, schedule=schedule, checkpoint=checkpoint,
                                  loss_fn=shifted_cross_entropy, devices=["cpu", "cpu"])
        torch.manual_seed(7)
        loss = pipe.step((ids, mask), ids)
        results.append((loss, gradients(parameters)))
    (loss, grads), (recomputed_loss, recomputed_grads) = results
    assert torch.equal(loss, recomputed_loss)
    assert_close(grads, recomputed_grads)
    model.zero_grad()
    with torch.no_grad():
        eval_loss = shifted_cross_entropy(seq.eval()((ids, mask)), ids)
    seq.train()
    assert not torch.allclose(loss, eval_loss)  # the masks were drawn


def test_a_mode_whose_graph_cuts_otherwise_is_refused_with_the_way_out() -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.noise = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            x = self.a(x)
            if self.training:  # an extra layer in training only: the two modes' layers differ
                x = x + self.noise(x)
            return self.b(x)

    model = Noisy()
    x = torch.randn(3, 4)
    seq = torchpipe.as_sequential(model, x, tracer="export")
    assert torch.allclose(seq(x), model(x))
    seq.eval()
    with pytest.raises(RuntimeError, match=r"has none for eval mode.*as_sequential\(model.eval\(\), \.\.\.\)"):
        seq(x)
    evaluating = torchpipe.as_sequential(model.eval(), x, tracer="export")
    assert torch.allclose(evaluating(x), model(x))
    assert {id(p) for p in evaluating.parameters()} <= {id(p) for p in model.parameters()}


def test_changing_the_dtype_after_tracing_is_refused() -> None:
    model, seq = copy.deepcopy(converted("llama"))
    seq.float()
    with pytest.raises(RuntimeError, match="convert the model first, then call as_sequential"):
        seq(batch(2, 4))


# --- arguments, outputs, tracers ------------------------------------------------------------------------


class Scorer(nn.Module):
    """Returns a dict; takes optional tensors and a number."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor, mask: Any = None, bias: Any = None, scale: float = 1.0) -> Dict[str, Tensor]:
        hidden = torch.relu(self.a(x))
        out = self.b(hidden)
        if mask is not None:
            out = out * mask
        if bias is not None:
            out = out + bias
        return {"out": out * scale, "hidden": hidden}


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_keyword_arguments_are_inputs_after_the_positional_ones_in_the_order_given(tracer: str) -> None:
    model = Scorer()
    x, bias, mask = torch.randn(3, 4), torch.randn(3, 4), torch.rand(3, 4)
    seq = torchpipe.as_sequential(model, x, bias=bias, mask=mask, scale=2.0, output="out", tracer=tracer)
    assert seq[0]._received == ("x", "bias", "mask")
    x, bias, mask = torch.randn(5, 4), torch.randn(5, 4), torch.rand(5, 4)
    assert torch.allclose(seq((x, bias, mask)), model(x, mask=mask, bias=bias, scale=2.0)["out"])


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_output_takes_a_key_or_a_function(tracer: str) -> None:
    model = Scorer()
    x = torch.randn(3, 4)
    by_key = torchpipe.as_sequential(model, x, output="hidden", tracer=tracer)
    assert torch.allclose(by_key(x), model(x)["hidden"])
    both = torchpipe.as_sequential(model, x, output=lambda out: (out["out"], out["hidden"]), tracer=tracer)
    out, hidden = both(x)
    assert torch.allclose(out, model(x)["out"]) and torch.allclose(hidden, model(x)["hidden"])
    with pytest.raises(TypeError, match="returns a dict; pass output= with a key of it"):
        torchpipe.as_sequential(model, x, tracer=tracer)
    with pytest.raises(TypeError, match="output takes a key"):
        torchpipe.as_sequential(model, x, output=3, tracer=tracer)  # type: ignore[arg-type]


def test_a_model_output_without_output_is_a_type_error_saying_to_pass_it() -> None:
    with pytest.raises(TypeError, match=r"returns a CausalLMOutputWithCrossAttentions; pass output="):
        torchpipe.as_sequential(gpt2(), input_ids=torch.randint(0, VOCAB, (2, 4)), use_cache=False)


def test_tracer_forces_one_tracer() -> None:
    with pytest.raises(ValueError, match="tracer takes 'fx', 'export' or None"):
        torchpipe.as_sequential(Scorer(), torch.randn(2, 4), output="out", tracer="jit")
    with pytest.raises(UntraceableError, match="with torch.fx") as error:
        torchpipe.as_sequential(gpt2(), input_ids=torch.randint(0, VOCAB, (2, 4)), output="logits", tracer="fx")
    assert "torch.export" not in str(error.value)
    model = Scorer()
    x = torch.randn(3, 4)
    exported = torchpipe.as_sequential(model, x, output="out", tracer="export")
    assert "torch.ops.aten" in "".join(layer.code for layer in exported) or "_op_aten" in exported[0].code
    assert torch.allclose(exported(x), model(x)["out"])


def test_a_model_neither_tracer_can_trace_is_an_error_naming_both() -> None:
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            if x.sum() > 0:  # on values: neither tracer can follow it
                return self.linear(x)
            return -x

    with pytest.raises(UntraceableError) as error:
        torchpipe.as_sequential(DataDependent(), torch.randn(2, 4))
    message = str(error.value)
    assert "with torch.fx" in message and "if x.sum() > 0:" in message
    assert "torch.export cannot trace it either" in message and "torch.cond" in message


class Blocks(nn.Module):
    """Two blocks of two linears, a norm at the end: cut per linear, per block, or with a block kept whole."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)) for _ in range(2))
        self.norm = nn.LayerNorm(4)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x)


def test_split_points_and_leaf_modules_cut_an_exported_graph() -> None:
    model = Blocks()
    x = torch.randn(3, 4)
    fine = torchpipe.as_sequential(model, x, tracer="export")
    assert [layer.name for layer in fine] == ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2", "norm"]
    coarse = torchpipe.as_sequential(model, x, tracer="export", split_points=["blocks.0", "blocks.1", "norm"])
    assert [layer.name for layer in coarse] == ["blocks.0", "blocks.1", "norm"]
    whole = torchpipe.as_sequential(model, x, tracer="export", leaf_modules=["blocks.1"])
    assert [layer.name for layer in whole] == ["blocks.0.0", "blocks.0.2", "blocks.1", "norm"]
    for seq in (fine, coarse, whole):
        assert torch.allclose(seq(x), model(x))


# --- copies ---------------------------------------------------------------------------------------------


def test_deepcopy_and_pickle_of_an_exported_sequential() -> None:
    model, seq = converted("qwen2")
    ids, mask = batch(2, 5)
    expected = seq((ids, mask))
    copied = copy.deepcopy(seq)
    assert torch.allclose(copied((ids, mask)), expected)
    assert not any(p is q for p, q in zip(seq.parameters(), copied.parameters()))
    loaded = pickle.loads(pickle.dumps(seq))
    assert torch.allclose(loaded((ids, mask)), expected)
    with pytest.raises(ValueError, match="traced with torch.int64"):
        loaded((ids.int(), mask))  # the guard came along


# --- balancing ------------------------------------------------------------------------------------------


def test_balance_by_size_counts_a_tied_parameter_once_and_sees_the_heavy_ends() -> None:
    model, seq = converted("gpt2-tied")
    sizes = profile_sizes(seq, batch(4, 16, LARGE_VOCAB), chunks=1, device=torch.device("cpu"))
    unique = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(size.parameter_bytes for size in sizes) == unique
    embedding = model.transformer.wte.weight
    assert sizes[0].parameter_bytes >= embedding.numel() * embedding.element_size()
    assert sizes[-1].parameter_bytes == 0  # counted in the embedding's layer
    assert sizes[0].cost(2.0) == max(size.cost(2.0) for size in sizes)
    split = balance_by_size(2, seq, batch(4, 16, LARGE_VOCAB), param_scale=2.0)
    assert split[0] < split[1]  # the embedding's partition takes fewer layers


def test_balance_by_size_sees_an_untied_head_and_embedding() -> None:
    model, seq = converted("llama")
    sizes = profile_sizes(seq, batch(4, 16), chunks=1, device=torch.device("cpu"))
    by_name = {layer.name: size for layer, size in zip(seq, sizes)}
    head = model.lm_head.weight
    assert by_name["lm_head"].parameter_bytes == head.numel() * head.element_size()
    assert by_name["model.embed_tokens"].parameter_bytes >= head.numel() * head.element_size()
    assert by_name["lm_head"].parameter_bytes > 2 * by_name["model.layers.0.self_attn.q_proj"].parameter_bytes


def test_balance_by_time_sees_a_large_vocabulary_head(monkeypatch: pytest.MonkeyPatch) -> None:
    # A head that outweighs every other layer together gets a partition of its own. Timed for real, the costs
    # wobble with the machine's load (on a loaded 2-core machine the split came out [6, 5, 5]), so each layer's
    # cost here is what it computes (its forward's floating-point operations, counted), which no load changes:
    # the test checks what balance_by_time makes of the traced layers' costs, not how busy the machine is.
    from torch.utils.flop_counter import FlopCounterMode

    from torchpipe_balancing import profile

    def counted_pass(layers: List[nn.Module], sample: Any, device: torch.device) -> List[float]:
        costs, batch, skips = [], sample, profile._SkipTracker()
        for layer in layers:
            with FlopCounterMode(display=False) as counter:
                output, _ = skips.run(layer, profile._fresh_input(batch))
            costs.append(float(counter.get_total_flops()) + 1.0)
            batch = profile._detached(output)
        return costs

    monkeypatch.setattr(profile, "_one_pass", counted_pass)
    model, seq = converted("gpt2-huge-head")
    split = balance_by_time(3, seq, batch(4, 16, HUGE_VOCAB), timeout=0.1)
    assert len(split) == 3 and sum(split) == len(seq)
    assert split[-1] == 1, split  # the output projection alone
