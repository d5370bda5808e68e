"""Training loops as people write them for language models: a padded tiny Llama, its token-level loss, and a
tiny Mixtral whose router adds an auxiliary loss. Shared by the one-process and the multi-process tests."""
from typing import Any, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchpipe

VOCAB = 37
IGNORE = -100


def llama() -> nn.Module:
    """A tiny Llama in float64, built from a config (nothing downloaded)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(config).double()


def padded_batch(rows: int, seed: int, length: int = 10) -> Tuple[Tuple[Tensor, Tensor], Tensor]:
    """``((input_ids, attention_mask), labels)``: rows of random lengths, right-padded, the labels the next token
    and ``IGNORE`` on padding and at each row's end, so rows hold different numbers of tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length), generator=generator)
    lengths = torch.randint(2, length + 1, (rows,), generator=generator)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids = ids * mask  # padding is token 0
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = torch.where(mask[:, 1:].bool(), ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE))
    return (ids, mask), labels


def token_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """The mean over the non-ignored tokens, as Hugging Face's causal language models compute it."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


def tokens(labels: Tensor) -> Tensor:
    """A micro-batch's weight in the token mean: its number of non-ignored labels."""
    return (labels != IGNORE).sum()


def traced_llama(model: nn.Module) -> nn.Sequential:
    (ids, mask), _ = padded_batch(2, seed=99)
    return torchpipe.as_sequential(model, input_ids=ids, attention_mask=mask, output="logits", use_cache=False)


def plain_loss(model: nn.Module, batch: Tuple[Tensor, Tensor], labels: Tensor) -> Tensor:
    ids, mask = batch
    return token_loss(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, labels)


def mixtral() -> nn.Module:
    """A tiny Mixtral (a mixture of experts) whose output carries the router's load-balancing loss: float32, as
    its experts' grouped matrix multiplication takes no float64 (and the eager loop over experts does not
    export: which experts a token goes to depends on the data)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        output_router_logits=True, router_aux_loss_coef=0.1, pad_token_id=0,
    )
    return transformers.MixtralForCausalLM(config)


def with_aux_loss(output: Tuple[Tensor, Tensor], labels: Tensor) -> Tensor:
    """The documented recipe's loss: the token loss plus the router's auxiliary term (already scaled by the
    model's ``router_aux_loss_coef``)."""
    logits, aux_loss = output
    return token_loss(logits, labels) + aux_loss


def mixtral_outputs(out: Any) -> Tuple[Tensor, Tensor]:
    return out.logits, out.aux_loss
