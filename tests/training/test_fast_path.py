"""The sparse path is ready before layers switch to it: kernels.training.train.warm_up and the trainer's warm-up
of model.ffn_impl=auto change nothing of the run but when its costs are paid."""

import sys

import pytest
import torch
from trainer_helpers import compose_job, tiny_overrides, train

from twell.kernels import twell_ffn
from twell.kernels.reference import relu_ffn
from twell.kernels.synthetic import paper_like_ffn_inputs
from twell.kernels.training.train import warm_up


def test_kernel_warm_up_runs_forward_and_backward_and_leaves_the_op_exact():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seconds = warm_up(64, 64, 128, device)
    assert seconds > 0
    x, w_gate, w_up, w_down = paper_like_ffn_inputs(40, 64, 128, dtype=torch.float32, device=device, seed=3)
    got, want = twell_ffn(x, w_gate, w_up, w_down), relu_ffn(x, w_gate, w_up, w_down)
    torch.testing.assert_close(got.y, want.y, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.unit_fires, want.unit_fires)


@pytest.mark.gpu
def test_auto_run_with_the_warm_up_equals_the_run_without_it(offline_data, tmp_path):
    """Every layer goes sparse at the first routing check (threshold above d_ff): the warmed run and a
    run that meets the sparse path cold train the same losses, routing and activity."""

    def run(name, *more):
        extra = ("model.ffn_impl=auto", "model.twell_threshold=1000", "model.twell_check_interval=2",
                 "train.device=cuda", "train.compile=false", *more)  # fmt: skip
        trainer = train.build_trainer(compose_job(tiny_overrides(offline_data, tmp_path / name, 6, *extra)))
        records = [r for r in trainer.fit() if "loss" in r]
        return trainer, records

    warmed, warm_records = run("warm")
    assert warmed.warm_up_seconds > 0
    cold, cold_records = run("cold", "train.warm_up=false")
    assert cold.warm_up_seconds is None
    assert warmed.model.ffn_routing() == cold.model.ffn_routing() == [True, True]
    for a, b in zip(warm_records, cold_records, strict=True):
        assert a["loss"] == b["loss"] and a["active_mean"] == b["active_mean"], (a, b)


def test_race_trains_both_twins_through_train_py_and_writes_table_and_plot(offline_data, tmp_path):
    """scripts/race.py on a tiny model: the two runs of the real trainer, then the comparison."""
    import json

    import race  # scripts/, on sys.path through tests/conftest.py

    overrides = [o for o in tiny_overrides(offline_data, tmp_path, 4) if not o.startswith("run_dir=")]
    overrides += ["sparsity.l1_coef=0.05", "model.twell_threshold=1000", "model.twell_check_interval=2"]
    # (the variant stays on the dense path, a threshold no layer reaches: the interpreter's TwELL run costs a minute)
    variant = [
        "--variant",
        "every_step",
        "model.twell_threshold=0.001 sparsity.reinit_dead=true sparsity.dead_window_tokens=0",
    ]
    assert race.main(["--out", str(tmp_path / "race"), "--settle", "2", *variant, "--", *overrides]) == 0
    result = json.loads((tmp_path / "race" / "race.json").read_text())
    # A variant: one more sparse run with its own overrides after the common ones, compared with the
    # dense twin as well.
    assert result["runs"] == ["sparse", "dense", "every_step"]
    assert result["variants"] == {"every_step": variant[2]}
    launch = json.loads((tmp_path / "race" / "every_step" / "launches.jsonl").read_text().splitlines()[-1])
    assert launch["argv"][-6:-2] == ["model.ffn_impl=auto", *variant[2].split()]
    assert result["every_step"]["reinit_units"] == 0 and "worst_ce_gap_after_settle" in result["every_step"]
    assert (
        result["every_step"]["speedup"] > 0
        and "| every_step |" in (tmp_path / "race" / "race.md").read_text()
    )
    # --only reruns some runs and reuses the others' folders; a variant not run yet is left out of the table.
    # With --repeats 2, the dense twin's repeat (dense_2) run alone: the noise floor of the CE gap, none
    # on a CPU (the same tokens, seed and arithmetic give the same run).
    # --gpus 2: the two runs side by side (on a CPU: two processes at once, each told a device of its own).
    later = [
        "--variant",
        "later",
        "sparsity.l1_coef=0.1",
        "--repeats",
        "2",
        "--gpus",
        "2",
        "--only",
        "dense_2",
        "every_step",
    ]
    assert (
        race.main(["--out", str(tmp_path / "race"), "--settle", "2", *variant, *later, "--", *overrides]) == 0
    )
    result = json.loads((tmp_path / "race" / "race.json").read_text())
    assert result["runs"] == ["sparse", "dense", "every_step", "dense_2"] and "later" in result["variants"]
    assert result["repeat_count"] == 2 and result["repeats"]["dense"]["runs"] == ["dense", "dense_2"]
    assert result["repeats"]["noise_floor"] == 0.0
    assert result["repeats"]["sparse"]["runs"] == ["sparse"]
    assert "noise floor" in (tmp_path / "race" / "race.md").read_text()
    first, second = result["schedule"]["every_step"], result["schedule"]["dense_2"]
    assert {first["device"], second["device"]} == {"0", "1"}
    assert second["start_s"] < first["end_s"] and first["start_s"] < second["end_s"]  # they overlapped
    sparse, dense = result["records"]["sparse"], result["records"]["dense"]
    assert [r["step"] for r in sparse] == [r["step"] for r in dense] == list(range(1, 5))
    assert [r["tokens"] for r in sparse] == [256 * s for s in range(1, 5)]
    # The same tokens and initialisation: the step-1 losses agree (both FFNs dense until the first check).
    assert sparse[0]["ce"] == pytest.approx(dense[0]["ce"], rel=1e-5)
    assert result["speedup"] == pytest.approx(
        result["sparse"]["steady_tokens_per_s"] / result["dense"]["steady_tokens_per_s"]
    )
    # The switch windows against the slower path's steady speed (the dense twin's), beside the own steady.
    # Four steps: no window after step 20, so the windows after the settle (step 2) are the late ones.
    slowest = min(r["tokens_per_s"] for r in sparse if r["step"] > 2)
    assert result["sparse"]["slowest_window_tokens_per_s"] == slowest
    assert result["sparse"]["slowest_window_vs_dense"] == pytest.approx(
        slowest / result["dense"]["steady_tokens_per_s"]
    )
    assert sparse[-1]["seconds"] > sparse[0]["seconds"] > 0
    assert "sparse / dense steady speed" in (tmp_path / "race" / "race.md").read_text()
    assert (tmp_path / "race" / "race.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _records(ces, speed=100.0):
    return [
        {"step": 10 * (i + 1), "tokens": 10 * (i + 1), "ce": ce, "tokens_per_s": speed, "seconds": i + 1.0,
         "active_mean": [1.0], "grad_norm": 1.0}
        for i, ce in enumerate(ces)
    ]  # fmt: skip


def test_race_repeats_compare_the_twins_mean_ce_beside_the_dense_twins_own_spread():
    """--repeats: each twin's runs averaged per step, and the dense repeats' gap to the first dense run as the
    noise floor against which a sparse gap is read."""
    import race

    runs = {
        "sparse": _records([5.0, 4.0, 3.3], 150.0),
        "dense": _records([5.0, 4.0, 3.0], 100.0),
        "sparse_2": _records([5.0, 4.0, 2.9], 170.0),
        "dense_2": _records([5.0, 4.2, 3.2], 120.0),
    }
    groups = {"sparse": ["sparse", "sparse_2"], "dense": ["dense", "dense_2"]}
    result = race.compare(runs, settle=10, groups=groups)
    repeats = result["repeats"]
    # Means per step: sparse (4.0, 3.1), dense (4.1, 3.1): the worst gap after the settle is at step 20.
    assert repeats["sparse"]["worst_mean_ce_gap_after_settle"] == pytest.approx(4.0 / 4.1 - 1)
    assert repeats["sparse"]["mean_final_ce"] == pytest.approx(3.1)
    assert repeats["sparse"]["final_ce_spread"] == pytest.approx(0.4 / 3.1)
    assert repeats["sparse"]["speedup"] == pytest.approx(160.0 / 110.0)
    assert repeats["dense"]["worst_mean_ce_gap_after_settle"] is None
    # The dense repeat against the first dense run: 4.2 / 4.0 at step 20, 3.2 / 3.0 at step 30.
    assert repeats["noise_floor"] == pytest.approx(3.2 / 3.0 - 1)
    # The repeat is a row of its own too, compared with the first dense run like any sparse run.
    assert result["dense_2"]["worst_ce_gap_after_settle"] == pytest.approx(3.2 / 3.0 - 1)
    text = race.table({**result, "commit": "abc", "machine": "m"})
    assert "| sparse | 2 | 160 | 1.455x | 3.1000 (12.90%) | -2.44% |" in text
    assert "noise floor" in text and "+6.67%" in text
    # One run of each: no repeats section.
    single = race.compare({k: runs[k] for k in ("sparse", "dense")}, settle=10, groups=groups)
    assert "repeats" not in single


def test_race_no_run_tables_the_runs_in_the_folder_and_leaves_out_unfinished_ones(tmp_path, capsys):
    """--no-run after a race cut by a time limit: the finished runs' table, an unfinished repeat left out."""
    import json

    import race

    ces = {"sparse": [5.0, 4.0, 3.3], "dense": [5.0, 4.0, 3.0], "dense_2": [5.0, 4.2, 3.2], "sparse_2": [5.0]}
    for name, ce in ces.items():
        (tmp_path / name).mkdir()
        lines = [json.dumps(r) for r in _records(ce)]
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert race.main(["--out", str(tmp_path), "--settle", "10", "--repeats", "2", "--no-run"]) == 0
    assert "left out of the table: sparse_2" in capsys.readouterr().out
    result = json.loads((tmp_path / "race.json").read_text())
    assert result["runs"] == ["sparse", "dense", "dense_2"]
    assert result["repeats"]["noise_floor"] == pytest.approx(3.2 / 3.0 - 1)
    assert result["repeats"]["sparse"]["runs"] == ["sparse"]
    assert not (tmp_path / "dense.log").exists()  # nothing was run
    assert result["machine"] == "machine not recorded (tabled by --no-run)"


def test_race_runs_jobs_side_by_side_one_device_each_and_stops_starting_after_a_failure(
    tmp_path, monkeypatch
):
    import race

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    assert race.devices_for(2) == ["3", "5"] and race.devices_for(1) == [None]
    with pytest.raises(SystemExit, match="names only 3 devices"):
        race.devices_for(4)
    show = "import os, time; time.sleep(0.5); print(os.environ.get('CUDA_VISIBLE_DEVICES'))"
    jobs = {name: [sys.executable, "-c", show] for name in ("a", "b", "c")}
    status, schedule = race.run_all(jobs, tmp_path, ["3", "5"])
    assert status == 0 and [(tmp_path / f"{n}.log").read_text().strip() for n in "abc"] == ["3", "5", "3"]
    assert (
        schedule["b"]["start_s"] < schedule["a"]["end_s"] <= schedule["c"]["start_s"]
    )  # c waited for a free device
    # A failure: the running job finishes, no other starts, its exit status is returned.
    jobs = {"bad": [sys.executable, "-c", "raise SystemExit(3)"], "slow": jobs["a"], "never": jobs["b"]}
    status, schedule = race.run_all(jobs, tmp_path, ["0", "1"])
    assert status == 3 and "end_s" in schedule["slow"] and "never" not in schedule


def test_race_refuses_a_variant_named_like_a_repeat(tmp_path, capsys):
    import race

    with pytest.raises(SystemExit):
        race.main(
            ["--out", str(tmp_path), "--repeats", "2", "--variant", "dense_2", "x=1", "--only", "dense"]
        )
    assert "dense_2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        race.main(["--out", str(tmp_path), "--repeats", "0"])


def test_race_records_a_run_of_uncommitted_code_as_dirty(tmp_path):
    """The commit a race table names is the checkout's, marked when its tracked files differ from it."""
    import subprocess

    import race

    git = lambda *a: subprocess.run(
        ["git", "-C", str(tmp_path), *a], check=True, capture_output=True, text=True
    )
    git("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    git("add", "f.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "--short=7", "HEAD").stdout.strip()
    assert race.commit_of(tmp_path) == head
    (tmp_path / "f.txt").write_text("b")
    assert race.commit_of(tmp_path) == f"{head}-dirty"


def test_a_sparse_block_compiles_without_a_graph_break():
    """Under the trainer's compile settings the TwELL op stays inside the block's graph (its entry count
    is a data-dependent size); a graph break would split every sparse block and recompile its pieces."""
    from twell.model import ModelConfig, Transformer
    from twell.training.trainer import configure_compile

    torch._dynamo.reset()
    configure_compile()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Transformer(
        ModelConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=2, d_ff=128, ffn_impl="twell")
    )
    model = model.to(device)
    x = torch.randn(2, 16, 64, device=device)
    cos, sin = model.rope_cos[:16], model.rope_sin[:16]
    explanation = torch._dynamo.explain(model.layers[0])(x, cos, sin)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_deferred_sizes_redo_a_step_whose_entries_did_not_fit_and_train_the_same_steps(
    offline_data, tmp_path, monkeypatch
):
    """train.twell_sizes=deferred: no TwELL layer reads its entry count back; the step's counts are
    settled once before the optimizer step. With capacities far too small, every step after the first
    (whose calls are exact: no history yet) misses, is redone and counted, and the run trains exactly
    the steps of the run whose capacities fit. (That deferred calls equal exact ones is
    tests/kernels/training/test_train.py's.) The default, estimate, has no step-level check."""
    import twell.kernels.training.train as kt

    def build(name, *more):
        extra = ("model.ffn_impl=twell", "train.compile=false", "train.global_batch_tokens=128", *more)
        return train.build_trainer(compose_job(tiny_overrides(offline_data, tmp_path / name, 3, *extra)))

    assert build("estimate")._kt is None
    fitted = build("deferred", "train.twell_sizes=deferred")
    records = [r for r in fitted.fit() if "loss" in r]
    assert records[-1]["twell_redos"] == fitted.twell_redos == 0
    monkeypatch.setattr(kt, "_with_margin", lambda nnz: max(nnz // 2, 1))  # half the slots needed
    missing = build("missing", "train.twell_sizes=deferred")
    missing_records = [r for r in missing.fit() if "loss" in r]
    assert missing.twell_redos == 2 and missing_records[-1]["twell_redos"] == 2
    for a, b in zip(records, missing_records, strict=True):
        assert a["loss"] == b["loss"] and a["active_mean"] == b["active_mean"], (a, b)


def test_late_sizes_train_the_steps_of_estimate_sizes_even_when_every_call_misses(
    offline_data, tmp_path, monkeypatch
):
    """train.twell_sizes=late: no forward reads its entry count back. With the estimate's capacities the
    run trains bit for bit the steps of the default (estimate); with capacities far too small every call
    after a layer's first misses, its outputs stay exact (the positives past the slots are read from the
    dense h) and its backward rebuilds the entries: the same steps to rounding."""
    import twell.kernels.training.train as kt

    def build(name, *more):
        extra = ("model.ffn_impl=twell", "train.compile=false", "train.global_batch_tokens=128", *more)
        return train.build_trainer(compose_job(tiny_overrides(offline_data, tmp_path / name, 3, *extra)))

    try:
        estimate = [r for r in build("estimate").fit() if "loss" in r]
        assert kt._settings["sizes"] == "estimate"
        late = [r for r in build("late", "train.twell_sizes=late").fit() if "loss" in r]
        assert kt._settings["sizes"] == "late"
        calls = []
        real = kt._forward
        monkeypatch.setattr(
            kt, "_forward", lambda *a, **k: calls.append(k.get("late", False)) or real(*a, **k)
        )
        monkeypatch.setattr(kt, "_with_margin", lambda nnz: max(nnz // 2, 1))  # half the slots needed
        missing = [r for r in build("missing", "train.twell_sizes=late").fit() if "loss" in r]
    finally:
        kt.set_sizes("estimate")
    assert calls.count(True) > 0 and calls.count(False) > calls.count(True)  # each late call rebuilt
    # the metrics count the rebuilt lists (process-wide, so far): none while the entries fit
    assert late[0]["twell_misses_rebuilt"] == late[-1]["twell_misses_rebuilt"]
    assert (
        missing[-1]["twell_misses_rebuilt"]
        > missing[0]["twell_misses_rebuilt"]
        >= late[-1]["twell_misses_rebuilt"]
    )
    for a, b, c in zip(estimate, late, missing, strict=True):
        assert a["loss"] == b["loss"] and a["active_mean"] == b["active_mean"], (a, b)
        assert c["loss"] == pytest.approx(a["loss"], rel=1e-5) and c["active_mean"] == a["active_mean"], (
            a,
            c,
        )


def test_compiled_blocks_are_checkpointed_plainly_where_torch_cannot_compile_the_policy(monkeypatch):
    """torch 2.11's inductor fails on a compiled block under the op's checkpoint policy: below
    SELECTIVE_CHECKPOINT_MIN_TORCH the trainer checkpoints compiled sparse blocks without a policy."""
    import twell.kernels.training.train as train_op
    from twell.model import ModelConfig, Transformer
    from twell.training.trainer import apply_block_wrappers

    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, d_ff=128, ffn_impl="twell")
    for supported, want in ((True, train_op.checkpoint_context), (False, None)):
        monkeypatch.setattr(train_op, "compiled_selective_checkpointing", lambda s=supported: s)
        model = Transformer(cfg)
        apply_block_wrappers(model, activation_checkpointing=True, compile_blocks=True)
        assert [block.checkpoint_fn.keywords.get("context_fn") for block in model.layers] == [want] * 2


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_checkpointed_sparse_blocks_do_not_run_the_ffn_forward_again(op_forward_calls, compiled):
    """train.activation_checkpointing=true with TwELL FFNs and compiled blocks: each block's recomputed
    forward takes the op's kept outputs (selective checkpointing), so the op runs once a layer per step;
    eager blocks are checkpointed plainly (the op runs again in the recomputation). The gradients are
    those of the model without checkpointing (compiled: to fp32 rounding, inductor fusing the ops around
    the op its own way). Compiled, a step on other tokens (other entry counts) compiles nothing anew."""
    import copy

    from twell.kernels.training.train import compiled_selective_checkpointing
    from twell.model import ModelConfig, Transformer
    from twell.training.trainer import apply_block_wrappers

    calls = op_forward_calls
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=3, n_heads=2, d_ff=128, ffn_impl="twell")
    plain = Transformer(cfg)
    checkpointed = copy.deepcopy(plain)
    apply_block_wrappers(checkpointed, activation_checkpointing=True, compile_blocks=compiled)
    tokens = torch.randint(0, 64, (2, 12))

    def grads(model, tokens=tokens):
        calls.clear()
        model.zero_grad(set_to_none=True)
        out = model(tokens)
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens.flatten()) + 0.1 * out.l1
        loss.backward()
        names = (name.replace("._checkpoint_wrapped_module", "") for name, _ in model.named_parameters())
        return len(calls), {name: p.grad for name, p in zip(names, model.parameters())}

    plain_calls, plain_grads = grads(plain)
    ckpt_calls, ckpt_grads = grads(checkpointed)
    selective = compiled and compiled_selective_checkpointing()
    assert plain_calls == cfg.n_layers and ckpt_calls == cfg.n_layers * (1 if selective else 2)
    assert plain_grads.keys() == ckpt_grads.keys()
    for name, grad in plain_grads.items():
        if compiled:
            torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max())
        else:
            assert torch.equal(grad, ckpt_grads[name]), name
    if compiled:
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert grads(checkpointed, torch.randint(0, 64, (2, 12)))[0] == cfg.n_layers


def test_a_block_training_forward_holds_no_in_place_op():
    """Selective checkpointing under torch.compile needs a checkpointed region without in-place ops (the
    trainer silences torch's warning about them on that ground): a block's training forward, dense and
    TwELL, runs none."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from twell.model import ModelConfig, Transformer

    class Mutations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.is_mutable:
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    for impl in ("dense", "twell"):
        model = Transformer(
            ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=2, d_ff=128, ffn_impl=impl)
        )
        x = torch.randn(2, 8, 64, requires_grad=True)
        with Mutations() as seen:
            model.layers[0](x, model.rope_cos[:8], model.rope_sin[:8])
        assert seen.ops == [], (impl, seen.ops)
