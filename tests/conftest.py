"""Shared fixtures: a seeded RNG for every test, and the ``cuda`` marker that skips without a GPU."""
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "torchpipe",
    deadline=None,
    max_examples=int(os.environ.get("TORCHPIPE_HYPOTHESIS_EXAMPLES", "25")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("torchpipe")


@pytest.fixture(autouse=True)
def manual_seed_zero() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
