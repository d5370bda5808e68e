"""Balance a model automatically, then pipeline it with GPipe (CPU, a few seconds).

Run: ``python examples/balancing.py``.
"""
import torch
from torch import nn

import torchpipe
from torchpipe_balancing import balance_by_size, balance_by_time, balance_cost


def make_model() -> nn.Sequential:
    # Uneven on purpose: the wide block in the middle costs far more time and memory.
    return nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(),
        nn.Linear(64, 64), nn.ReLU(),
        nn.Linear(64, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 64), nn.ReLU(),
        nn.Linear(64, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )


def main() -> None:
    torch.manual_seed(0)
    model = make_model()
    batch = torch.randn(256, 64)
    chunks = 4

    # The exact solver on costs you already know (say, from your own profiler):
    print("balance_cost([1, 1, 1, 1, 8, 1, 1], 3) =", balance_cost([1, 1, 1, 1, 8, 1, 1], 3))

    # By time: each layer's forward+backward, profiled for about half a second.
    by_time = balance_by_time(3, model, batch, timeout=0.5)
    print("balance_by_time:", by_time)

    # By memory: activations saved for backward per micro-batch, plus parameter bytes
    # times param_scale (4.0 for Adam: weights, gradients and two moment estimates).
    by_size = balance_by_size(3, model, batch, chunks=chunks, param_scale=4.0)
    print("balance_by_size:", by_size)

    # The module is untouched by profiling; wrap it with the balance you chose.
    pipe = torchpipe.GPipe(model, by_time, devices=["cpu"] * 3, chunks=chunks, checkpoint="except_last")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    target = torch.randint(0, 10, (256,))
    for step in range(3):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(pipe(batch), target)
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
