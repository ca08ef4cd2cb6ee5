"""scripts/bench_train.py --activations: a dump written as `scripts/activity.py --dump-ffn-inputs` writes
it (eval.activity.dump_ffn_inputs on a tiny model) loads with the dump's shapes, in the layout twell_ffn
takes, and passes the bench's correctness check on CPU (Triton interpreter); bad files fail naming the
file and the fix. The loader and the check live in scripts/benchlib.py, which bench_ffn.py shares. The
timed run itself needs a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import bench_train  # scripts/, on sys.path through tests/conftest.py
import benchlib
import pytest
import torch

from twell.eval.activity import ActivityMeter, dump_ffn_inputs
from twell.kernels.training.train import BACKWARD_VARIANTS, set_backward_variant, twell_ffn
from twell.model import ModelConfig, Transformer

REPO = Path(__file__).resolve().parents[2]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M, D, F, LAYER = 40, 64, 128, 1


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """A float32 dump of layer LAYER's FFN inputs over M tokens, and the FFN outputs the model computed.

    Sparse as after L1 training, with the bias channel of kernels/synthetic.py: attention and the FFNs
    below LAYER add nothing, so LAYER's input is RMSNorm(embedding) whose last feature is ~3.6 on
    every token, and w_gate[:, -1] = -tau_j shifts unit j's pre-activation (a few of 128 units fire)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=100, d_model=D, n_layers=2, n_heads=2, d_ff=F, max_seq_len=32)
    net = Transformer(cfg).eval()
    with torch.no_grad():
        net.tok_embeddings.weight.normal_()
        net.tok_embeddings.weight[:, -1] = 4.0
        for layer, block in enumerate(net.layers):
            block.attn.wo.weight.zero_()
            if layer < LAYER:
                block.ffn.w_down.zero_()
        w_gate = net.layers[LAYER].ffn.w_gate
        w_gate.copy_(torch.randn(F, D) / D**0.5)
        w_gate[:, -1] = -(0.15 + 0.6 * torch.rand(F))
    with torch.no_grad(), ActivityMeter(net, 32, capture_layers=[LAYER]) as meter:
        meter.run(torch.randint(100, (2, 20)))  # 2 sequences x 20 tokens = M rows
    path = dump_ffn_inputs(meter, tmp_path_factory.mktemp("acts") / "acts.pt")[LAYER]
    y = torch.cat(meter.captured[LAYER]["y"])
    return path, y, net.layers[LAYER].ffn


def test_loads_the_dump_with_its_shapes_and_layout(dump):
    path, y_model, ffn = dump
    blob = torch.load(path)
    assert blob["tokens"] == M and blob["x"].shape == (M, D)  # extra keys (layer, tokens) are ignored
    x, w_gate, w_up, w_down = benchlib.load_activations(path, dtype=torch.float32)
    assert x.shape == (M, D) and all(w.shape == (F, D) for w in (w_gate, w_up, w_down))
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in (x, w_gate, w_up, w_down))
    # No transpose: the dump's w_down is neuron-major [F, D], as the model stores it and twell_ffn takes it.
    assert torch.equal(w_down, ffn.w_down.detach()) and torch.equal(w_up, ffn.w_up.detach())
    y, _ = benchlib.dense_ffn_l1(x, w_gate, w_up, w_down)
    torch.testing.assert_close(y, y_model, rtol=1e-5, atol=1e-6)

    bf16 = benchlib.load_activations(path)  # the bench's default: bf16, as the synthetic inputs
    assert all(t.dtype == torch.bfloat16 for t in bf16)
    first = benchlib.load_activations(path, tokens=16, dtype=torch.float32)
    assert first[0].shape == (16, D) and torch.equal(first[0], x[:16])
    assert all(torch.equal(a, b) for a, b in zip(first[1:], (w_gate, w_up, w_down)))


@pytest.fixture
def keep_tf32_flag():
    """prepare_step's fp32 reference turns TF32 off; put the flag back. Not monkeypatch: pytest >= 9.2 undoes a patched
    instance attribute with delattr, which torch.backends.cuda.matmul does not support."""
    old = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def test_correctness_check_passes_on_the_dump(dump, keep_tf32_flag):
    """What bench_inputs does before timing: leaves requiring grad, grad_y, the fp32 reference, then
    the errors of dense eager and every TwELL backward variant and the `ok` verdict."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    inputs = benchlib.load_activations(dump[0], dtype=dtype, device=DEVICE)
    out = twell_ffn(*inputs)  # sparse rows (the training CSR holds every positive: no overflow path)
    assert 1 < out.row_active.float().mean() < F / 8 and int(out.overflow_rows) == 0
    leaves, grad_y, ref = benchlib.prepare_step(inputs)
    assert all(t.is_leaf and t.requires_grad and t.dtype == dtype for t in leaves)
    assert grad_y.shape == (M, D) and grad_y.dtype == dtype and not grad_y.requires_grad
    rows = [{"impl": "dense_eager", **benchlib.step_errors(benchlib.dense_ffn_l1, leaves, grad_y, ref)}]
    try:
        for variant in BACKWARD_VARIANTS:
            set_backward_variant(variant)
            errors = benchlib.step_errors(benchlib.twell_y_l1, leaves, grad_y, ref)
            rows.append({"impl": f"twell_{variant}", **errors})
    finally:
        set_backward_variant("auto")
    benchlib.mark_ok(rows)
    assert all(r["ok"] for r in rows), rows
    if dtype == torch.float32:
        assert all(v < 1e-4 for r in rows for k, v in r.items() if k.startswith("err_")), rows


def _save(tmp_path, **blob) -> Path:
    path = tmp_path / "bad.pt"
    torch.save(blob, path)
    return path


def _good(**change):
    blob = {"x": torch.randn(M, D), "w_gate": torch.randn(F, D), "w_up": torch.randn(F, D)}
    blob["w_down"] = torch.randn(F, D)
    blob.update(change)
    return {k: v for k, v in blob.items() if v is not None}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"w_up": None}, r"no tensor under \['w_up'\].*--dump-ffn-inputs"),
        ({"w_down": torch.randn(D, F)}, r"w_down is \[64, 128\].*neuron-major.*w_down\.t\(\)\.contiguous\(\)"),
        ({"w_gate": torch.randn(F, 2 * D)}, r"w_gate is \[128, 128\].*d_model=64"),
        ({"x": torch.randn(2, M, D)}, r"x is a 3-D"),
        ({"x": torch.randn(M, 48), "w_gate": torch.randn(F, 48), "w_up": torch.randn(F, 48),
          "w_down": torch.randn(F, 48)}, r"d_model=48 must be a multiple of 64"),
    ],
)  # fmt: skip
def test_bad_dump_names_the_file_and_the_fix(tmp_path, change, message):
    path = _save(tmp_path, **_good(**change))
    with pytest.raises(benchlib.BadActivations, match=message) as err:
        benchlib.load_activations(path)
    assert str(path) in str(err.value)


def test_missing_file_unreadable_file_and_too_many_tokens(tmp_path):
    missing = tmp_path / "nope.pt"
    with pytest.raises(benchlib.BadActivations, match=r"nope\.pt: no such file.*--dump-ffn-inputs"):
        benchlib.load_activations(missing)
    junk = tmp_path / "junk.pt"
    junk.write_text("not a torch file")
    with pytest.raises(benchlib.BadActivations, match=r"junk\.pt: cannot read it with torch\.load"):
        benchlib.load_activations(junk)
    listed = tmp_path / "list.pt"
    torch.save([torch.zeros(2)], listed)
    with pytest.raises(benchlib.BadActivations, match=r"list\.pt: holds a list, not a dict"):
        benchlib.load_activations(listed)
    path = _save(tmp_path, **_good())
    with pytest.raises(benchlib.BadActivations, match=r"--tokens 41 must be in 1\.\.40"):
        benchlib.load_activations(path, tokens=M + 1)


def test_main_reports_a_bad_file_before_asking_for_a_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"error: --activations .*nope\.pt: no such file"):
        bench_train.main(["--activations", str(tmp_path / "nope.pt")])
    path = _save(tmp_path, **_good())
    with pytest.raises(SystemExit, match=r"--tokens takes one N"):
        bench_train.main(["--activations", str(path), "--tokens", "16", "32"])
    assert "--activations PATH" in bench_train.build_parser().format_help()


@pytest.mark.gpu
def test_timed_run_on_the_dump(dump, tmp_path):
    out = tmp_path / "bench_train.json"
    bench_train.main(
        ["--activations", str(dump[0]), "--no-compile", "--rep", "5", "--tokens", "32", "--out", str(out)]
    )
    blob = json.loads(out.read_text())
    assert blob["source"] == str(dump[0])
    twell = [f"twell_{v}{h}" for v in BACKWARD_VARIANTS for h in ("", "_h1024")]  # --hot-units 0 1024
    assert [r["impl"] for r in blob["rows"]] == ["dense_eager"] + twell
    for r in blob["rows"]:
        assert (r["source"], r["tokens"], r["d_model"], r["d_ff"]) == (str(dump[0]), 32, D, F) and r["ok"]
