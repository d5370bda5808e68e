"""A TupleParallel training loop fed by a DataLoader with ``default_collate(n)``.

Each batch arrives already cut into one mini-batch per replica; the replicas
run in parallel and their outputs are concatenated on ``device_ids[0]``.
Runs on two CPU replicas by default, on every GPU when CUDA is available:
``python examples/tupleparallel_loop.py``.
"""
from typing import List, Tuple, Union

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from torchpipe.parallel import TupleParallel, cat, default_collate


class Regression(Dataset[Tuple[Tensor, Tensor]]):
    """y = x @ w + noise, for a fixed random w."""

    def __init__(self, size: int = 512, features: int = 16) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, features, generator=generator)
        w = torch.randn(features, 1, generator=generator)
        self.y = self.x @ w + 0.01 * torch.randn(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> Tuple[Tensor, Tensor]:
        return self.x[index], self.y[index]


def main() -> None:
    torch.manual_seed(0)
    if torch.cuda.is_available():
        device_ids: List[Union[int, str]] = list(range(torch.cuda.device_count()))
        device = torch.device("cuda", 0)
    else:
        device_ids, device = ["cpu", "cpu"], torch.device("cpu")

    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    model = TupleParallel(net, device_ids, transfer_output=True, reduction=cat)
    model.to(device)  # the module must be on device_ids[0] by the first call
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(
        Regression(), batch_size=64, shuffle=True, drop_last=True, collate_fn=default_collate(len(device_ids))
    )

    for epoch in range(5):
        total = 0.0
        for x, y in loader:  # x and y: one mini-batch per replica
            optimizer.zero_grad()
            prediction = model(x)  # concatenated on device_ids[0]
            loss = nn.functional.mse_loss(prediction, torch.cat(y).to(device))
            loss.backward()
            optimizer.step()
            total += loss.item()
        print(f"epoch {epoch}: mean loss {total / len(loader):.4f}")


if __name__ == "__main__":
    main()
