"""The config tree composes into validated dataclasses, and bad values stop the run at start."""

import re

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError
from trainer_helpers import compose_cfg, compose_job, run_cli, tiny_overrides, train

from twell.model import PRESETS, ModelConfig
from twell.training.config import JobConfig, TrainConfig


@pytest.mark.parametrize("preset", list(PRESETS))
def test_model_group_matches_the_presets(preset):
    assert compose_job([f"model={preset}", "train.seq_len=512"]).model == ModelConfig.preset(preset)


def test_paper_experiment_is_the_papers_recipe():
    job = compose_job(["experiment=paper_1.5b"])
    assert isinstance(job, JobConfig)
    m = job.model
    assert (m.d_model, m.n_layers, m.n_heads, m.d_ff, m.vocab_size, m.rope_theta) == (
        2048,
        28,
        32,
        5632,
        49152,
        1e5,
    )
    o = job.optim
    assert (o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.warmup_steps, o.schedule, o.min_lr_ratio) == (
        1e-3, 0.9, 0.95, 1e-8, 0.1, 600, "cosine", 0.0,
    )  # fmt: skip
    t = job.train
    assert (t.global_batch_tokens, t.seq_len, t.steps, t.grad_clip) == (1_048_576, 2048, 30_000, 1.0)
    assert t.grad_accum(world_size=8) == 8
    assert t.parallel == "ddp"
    s = job.sparsity
    assert (s.l1_coef, s.reinit_dead, s.reinit_lambda, s.reinit_sigma) == (2e-5, True, 0.1, 0.02)
    assert job.data.hf_name == "HuggingFaceTB/smollm-corpus"
    assert job.run_dir == "outputs/paper_1.5b"
    assert compose_job(["experiment=paper_1.5b", "sparsity=dense"]).sparsity.l1_coef == 0.0


@pytest.mark.parametrize("size", ["0.5b", "1b", "1.5b", "2b"])
def test_paper_experiments_launch_the_fast_path(size):
    """What a user launches takes the kernels where layers are sparse, compiles on a GPU and checkpoints
    activations only when the step would not fit; the dense twin is one override away."""
    job = compose_job([f"experiment=paper_{size}"])
    assert job.model.ffn_impl == "auto"
    assert (job.train.compile, job.train.activation_checkpointing) == ("auto", "auto")
    assert job.sparsity.dead_window_tokens == 1_048_576  # one paper step, whatever ours is
    # dead rows re-drawn by the Triton kernel on a GPU, by PyTorch elsewhere
    assert job.sparsity.reinit_kernel == "auto"
    assert job.sparsity.reinit_by_kernel(on_gpu=True) and not job.sparsity.reinit_by_kernel(on_gpu=False)
    assert compose_job([f"experiment=paper_{size}", "model.ffn_impl=dense"]).model.ffn_impl == "dense"


@pytest.mark.parametrize("given, stored", [("true", "true"), ("False", "false"), ("AUTO", "auto")])
def test_compile_and_checkpointing_take_auto_true_false_in_any_case(given, stored):
    job = compose_job(
        [
            f"train.compile={given}",
            f"train.activation_checkpointing={given}",
            f"sparsity.reinit_kernel={given}",
        ]
    )
    assert (job.train.compile, job.train.activation_checkpointing) == (stored, stored)
    assert job.sparsity.reinit_kernel == stored
    assert job.sparsity.reinit_by_kernel(on_gpu=False) == (stored == "true")
    assert job.sparsity.reinit_by_kernel(on_gpu=True) == (stored != "false")


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigCompositionException, match="3b") as err:
        compose_job(["model=3b"])
    assert "1.5b" in str(err.value.__cause__ or err.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.steps=many", "steps"),
        ("model.d_ff=5000", "d_ff=5000 must be a multiple of 64"),
        ("train.precision=fp8", "train.precision='fp8'"),
        ("optim.schedule=linear", "optim.schedule='linear'"),
        ("train.global_batch_tokens=1000", "global_batch_tokens=1000 is not a multiple"),
        ("train.seq_len=4096", "train.seq_len=4096 exceeds model.max_seq_len=2048"),
        ("logging.wandb_mode=maybe", "logging.wandb_mode='maybe'"),
        ("sparsity.reinit_lambda=2", "reinit_lambda=2"),
        ("sparsity.reinit_kernel=maybe", "sparsity.reinit_kernel='maybe' must be auto, true or false"),
        ("train.parallel=zero", "train.parallel='zero' is not one of \\('ddp', 'fsdp'\\)"),
        ("train.no_such_key=1", "no_such_key"),
        ("train.compile=sometimes", "train.compile='sometimes' must be auto, true or false"),
        (
            "train.activation_checkpointing=1",
            "train.activation_checkpointing='1' must be auto, true or false",
        ),
        ("train.fsdp_reshard_after_forward=2", "train.fsdp_reshard_after_forward='2' must be auto, true"),
        ("train.fsdp_prefetch=-1", "train.fsdp_prefetch=-1 must be >= 0"),
    ],
)
def test_bad_values_fail_with_a_message_naming_them(override, message):
    with pytest.raises((ValueError, ValidationError, ConfigCompositionException), match=message):
        compose_job(["model=1.5b", override])


def test_global_batch_must_split_over_processes():
    cfg = TrainConfig(global_batch_tokens=3 * 8 * 2048, micro_batch=8, seq_len=2048)
    assert cfg.grad_accum(world_size=3) == 1
    with pytest.raises(ValueError, match="does not divide into micro_batch \\* seq_len \\* world_size"):
        cfg.grad_accum(world_size=2)


def test_cli_prints_the_config_and_rejects_bad_values(tmp_path):
    shown = run_cli(["model=1.5b", "--cfg", "job"])
    assert shown.returncode == 0, shown.stderr
    for line in (
        "d_model: 2048",
        "n_layers: 28",
        "d_ff: 5632",
        "l1_coef: 2.0e-05",
        "global_batch_tokens: 1048576",
    ):
        assert line in shown.stdout
    bad = run_cli(["train.global_batch_tokens=1000", f"run_dir={tmp_path}"])
    assert bad.returncode == 2
    assert "error: train.global_batch_tokens=1000 is not a multiple" in bad.stderr


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.path=/nowhere/train-*.parquet", "/nowhere/train-\\*.parquet"),
        ("data.tokenizer=/nowhere/tokenizer", "/nowhere/tokenizer"),
        (
            "checkpoint.resume=/nowhere/step_00000010",
            "checkpoint.resume=/nowhere/step_00000010 is not a folder",
        ),
        ("model.vocab_size=1024", "set model.vocab_size=4096"),
    ],
)
def test_bad_paths_end_the_run_with_the_message(offline_data, tmp_path, capsys, override, message):
    assert train.run(compose_cfg([*tiny_overrides(offline_data, tmp_path, 1), override])) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and re.search(message, error), error


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU where none is")
def test_asking_for_a_missing_gpu_ends_the_run_with_the_message(offline_data, tmp_path, capsys):
    assert train.run(compose_cfg([*tiny_overrides(offline_data, tmp_path, 1), "train.device=cuda"])) == 2
    error = capsys.readouterr().err
    assert (
        error.startswith("error: train.device=cuda but no CUDA GPU is visible")
        and "train.device=auto" in error
    )


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "+optim.lrr=1",
            "unknown config key 'optim.lrr': optim has no field 'lrr'; the valid names are lr, ",
        ),
        (
            "+foo=1",
            "unknown config key 'foo': the root config has no field 'foo'; the valid names are model, ",
        ),
        ("+model.dmodel=256", "unknown config key 'model.dmodel'.*d_model"),
    ],
)
def test_unknown_keys_are_refused_with_the_valid_names(override, message):
    # Hydra's `+key=value` adds the key to the typed node anyway; OmegaConf.to_object would then set
    # it as a plain attribute and the run would go on without it.
    with pytest.raises(ValueError, match=message):
        compose_job(["experiment=quickstart", override])


def test_cli_refuses_an_unknown_key(tmp_path):
    bad = run_cli(["experiment=quickstart", "+optim.lrr=1", f"run_dir={tmp_path}"])
    assert bad.returncode == 2, bad.stderr
    assert "error: unknown config key 'optim.lrr'" in bad.stderr
    assert not any(tmp_path.iterdir())  # nothing recorded for a launch that was refused


@pytest.mark.parametrize(
    "overrides, fix",
    [
        (["train.parallel=fsdp"], "Set train.parallel=ddp .*or keep fsdp with train.cuda_graph=false"),
        (["train.compile=true"], "Set train.compile=false .*or train.cuda_graph=false to compile each block"),
        (["train.activation_checkpointing=true"], "Set train.activation_checkpointing=auto .*plan_memory"),
        (["train.device=cpu"], "set train.cuda_graph=false or train.device=auto"),
        (
            ["train.twell_graphs=true"],
            "Set train.twell_graphs=false, or train.cuda_graph=false for the per-layer",
        ),
    ],
)
def test_combinations_that_cannot_work_are_refused_naming_what_works(overrides, fix):
    """CUDA graphs capture the eager step of one process or DDP on a GPU: anything else is refused while
    the config is read (before anything is built), with the setting that works."""
    with pytest.raises(ValueError, match=f"train.cuda_graph=true (does not combine with|needs).*{fix}"):
        compose_job(["model=1.5b", "train.cuda_graph=true", *overrides])
    compose_job(["model=1.5b", "train.cuda_graph=true"])  # alone it is fine


def test_op_graphs_with_deferred_sizes_are_refused_naming_what_works():
    """The TwELL op's per-layer graphs replay only layers sized from their count read back: with
    deferred sizes they would never run, so the pair is refused; each alone is taken."""
    with pytest.raises(
        ValueError,
        match="train.twell_graphs=true does not combine with train.twell_sizes=deferred.*"
        "Set train.twell_sizes=estimate, or train.twell_graphs=false",
    ):
        compose_job(["model=1.5b", "train.twell_graphs=true", "train.twell_sizes=deferred"])
    for one in ("train.twell_graphs=true", "train.twell_sizes=deferred"):
        compose_job(["model=1.5b", one])
