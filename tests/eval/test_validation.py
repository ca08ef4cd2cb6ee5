import math

import pytest
import torch
import torch.nn.functional as F

from twell.eval import bytes_per_token, validation_loss
from twell.model import ModelConfig, Transformer


def test_validation_loss_and_bpb_against_hand_computation():
    net = Transformer(
        ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, d_ff=128, max_seq_len=32)
    )
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 256, (2, 16))
        labels = torch.randint(0, 256, (2, 16))
        labels[torch.rand(2, 16) < 0.2] = -100  # ignored positions
        batches.append({"input_ids": ids, "labels": labels})
    ratio = 1.0 + 3.0 * torch.rand(()).item()
    net.train()
    out = validation_loss(net, batches, bytes_per_token=ratio)
    assert net.training  # mode restored

    nats, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logp = F.log_softmax(net(batch["input_ids"]).logits, dim=-1)
            for b in range(2):
                for s in range(16):
                    label = batch["labels"][b, s].item()
                    if label != -100:
                        nats -= logp[b, s, label].item()
                        count += 1
    assert out["val_tokens"] == count
    assert out["val_loss"] == pytest.approx(nats / count, rel=1e-5)
    assert out["val_bpb"] == pytest.approx(nats / count / math.log(2) / ratio, rel=1e-5)
    assert "val_bpb" not in validation_loss(net, batches[:1])
    assert validation_loss(net, batches, max_batches=1)["val_tokens"] == (batches[0]["labels"] != -100).sum()


def test_validation_loss_errors():
    net = Transformer(ModelConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=2, d_ff=128))
    empty = [{"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.full((1, 4), -100)}]
    with pytest.raises(ValueError, match="no target tokens"):
        validation_loss(net, empty)
    batch = [
        {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long)}
    ]
    with pytest.raises(ValueError, match="bytes_per_token=0"):
        validation_loss(net, batch, bytes_per_token=0)


def test_bytes_per_token(tiny_tokenizer):
    texts = ["Plain ascii text here.", "Ünïcödé costs more bytes — per character."]
    tokens = sum(len(tiny_tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    expected = sum(len(t.encode("utf-8")) for t in texts) / tokens
    assert bytes_per_token(tiny_tokenizer, texts) == pytest.approx(expected)
    with pytest.raises(ValueError, match="at least one non-empty text"):
        bytes_per_token(tiny_tokenizer, [""])
