"""The two cases of the DataParallel tutorial, on torchpipe.parallel.DataParallel.

Case one: a feature network feeds a head network with no gather and re-scatter
in between (``gather_to_one_device=False`` into ``inputs_are_scattered=True``).
Case two: ``except_keywords`` keeps some outputs of a nested dict per replica
and gathers the rest.

Runs on two CPU replicas by default, on every GPU when CUDA is available:
``python examples/dataparallel_tutorial.py``.
"""
from typing import Any, Dict, List, Union

import torch
from torch import Tensor, nn, optim

from torchpipe.parallel import DataParallel

DeviceIds = List[Union[int, str]]


class SimpleNetworkA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


class SimpleNetworkB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


class ComplexNetworkA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Dict[str, Any]:
        output = self.model(x)
        return {"outputs": {"out1": output, "out2": output}, "second_output": output}


def case_one(device_ids: DeviceIds, device: torch.device) -> None:
    net_a, net_b = SimpleNetworkA().to(device), SimpleNetworkB().to(device)
    opt = optim.Adam(list(net_a.parameters()) + list(net_b.parameters()), lr=1e-4, betas=(0.5, 0.9))
    features = DataParallel(net_a, device_ids, gather_to_one_device=False)  # don't gather
    head = DataParallel(net_b, device_ids, inputs_are_scattered=True)  # inputs are already scattered

    x = torch.ones(16, 5, device=device)
    a_out = features(x)
    b_out = head(a_out)
    b_out.mean().backward()
    opt.step()
    print("case one: A's output is a", type(a_out).__name__, "of", [tuple(o.shape) for o in a_out])
    print("          on devices", [str(o.device) for o in a_out], "; B's output", tuple(b_out.shape))


def case_two(device_ids: DeviceIds, device: torch.device) -> None:
    net_a, net_b = ComplexNetworkA().to(device), SimpleNetworkB().to(device)
    net_a_dp = DataParallel(net_a, device_ids, except_keywords=["out1", "out2"])  # gather all but these
    net_b_dp = DataParallel(net_b, device_ids, inputs_are_scattered=True)

    a_out = net_a_dp(torch.ones(16, 5, device=device))
    out1, out2 = a_out["outputs"]["out1"], a_out["outputs"]["out2"]
    second = a_out["second_output"]
    print(f"case two: out1 is a {type(out1).__name__} of {len(out1)}, element size {tuple(out1[0].shape)}")
    print(f"          second_output is a {second.type()} of size {tuple(second.shape)}")
    b_out = net_b_dp(tuple(o1 + o2 for o1, o2 in zip(out1, out2)))
    (b_out.mean() + second.mean()).backward()
    print("          B's output", tuple(b_out.shape), "; A got gradients:", net_a.model.weight.grad is not None)


def main() -> None:
    if torch.cuda.is_available():
        device_ids: DeviceIds = list(range(torch.cuda.device_count()))
        device = torch.device("cuda", 0)
    else:
        device_ids, device = ["cpu", "cpu"], torch.device("cpu")
    print("replicas:", device_ids)
    case_one(device_ids, device)
    case_two(device_ids, device)


if __name__ == "__main__":
    main()
