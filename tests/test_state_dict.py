"""State dicts with the plain module's keys: a checkpoint moves between the plain module and any balance."""
import warnings

import pytest
import torch

from tests.models import cpu_gpipe, mlp


def test_state_dicts_move_between_the_plain_module_and_any_balance() -> None:
    # A GPipe loads the plain module's state dict and another balance's, and full_state_dict() gives the plain
    # module's keys, in its order; a missing key is an error, as load_state_dict's.
    plain = mlp(3, 4)
    piped = cpu_gpipe(mlp(3, 4), [2, 2, 2])
    piped.load_state_dict(plain.state_dict())  # keys like '3.weight'
    x = torch.randn(2, 4)
    assert torch.allclose(piped(x), plain(x))
    other = cpu_gpipe(mlp(3, 4), [1, 5])
    other.load_state_dict(piped.state_dict())  # another balance's own keys
    assert torch.allclose(other(x), plain(x))
    again = mlp(3, 4)
    again.load_state_dict(other.full_state_dict())
    assert list(other.full_state_dict()) == list(plain.state_dict())
    assert torch.allclose(again(x), plain(x))
    with pytest.raises(RuntimeError, match="Missing key"):
        piped.load_state_dict({"0.weight": plain[0].weight})


class Rotary(torch.nn.Module):
    """A layer whose frequencies are a non-persistent buffer (as a rotary embedding's), computed when built."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("freq", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.freq


def test_a_meta_model_warns_of_buffers_that_no_state_dict_restores() -> None:
    # A non-persistent buffer of a module without reset_parameters() (a traced Hugging Face model's rotary
    # frequencies) is materialised as garbage, and loading a state dict cannot fix it, since no state dict holds
    # it: the warning names it rather than saying that a state dict will do.
    with torch.device("meta"):
        model = torch.nn.Sequential(Rotary(), torch.nn.Linear(4, 4))
    with pytest.warns(UserWarning, match=r"buffers 0\.freq, which no state dict holds"):
        cpu_gpipe(model, [1, 1])
    with torch.device("meta"):
        fine = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every layer has reset_parameters(), buffers included: nothing to say
        cpu_gpipe(fine, [1, 1])
