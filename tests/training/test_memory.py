"""The step's memory estimate (training/memory.py) and train.activation_checkpointing=auto."""

import pytest
import torch
from trainer_helpers import compose_job

from twell.model import ModelConfig
from twell.training.memory import (
    GIB,
    choose_activation_checkpointing,
    estimate_training_memory,
    job_settings,
    root_params,
)
from twell.training.trainer import resolve_block_wrappers

PAPER_1P5B = ModelConfig.preset("1.5b")


def estimate(cfg=PAPER_1P5B, **kw):
    kw = {"activation_checkpointing": False, "sparse_ffn": False, **kw}
    return estimate_training_memory(cfg, 8, 2048, **kw)


def test_state_is_sixteen_bytes_a_parameter_and_fsdp_shards_it():
    whole = estimate()
    assert whole.params == whole.grads == 4 * PAPER_1P5B.num_params()
    assert whole.optimizer == 2 * whole.params
    sharded = estimate(world_size=8, sharded=True)
    assert sharded.params == whole.params // 8 and sharded.activations == whole.activations


def test_compute_weights_and_gradients_under_each_parallel_mode():
    """bf16 autocast keeps a bf16 copy of every weight; FSDP2 gathers the root in fp32 (plus the head's
    bf16 cast) and the blocks at the peak in bf16; DDP's gradients are views into its all-reduce buckets
    (held twice without them: train.cuda_graph); FSDP2 accumulating over micro-batches holds unsharded fp32
    gradients."""
    n, layers = PAPER_1P5B.num_params(), PAPER_1P5B.n_layers
    root = root_params(PAPER_1P5B)
    assert root == 49152 * 2048 + 2048
    block = (n - root) // layers
    plain = estimate()
    assert plain.compute_weights == 2 * n and estimate(bf16=False).compute_weights == 0
    assert estimate(world_size=8).grads == plain.grads  # DDP: .grad is a view into the all-reduce buckets
    assert estimate(world_size=8, bucket_views=False).grads == 2 * plain.grads  # .grad and the buckets
    fsdp = estimate(world_size=8, sharded=True)
    head_cast = 2 * 49152 * 2048
    assert fsdp.compute_weights == 4 * root + head_cast + 2 * 2 * block  # the block computed, one prefetched
    assert fsdp.grads == 4 * n // 8
    kept = estimate(world_size=8, sharded=True, reshard_after_forward="false")
    assert kept.compute_weights == 4 * root + head_cast + 2 * layers * block
    one_rank = estimate(world_size=1, sharded=True)  # auto keeps every block gathered on one rank
    assert one_rank.compute_weights == kept.compute_weights
    assert (
        estimate(world_size=1, sharded=True, reshard_after_forward="true").compute_weights
        == fsdp.compute_weights
    )
    assert (
        estimate(world_size=8, sharded=True, prefetch=2).compute_weights == fsdp.compute_weights + 2 * block
    )
    assert estimate(world_size=8, sharded=True, prefetch=0).compute_weights == fsdp.compute_weights
    accumulating = estimate(world_size=8, sharded=True, grad_accum=4)
    assert accumulating.grads == fsdp.grads + 4 * n
    assert "compute_weights" in fsdp.describe()


def test_job_settings_follow_the_train_config():
    job = compose_job(["experiment=paper_0.5b", "train.parallel=fsdp", "train.fsdp_reshard_after_forward=false",
                       "train.fsdp_prefetch=2", "train.precision=fp32", "model.ffn_impl=twell"])  # fmt: skip
    settings = job_settings(job, 2, True)
    assert settings == {
        "sparse_ffn": True, "world_size": 2, "sharded": True, "bf16": False,
        "grad_accum": job.train.grad_accum(2), "reshard_after_forward": "false", "prefetch": 2,
        "keep_ffn_state": True, "compiled": True, "bucket_views": True,
    }  # fmt: skip
    eager = compose_job(["experiment=paper_0.5b", "train.compile=false"])
    assert job_settings(eager, 1, False)["keep_ffn_state"] is False
    graphed = compose_job(["experiment=paper_0.5b", "train.compile=false", "train.cuda_graph=true"])
    assert job_settings(graphed, 2, False)["bucket_views"] is False  # the graph keeps its own gradients


def test_compiled_blocks_keep_no_ffn_state_where_torch_cannot_compile_the_policy(monkeypatch):
    """Below SELECTIVE_CHECKPOINT_MIN_TORCH compiled blocks are checkpointed plainly: nothing kept."""
    import twell.training.memory as memory

    job = compose_job(["experiment=paper_0.5b", "train.compile=true", "model.ffn_impl=twell"])
    assert job_settings(job, 1, False)["keep_ffn_state"] is True  # the test environment's torch >= 2.12.1
    monkeypatch.setattr(memory, "compiled_selective_checkpointing", lambda: False)
    assert job_settings(job, 1, False)["keep_ffn_state"] is False


def test_activations_follow_the_layers_the_tokens_and_the_ffn():
    dense, sparse = estimate(), estimate(sparse_ffn=True)
    assert sparse.activations < dense.activations
    # The dense FFN saves g, u and h (3 x 2 bytes a unit, d_ff 5632) per token and layer; TwELL ~nothing.
    ffn_share = (dense.activations - sparse.activations) / (PAPER_1P5B.n_layers * 8 * 2048)
    assert 5.5 * 5632 < ffn_share < 7 * 5632
    deeper = estimate(ModelConfig.preset("2b"))
    assert deeper.activations / dense.activations == pytest.approx(38 / 28)
    checkpointed = estimate(activation_checkpointing=True)
    assert checkpointed.activations < dense.activations / 5 and checkpointed.logits == dense.logits
    assert "GiB at the end of the forward pass (params" in dense.describe()


def _saved_bytes_per_token(block, cfg, batch: int, seq: int) -> float:
    """Bytes a Block's forward saves for its backward pass per token (bf16 autocast, CPU), counted by a
    saved-tensors hook over distinct storages of the tensors laid out over the batch's tokens ([B, ...] or
    [B * S, ...]): not the weights' bf16 casts (the planner's compute_weights), the RoPE tables, nor the
    TwELL op's entry list and row offsets (its sparse state, sized by activity). The second of two steps:
    a compiled block is compiled by the first."""
    from twell.model.layers import rope_cos_sin

    cos, sin = rope_cos_sin(cfg.head_dim, seq, cfg.rope_theta, device="cpu")
    saved: dict = {}

    def pack(t):
        if t.dim() and t.shape[0] in (batch, batch * seq):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for _ in range(2):
        saved.clear()
        x = torch.randn(batch, seq, cfg.d_model, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y, l1, _ = block(x, cos, sin)
        torch.autograd.backward([y, l1], [torch.randn_like(y), torch.ones_like(l1)])  # no loss ops saving
    return sum(saved.values()) / (batch * seq)


@pytest.mark.parametrize("ffn, checkpointing", [("dense", False), ("twell", False), ("twell", True)])
def test_compiled_block_saves_what_the_planner_counts(ffn, checkpointing):
    """The planner's compiled rows are what inductor's partitioner keeps for a Block (memory.py,
    block_bytes_besides_sparse_state), measured on the CPU with the TwELL kernels interpreted; the same
    model matches the H200's compiled peaks (test_compiled_rows_fit_the_measured_h200_peaks). A torch whose
    partitioner saves otherwise fails here: refit the planner. Checkpointed as the trainer wraps it (a
    TwELL block selectively, torch >= 2.12.1), a compiled block keeps its fp32 input (4 d) besides the
    op's sparse state, not the op's output (estimate_training_memory's checkpointed rows)."""
    from twell.model.transformer import Block
    from twell.training.memory import block_bytes_besides_sparse_state
    from twell.training.trainer import apply_block_wrappers

    cfg = ModelConfig(d_model=128, n_heads=2, d_ff=192, n_layers=1, max_seq_len=64, ffn_impl=ffn)
    batch, seq = 2, 24  # 48 tokens: no dimension of a weight, nor the entry count
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block(cfg)])
    apply_block_wrappers(model, activation_checkpointing=checkpointing, compile_blocks=True)
    measured = _saved_bytes_per_token(model.layers[0], cfg, batch, seq)
    sparse = ffn == "twell"
    if checkpointing:
        assert measured == 4 * cfg.d_model
        return
    assert measured == block_bytes_besides_sparse_state(cfg, sparse, compiled=True)
    assert measured < 0.8 * block_bytes_besides_sparse_state(cfg, sparse)  # eager saves more


def test_compiled_rows_fit_the_measured_h200_peaks():
    """Compiled trainer steps on an H200 (micro-batch 8 x 2048, 16k-token steps, one process; allocated
    peaks from docs/RESULTS.md "Compiled blocks") against the compiled plan without its reserve: within 5%,
    where the eager model overshot by 13-27%."""
    measured = {("0.5b", False): 26.2, ("0.5b", True): 23.2, ("1.5b", False): 61.2, ("1.5b", True): 49.2}
    for (model, sparse), gib in measured.items():
        cfg = ModelConfig.preset(model)
        kw = dict(activation_checkpointing=False, sparse_ffn=sparse)
        compiled = estimate_training_memory(cfg, 8, 2048, compiled=True, **kw)
        eager = estimate_training_memory(cfg, 8, 2048, **kw)
        assert (compiled.total - compiled.reserve) / GIB == pytest.approx(gib, rel=0.05), (model, sparse)
        assert (eager.total - eager.reserve) / GIB > 1.1 * gib


def test_the_peak_is_the_larger_of_the_forward_and_backward_moments():
    """Logits and the gradients freed by zero_grad are never alive together: the end of the forward pass
    holds the saved activations and the logits, the backward pass every gradient and (checkpointing) the
    block being recomputed; gradients held through the forward (accumulation, DDP's buckets) add to it."""
    plain = estimate()
    held = plain.params + plain.optimizer + plain.compute_weights + plain.reserve
    assert plain.grads_in_forward == 0 and plain.recompute == 0
    assert plain.total == held + plain.activations + plain.logits
    checkpointed = estimate(activation_checkpointing=True)
    assert checkpointed.recompute > 0
    assert checkpointed.total == held + max(
        checkpointed.activations + checkpointed.logits,
        checkpointed.grads + checkpointed.activations + checkpointed.recompute,
    )
    accumulating = estimate(grad_accum=4)
    assert accumulating.grads_in_forward == accumulating.grads
    assert accumulating.total == plain.total + accumulating.grads
    # DDP's buckets are kept through the forward; .grad is freed (or is a view into them)
    for bucket_views in (True, False):
        ddp = estimate(world_size=8, bucket_views=bucket_views)
        assert ddp.grads_in_forward == 4 * PAPER_1P5B.num_params()
        assert ddp.total == plain.total + ddp.grads_in_forward
    # A tiny vocabulary and micro-batch: the backward moment (every gradient) is the larger one.
    small = estimate_training_memory(
        ModelConfig(vocab_size=256, d_model=512, n_layers=2, n_heads=8, d_ff=1024), 1, 16,
        activation_checkpointing=False, sparse_ffn=False,
    )  # fmt: skip
    assert small.backward_peak > small.forward_peak and "backward pass" in small.describe()


def test_checkpointing_goes_on_only_when_the_step_does_not_fit():
    need = estimate().total
    on, without, with_ac = choose_activation_checkpointing(
        PAPER_1P5B, 8, 2048, int(need / 0.8), sparse_ffn=False
    )
    assert not on and without.total == need and with_ac.total < need
    on, *_ = choose_activation_checkpointing(PAPER_1P5B, 8, 2048, int(need), sparse_ffn=False)
    assert on  # 90% of the device is the bound
    # A sparse FFN saves enough to fit where the dense one does not.
    sparse_need = estimate(sparse_ffn=True).total
    device = int((need + sparse_need) / 2 / 0.9)
    assert choose_activation_checkpointing(PAPER_1P5B, 8, 2048, device, sparse_ffn=True)[0] is False
    assert choose_activation_checkpointing(PAPER_1P5B, 8, 2048, device, sparse_ffn=False)[0] is True
    assert 60 * GIB < need < 100 * GIB  # eager upper bound; H200 measured 61.2 GiB compiled


def test_auto_wrappers_on_the_cpu_are_off_and_explicit_values_win():
    cpu = torch.device("cpu")
    job = compose_job(["experiment=paper_0.5b"])
    assert resolve_block_wrappers(job, cpu, 1, False) == (False, False)
    forced = compose_job(
        ["experiment=paper_0.5b", "train.compile=true", "train.activation_checkpointing=true"]
    )
    assert resolve_block_wrappers(forced, cpu, 1, False) == (True, True)


def test_plan_memory_script_prints_the_plan_and_the_auto_choice(tmp_path, capsys):
    """scripts/plan_memory.py on the paper's 1.5B: compiled (the GPU default), an 80 GiB GPU fits the dense
    start without activation checkpointing, eager it does not, nor compiled on 64 GiB; checkpointing and the
    sparse FFN both fit larger micro-batches; FSDP2 over 8 GPUs shards the 16 bytes a parameter."""
    import json

    import plan_memory  # scripts/, on sys.path through tests/conftest.py

    def plan(*args):
        out = tmp_path / "plan.json"
        assert plan_memory.main(["experiment=paper_1.5b", *args, "--json", str(out)]) == 0
        return json.loads(out.read_text()), capsys.readouterr().out

    h100, text = plan("--gpu-gib", "80")
    assert h100["compiled"] is True and h100["auto_activation_checkpointing"] is False
    assert "compiled blocks" in text and "train.activation_checkpointing=auto: off" in text
    eager, text = plan("--gpu-gib", "80", "train.compile=false")
    assert eager["auto_activation_checkpointing"] is True and "eager blocks" in text
    assert "train.activation_checkpointing=auto: on" in text and "| dense | off |" in text
    assert plan("--gpu-gib", "64")[0]["auto_activation_checkpointing"] is True
    large, text = plan("--gpu-gib", "141")
    assert large["auto_activation_checkpointing"] is False and "auto: off" in text
    rows = {(r["ffn"], r["activation_checkpointing"]): r for r in large["rows"]}
    accum = compose_job(["experiment=paper_1.5b"]).train.grad_accum(1)  # 1M-token steps: .grad held
    assert accum > 1
    assert rows[("dense", False)]["total_gib"] == pytest.approx(
        estimate(grad_accum=accum, compiled=True).total / GIB
    )
    mb = {key: r["largest_micro_batch"] for key, r in rows.items()}
    assert mb[("dense", True)] > mb[("dense", False)] >= 8 and mb[("twell", False)] > mb[("dense", False)]
    kw = dict(activation_checkpointing=False, sparse_ffn=False, grad_accum=accum, compiled=True)
    fitted = estimate_training_memory(PAPER_1P5B, mb[("dense", False)], 2048, **kw)
    over = estimate_training_memory(PAPER_1P5B, mb[("dense", False)] + 1, 2048, **kw)
    assert fitted.total <= 0.9 * 141 * GIB < over.total
    sharded, _ = plan("--gpu-gib", "80", "--world-size", "8", "--parallel", "fsdp")
    assert sharded["rows"][0]["params"] == pytest.approx(large["rows"][0]["params"] / 8, rel=1e-6)


def test_plan_memory_refuses_bad_values(capsys):
    import plan_memory

    with pytest.raises(SystemExit):
        plan_memory.main(["model=1.5b", "--world-size", "0"])
    assert "--world-size=0 must be >= 1" in capsys.readouterr().err
    for gib in ("0", "-40"):  # 0 once fell back to the default 80 GiB and planned for that
        with pytest.raises(SystemExit):
            plan_memory.main(["model=1.5b", "--gpu-gib", gib])
        assert f"--gpu-gib={gib} must be > 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="train.micro_batch"):
        plan_memory.main(["model=1.5b", "train.micro_batch=0"])


def test_sparse_state_follows_the_hot_units_and_checkpointing_keeps_it():
    """The TwELL state is the hot units' gate and up values (from 16,384 tokens a micro-batch, as the
    kernels choose them) plus the active entries; a checkpointed compiled TwELL block keeps its FFN's
    sparse state (selective checkpointing), an eager one nothing but its input."""
    from twell.kernels.inference import inference
    from twell.training import memory

    assert (memory.HOT_MIN_TOKENS, memory.DEFAULT_HOT_UNITS) == (
        inference.HOT_MIN_TOKENS, inference.DEFAULT_HOT_UNITS
    )  # fmt: skip
    assert memory.hot_units(PAPER_1P5B, 16384) == 1024 and memory.hot_units(PAPER_1P5B, 8192) == 0
    per_token, per_layer = memory.sparse_ffn_state_bytes(PAPER_1P5B, 16384)
    assert per_token == 4 * 1024 + 14 * 29 + 8 and per_layer == 6 * 1024 * 2048
    assert memory.sparse_ffn_state_bytes(PAPER_1P5B, 8192)[1] == 0
    small = estimate_training_memory(PAPER_1P5B, 4, 2048, activation_checkpointing=False, sparse_ffn=True)
    assert small.activations < estimate(sparse_ffn=True).activations / 2  # no hot units under 16k tokens
    layers, tokens = PAPER_1P5B.n_layers, 8 * 2048
    for sparse in (False, True):
        for keep in (False, True):
            full = estimate(activation_checkpointing=True, sparse_ffn=sparse, keep_ffn_state=keep)
            kept = 4 * 2048 * tokens + (per_token * tokens + per_layer if sparse and keep else 0)
            assert full.activations == layers * kept


def test_fsdp_auto_reshards_every_block_but_the_last_on_several_ranks_and_none_on_one():
    """On one rank a gather is a bf16 cast of the whole model and resharding frees nothing that a plain
    run keeps; the planner counts the gathered blocks that the sharding holds."""
    from twell.training.distributed import fsdp_block_reshards
    from twell.training.memory import fsdp_gathered_blocks

    assert fsdp_block_reshards(4, "auto", 2) == [True, True, True, False]
    assert fsdp_block_reshards(4, "auto", 1) == [False] * 4
    assert (
        fsdp_block_reshards(4, "true", 1) == [True] * 4 and fsdp_block_reshards(4, "false", 8) == [False] * 4
    )
    assert fsdp_gathered_blocks(4, "auto", 1, 1) == 4 and fsdp_gathered_blocks(4, "auto", 1, 2) == 2
    assert fsdp_gathered_blocks(4, "true", 1, 1) == 2 and fsdp_gathered_blocks(4, "false", 1, 8) == 4
