import pytest
import torch


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty that fills its memory with poison (NaN / -7), so an element a kernel forgot to
    write cannot pass a comparison by luck of fresh zeroed memory."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        t.fill_(float("nan") if t.is_floating_point() else -7)
        return t

    monkeypatch.setattr(torch, "empty", empty)
    return empty
