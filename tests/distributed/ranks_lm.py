"""What each rank runs in the tests of Hugging Face language models across ranks (issue 17)."""
import copy
from typing import List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import torchpipe
from torchpipe import Pipeline


def _model(name: str) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=97, bos_token_id=0, eos_token_id=0, tie_word_embeddings=name.endswith("tied"))
    if name.startswith("gpt2"):
        config = transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, n_positions=32, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, **common)
        return transformers.GPT2LMHeadModel(config).double()
    config = transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=32, pad_token_id=0, **common,
    )
    return transformers.LlamaForCausalLM(config).double()


def shifted_cross_entropy(logits: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def balance_for(layers: int, stages: int) -> List[int]:
    return [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]


def language_model(rank: int, world: int, name: str) -> List[str]:
    """A traced transformers model on ``world`` ranks, every schedule: loss, every gradient (the tied weight's
    too) and, after several AdamW steps with sequence lengths changing, every parameter equal the model's."""
    problems: List[str] = []
    original = _model(name)
    traced = torchpipe.as_sequential(original, input_ids=torch.randint(1, 97, (2, 8)), output="logits",
                                     use_cache=False)
    for schedule in ["gpipe", "1f1b", "zero_bubble", "interleaved_1f1b"]:
        stages = 2 * world if schedule == "interleaved_1f1b" else world
        model, seq = copy.deepcopy((original, traced))  # a fresh pair, still sharing its parameters
        reference = copy.deepcopy(original)
        pipe = Pipeline(seq, balance_for(len(seq), stages), chunks=3, schedule=schedule,
                        loss_fn=shifted_cross_entropy, group=dist.group.WORLD)
        first, last = pipe.schedule.stage_workers[0], pipe.schedule.stage_workers[-1]
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.02)
        expected_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.02)
        names = {id(p): n for n, p in model.named_parameters()}
        held = {names[id(p)]: p for p in pipe.parameters() if id(p) in names}
        copies = [p for p in pipe.parameters() if id(p) not in names]  # a tied weight's copy on another rank
        for step, length in enumerate([9, 5, 12]):
            generator = torch.Generator().manual_seed(step)
            ids = torch.randint(1, 97, (5, length), generator=generator)
            loss = pipe.step(ids if rank == first else None, ids if rank == last else None)
            expected = shifted_cross_entropy(reference(input_ids=ids, use_cache=False).logits, ids)
            expected.backward()
            case = f"{name} {schedule} step {step}"
            if not torch.allclose(loss, expected.detach()):
                problems.append(f"{case}: loss {loss.item()} != {expected.item()}")
            for key, want in reference.named_parameters():
                got = held.get(key)
                if got is not None and not torch.allclose(got.grad, want.grad, atol=1e-10):
                    problems.append(f"{case}: gradient of {key} differs")
            for copy_ in copies:  # the tie's copy: the embedding's gradient (the sum over both uses)
                want = reference.get_input_embeddings().weight.grad
                if not torch.allclose(copy_.grad, want, atol=1e-10):
                    problems.append(f"{case}: gradient of the tied copy differs")
            optimizer.step()
            expected_optimizer.step()
            optimizer.zero_grad()
            expected_optimizer.zero_grad()
        for key, want in reference.named_parameters():
            got = held.get(key)
            if got is not None and not torch.allclose(got, want, atol=1e-10):
                problems.append(f"{name} {schedule}: after 3 steps {key} differs")
        for copy_ in copies:
            if not torch.allclose(copy_, reference.get_input_embeddings().weight, atol=1e-10):
                problems.append(f"{name} {schedule}: after 3 steps the tied copy drifted")
    return problems
