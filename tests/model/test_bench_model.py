"""scripts/bench_model.py on CPU (TwELL through Triton's interpreter): every variant runs the same
weights, TwELL's hidden states match the dense path's, the activity it reports is the calibrated one,
and a trained model folder goes through the same code. Its timings mean nothing here; the GPU run's
numbers are in docs/results."""

from __future__ import annotations

import json
from pathlib import Path

import bench_model  # scripts/, on sys.path through tests/conftest.py
import plot_bench_model
import pytest
import torch

from twell.data.tokenizer import train_bpe_tokenizer
from twell.model import ModelConfig, Transformer
from twell.model.calibrate import calibrate_activity
from twell.model.hf_io import export_hf

REPO = Path(__file__).resolve().parents[2]

SMALL = ["--device", "cpu", "--seq-len", "32", "--seconds", "0", "--warmup", "1", "--min-iters", "1"]


@pytest.mark.slow
def test_dense_and_twell_rows_for_inference_and_training(tmp_path):
    out = tmp_path / "bench_model.json"
    rows = bench_model.main(
        ["--model", "tiny", "--batch", "4", "--micro-batch", "1", "--mean-active", "12"]
        + SMALL
        + ["--out", str(out)]
    )
    assert [(r["mode"], r["impl"]) for r in rows] == [
        ("infer", "dense"),
        ("infer", "twell"),
        ("train", "dense"),
        ("train", "twell"),
    ]
    infer_dense, infer_twell, train_dense, train_twell = rows
    assert infer_dense["max_row_err"] == 0.0  # the reference of the others
    assert 0.0 < infer_twell["max_row_err"] < bench_model.ROW_TOLERANCE  # bf16, its own kernels
    for row in rows:
        assert (
            row["tokens"] == (128 if row["mode"] == "infer" else 32) and row["ms"] > 0 and row["iters"] >= 1
        )
        assert row["x_dense"] == pytest.approx(rows[0 if row["mode"] == "infer" else 2]["ms"] / row["ms"])
        assert abs(row["active_mean"] - 12) < 3  # calibrated on these tokens (LR 0: kept in training)
        assert row["energy_mj"] is None and row["mj_per_token"] is None  # no counter off a GPU
    # Both training variants started from the same weights and kept them: the same activity, up to
    # the odd unit at its threshold that the two paths' sums put on different sides.
    assert train_dense["active_mean"] == pytest.approx(train_twell["active_mean"], abs=0.2)
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 4 and doc["calibration"]["active_mean"] == pytest.approx([12, 12], abs=0.5)
    png = plot_bench_model.main([str(out), str(out), "--out", str(tmp_path / "bench_model.png")])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "other.json").write_text(json.dumps({"device": "cpu"}))
    with pytest.raises(SystemExit, match="not a bench_model.py result"):
        plot_bench_model.main([str(tmp_path / "other.json")])


@pytest.mark.slow
def test_a_trained_model_folder_is_benchmarked_as_it_is_on_its_text(tmp_path):
    text = " ".join(f"the unit {i} fires on token {i * 7 % 13} of the row" for i in range(60))
    tokenizer = train_bpe_tokenizer([text], vocab_size=256, out_dir=tmp_path / "tok")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_seq_len=32)
    net = Transformer(cfg)
    calibrate_activity(net, torch.randint(0, 256, (16, 32)), mean_active=8.0)
    folder = export_hf(net, tokenizer, tmp_path / "hf")
    (tmp_path / "text.txt").write_text(text)
    argv = [
        "--checkpoint",
        str(folder),
        "--file",
        str(tmp_path / "text.txt"),
        "--mode",
        "infer",
        "--batch",
        "2",
    ]
    rows = bench_model.main(argv + SMALL + ["--out", str(tmp_path / "b.json")])
    assert [r["impl"] for r in rows] == ["dense", "twell"]
    assert rows[1]["max_row_err"] < bench_model.ROW_TOLERANCE
    assert 0 < rows[0]["active_mean"] < 40  # the folder's weights on its text, not a new calibration
    assert "calibration" not in json.loads((tmp_path / "b.json").read_text())  # none was made
    # The batch is the file's tokens, in order, cycled to fill the rows.
    args = bench_model.parse_args(argv + SMALL)
    batch = bench_model.make_tokens(args, cfg, tokenizer, 3, torch.device("cpu"))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert batch.shape == (3, 33) and batch.flatten().tolist() == (ids * (99 // len(ids) + 1))[:99]


def test_bad_options_are_refused_with_the_fix(capsys):
    with pytest.raises(SystemExit):
        bench_model.main(["--file", "notes.txt"])
    assert "--file needs --checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--cuda-graph needs a CUDA device"):
        bench_model.main(["--model", "tiny", "--device", "cpu", "--cuda-graph"])
    with pytest.raises(SystemExit):
        bench_model.main(["--batch", "0"])
    assert "--batch=0 must be >= 1" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU only")
@pytest.mark.parametrize(
    "script, smoke", [("bench_model", "--model tiny --device cpu"), ("bench_generate", "--quick")]
)
def test_without_a_gpu_the_benchmarks_name_the_smoke_test_instead_of_running_for_hours(script, smoke, capsys):
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(script).main([])
    err = capsys.readouterr().err
    assert "error: no CUDA GPU here" in err and f"A smoke test on the CPU: {smoke}" in err
