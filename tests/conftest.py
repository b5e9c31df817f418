import os
pytest_plugins = ["s3_server"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def random_kv(layers=2, tokens=40, heads=2, dim=8, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, layers, tokens, heads, dim, generator=g).to(dtype)


@pytest.fixture
def kv_factory():
    return random_kv
