"""State dicts with the plain module's keys: a checkpoint moves between the plain module and any balance."""
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
