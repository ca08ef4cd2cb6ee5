"""Activity report and FFN dump: numbers against a hand computation on a model whose units fire in a
known pattern, the dump against the FFN it came from, the CLI end to end, and its errors."""

import json
from pathlib import Path

import activity as activity_cli  # scripts/, on sys.path through tests/conftest.py
import pytest
import torch

from twell.eval.activity import (
    BENCH_KEYS,
    ActivityMeter,
    batches_of,
    dump_ffn_inputs,
    parse_layers,
    position_buckets,
    text_sequences,
)
from twell.kernels import reference
from twell.model import ModelConfig, Transformer

REPO = Path(__file__).resolve().parents[2]

VOCAB, D_MODEL, D_FF, LAYERS, SEQ_LEN = 48, 64, 128, 3, 40


def patterned_model(ffn_impl: str, gen: torch.Generator) -> tuple[Transformer, torch.Tensor]:
    """A model where unit j of layer l fires on token t iff pattern[l, t, j].

    Attention and FFN outputs are zeroed (wo = 0, w_down = 0), so every layer's FFN input is
    RMSNorm(embedding[t]) with embedding[t] = e_0 + e_(1+t): all entries >= 0. A gate row
    -0.5 e_0 + sum of e_(1+t) over the tokens that should fire it is then > 0 exactly on those tokens.
    """
    cfg = ModelConfig(
        vocab_size=VOCAB,
        d_model=D_MODEL,
        n_layers=LAYERS,
        n_heads=2,
        d_ff=D_FF,
        max_seq_len=64,
        ffn_impl=ffn_impl,
    )
    net = Transformer(cfg)
    # A different density per (layer, token) so that layers and positions differ clearly.
    density = torch.rand(LAYERS, VOCAB, 1, generator=gen) * 0.6
    pattern = torch.rand(LAYERS, VOCAB, D_FF, generator=gen) < density
    with torch.no_grad():
        embedding = torch.zeros(VOCAB, D_MODEL)
        embedding[:, 0] = 1.0
        embedding[torch.arange(VOCAB), 1 + torch.arange(VOCAB)] = 1.0
        net.tok_embeddings.weight.copy_(embedding)
        for layer, block in enumerate(net.layers):
            block.attn.wo.weight.zero_()
            block.ffn.w_down.zero_()
            gate = torch.zeros(D_FF, D_MODEL)
            gate[:, 0] = -0.5
            gate[:, 1 : 1 + VOCAB] = pattern[layer].T.float()
            block.ffn.w_gate.copy_(gate)
    return net, pattern


def hand_report(pattern: torch.Tensor, sequences: list[torch.Tensor]):
    """Per-layer mean / max / never-fired and per-bucket means, straight from the pattern."""
    counts = pattern.sum(-1)  # [L, V] active units of each token
    all_tokens = torch.cat(sequences)
    per_token = counts[:, all_tokens].double()  # [L, tokens]
    fired = pattern[:, all_tokens].any(dim=1)  # [L, F]
    buckets = position_buckets(SEQ_LEN)
    position_mean = []
    for layer in range(LAYERS):
        row = []
        for lo, hi in buckets:
            values = [counts[layer, seq[lo:hi]].double() for seq in sequences if len(seq) > lo]
            row.append(torch.cat(values).mean().item() if values else None)
        position_mean.append(row)
    return dict(
        active_mean=per_token.mean(1).tolist(),
        active_max=per_token.max(1).values.long().tolist(),
        never_fired=(~fired).sum(1).tolist(),
        position_mean=position_mean,
    )


# Mixed lengths: batches_of groups them without padding; the short ones leave late buckets thin.
# The TwELL kernels run under Triton's interpreter on CPU: fewer forwards there.
@pytest.mark.parametrize(
    "ffn_impl, lengths, batch_size",
    [("dense", [SEQ_LEN, SEQ_LEN, SEQ_LEN, 9, 9, 3, 1], 2), ("twell", [SEQ_LEN, SEQ_LEN, 9, 1], 4)],
)
def test_layer_and_position_numbers_equal_hand_computation(ffn_impl, lengths, batch_size):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    net, pattern = patterned_model(ffn_impl, gen)
    sequences = [torch.randint(VOCAB, (n,), generator=gen) for n in lengths]
    with ActivityMeter(net, SEQ_LEN) as meter:
        for tokens in batches_of([s.tolist() for s in sequences], batch_size):
            meter.run(tokens)
    report = meter.report()
    want = hand_report(pattern, sequences)
    assert report.tokens == sum(lengths) and report.sequences == len(lengths)
    assert report.active_mean == pytest.approx(want["active_mean"], rel=1e-12)
    assert report.active_max == want["active_max"]
    assert report.never_fired == want["never_fired"]
    assert report.active_frac == pytest.approx([m / D_FF for m in want["active_mean"]], rel=1e-12)
    assert report.bucket_tokens == [
        sum(max(0, min(hi, n) - lo) for n in lengths) for lo, hi in report.buckets
    ]
    for got_row, want_row in zip(report.position_mean, want["position_mean"]):
        assert got_row == pytest.approx(want_row, rel=1e-12)
    # The hooks left the model as they found it.
    assert all(not block.ffn._forward_hooks for block in net.layers)


def test_first_positions_most_active_shows_in_the_report():
    """A model whose units fire only on the first tokens' ids: the buckets must show the decay."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    net, pattern = patterned_model("dense", gen)
    busy, quiet = 0, 1
    with torch.no_grad():
        for layer, block in enumerate(net.layers):
            block.ffn.w_gate[:, 1 + quiet] = 0.0  # token `quiet` fires no unit
            block.ffn.w_gate[: 100 - 20 * layer, 1 + busy] = 1.0  # token `busy` fires 100, 80, 60
            block.ffn.w_gate[100 - 20 * layer :, 1 + busy] = 0.0
    tokens = torch.full((2, SEQ_LEN), quiet)
    tokens[:, 0] = busy
    tokens[0, 1] = busy
    with ActivityMeter(net, SEQ_LEN) as meter:
        meter.run(tokens)
    report = meter.report()
    for layer in range(LAYERS):
        fires = 100 - 20 * layer
        assert report.position_mean[layer][:3] == [fires, fires / 2, 0.0]
        assert report.active_max[layer] == fires
        assert report.active_mean[layer] == pytest.approx(3 * fires / (2 * SEQ_LEN))
        assert report.never_fired[layer] == D_FF - fires


def test_position_buckets():
    assert position_buckets(1) == [(0, 1)]
    assert position_buckets(10) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 10)]
    assert position_buckets(2048)[-1] == (1024, 2048)
    with pytest.raises(ValueError, match="seq_len=0"):
        position_buckets(0)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_dump_round_trips_and_reproduces_the_ffn(tmp_path, dtype):
    cfg = ModelConfig(vocab_size=100, d_model=64, n_layers=3, n_heads=2, d_ff=128, max_seq_len=32)
    net = Transformer(cfg)
    with torch.no_grad():  # sparser, uneven gates, as after L1 training
        for block in net.layers:
            block.ffn.w_gate.add_(torch.randn(cfg.d_ff, 1) * 0.05 - 0.05)
    layer = int(torch.randint(cfg.n_layers, ()))
    hooked = {"x": [], "y": []}

    def keep(module, args, out):
        hooked["x"].append(args[0].reshape(-1, 64))
        hooked["y"].append(out[0].reshape(-1, 64))

    handle = net.layers[layer].ffn.register_forward_hook(keep)
    batches = [torch.randint(100, (3, 32)), torch.randint(100, (2, 17))]
    with ActivityMeter(net, 32, capture_layers=[layer]) as meter:
        for tokens in batches:
            meter.run(tokens)
    handle.remove()
    path = dump_ffn_inputs(meter, tmp_path / "acts.pt", dtype)[layer]
    assert path == tmp_path / "acts.pt"
    blob = torch.load(path)
    x, y = torch.cat(hooked["x"]), torch.cat(hooked["y"])
    assert blob["layer"] == layer and blob["tokens"] == 3 * 32 + 2 * 17
    ffn = net.layers[layer].ffn
    want = {"x": x, "w_gate": ffn.w_gate, "w_up": ffn.w_up, "w_down": ffn.w_down}
    for key in BENCH_KEYS:
        assert blob[key].shape == want[key].shape and blob[key].is_contiguous()
        assert torch.equal(blob[key], want[key].detach().to(dtype or want[key].dtype))
    if dtype is None:
        out = reference.relu_ffn(*(blob[k] for k in BENCH_KEYS))
        torch.testing.assert_close(out.y, y, rtol=1e-5, atol=1e-6)
        assert out.row_active.float().mean().item() == pytest.approx(meter.report().active_mean[layer])
    # What scripts/bench_ffn.py --activations does with the file.
    inputs = [blob[k].to(torch.bfloat16).contiguous() for k in ("x", "w_gate", "w_up", "w_down")]
    assert inputs[0].shape == (blob["tokens"], 64) and all(w.shape == (128, 64) for w in inputs[1:])


def test_dump_of_all_layers_writes_one_file_each(tmp_path):
    net = Transformer(ModelConfig(vocab_size=100, d_model=64, n_layers=2, n_heads=2, d_ff=64, max_seq_len=16))
    with ActivityMeter(net, 16, capture_layers=parse_layers("all", 2)) as meter:
        meter.run(torch.randint(100, (2, 16)))
    paths = dump_ffn_inputs(meter, tmp_path / "acts.pt")
    assert paths == {0: tmp_path / "acts.layer00.pt", 1: tmp_path / "acts.layer01.pt"}
    for layer, path in paths.items():
        assert torch.equal(torch.load(path)["w_up"], net.layers[layer].ffn.w_up.detach())


def test_cli_on_an_hf_folder_matches_the_meter(tmp_path, tiny_tokenizer, capsys):
    from twell.model.hf_io import export_hf

    cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=2, d_ff=128, max_seq_len=64)
    net = Transformer(cfg)
    folder = export_hf(net, tiny_tokenizer, tmp_path / "hf")
    text = "The first tokens are the busiest. " * 20
    activity_cli.main(
        [f"checkpoint={folder}", "--text", text, "--seq-len", "32", "--out", str(tmp_path / "act")]
        + ["--dump-ffn-inputs", str(tmp_path / "d.pt"), "--layer", "-1"]
    )
    printed = capsys.readouterr().out
    assert "never fired" in printed and "layer 1: FFN inputs" in printed
    got = json.loads((tmp_path / "act.json").read_text())
    assert (tmp_path / "act.png").stat().st_size > 10_000

    sequences = text_sequences(tiny_tokenizer, text, 32)
    assert [len(s) for s in sequences[:-1]] == [32] * (len(sequences) - 1)
    with ActivityMeter(net, 32) as meter:
        for tokens in batches_of(sequences, 8):
            meter.run(tokens)
    want = meter.report()
    assert got["tokens"] == want.tokens == sum(map(len, sequences))
    assert got["active_mean"] == pytest.approx(want.active_mean, rel=1e-6)
    assert got["never_fired"] == want.never_fired
    assert got["buckets"][:4] == ["0", "1", "2-3", "4-7"]
    assert torch.load(tmp_path / "d.pt")["x"].shape == (want.tokens, 64)


def test_bad_inputs_give_clear_errors(tmp_path, tiny_tokenizer):
    missing = tmp_path / "no_such_run"
    with pytest.raises(FileNotFoundError, match="no_such_run does not exist"):
        activity_cli.main([f"checkpoint={missing}", "--text", "hello"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a Hugging Face folder"):
        activity_cli.main([f"checkpoint={tmp_path / 'empty'}", "--text", "hello"])
    with pytest.raises(SystemExit, match="--file nothing.txt does not exist"):
        activity_cli.main([f"checkpoint={missing}", "--file", "nothing.txt"])
    with pytest.raises(SystemExit, match="checkpoint=<path> is required"):
        activity_cli.main(["model=tiny", "--text", "hello"])

    with pytest.raises(ValueError, match="layer 5 is out of range: the model has 3 layers"):
        parse_layers("5", 3)
    with pytest.raises(ValueError, match="layer 'x' is not an integer"):
        parse_layers("x", 3)
    assert parse_layers("-1,0", 3) == [0, 2]

    net = Transformer(ModelConfig(vocab_size=100, d_model=64, n_layers=3, n_heads=2, d_ff=64, max_seq_len=16))
    folder = tmp_path / "hf"
    from twell.model.hf_io import export_hf

    export_hf(net, tiny_tokenizer, folder)  # vocab 100 < the tokenizer's 512: a mismatched pair
    with pytest.raises(SystemExit, match="layer 7 is out of range"):
        activity_cli.main(
            [f"checkpoint={folder}", "--text", "hi", "--dump-ffn-inputs", "d.pt", "--layer", "7"]
        )
    with pytest.raises(ValueError, match="vocab_size is 100: the tokenizer does not match"):
        activity_cli.main([f"checkpoint={folder}", "--text", "a long text with many words " * 3])
    with pytest.raises(ValueError, match="the text is empty"):
        text_sequences(tiny_tokenizer, "", 16)
    with ActivityMeter(net, 16) as meter:
        with pytest.raises(ValueError, match="exceeds the meter's seq_len 16"):
            meter.run(torch.zeros(1, 17, dtype=torch.long))
        with pytest.raises(ValueError, match="no tokens were measured"):
            meter.report()
