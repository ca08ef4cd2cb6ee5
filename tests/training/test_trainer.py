"""The training loop on the offline sample: loss falls, checkpoints resume bit-exactly (also after a
SIGTERM, and under FSDP2), a corrupt checkpoint is refused for the previous one, and 2 DDP or 2
FSDP2 processes match 1."""

import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp
from trainer_helpers import ROOT, compose_job, run_cli, run_job, tiny_overrides, train

from twell.training.checkpoint import MARKER, Checkpointer, CheckpointError
from twell.training.distributed import DistInfo


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference_run(offline_data, tmp_path_factory):
    """12 unbroken steps of the sparse recipe with a strong L1 and a 512-token dead window (two steps), so
    dead units get re-initialised; a checkpoint every 4 steps, all kept."""
    run_dir = tmp_path_factory.mktemp("reference")
    overrides = tiny_overrides(
        offline_data, run_dir, 12,
        "sparsity=paper", "sparsity.l1_coef=0.05", "sparsity.dead_window_tokens=512", "checkpoint.interval=4",
        "checkpoint.keep_last=0",
    )  # fmt: skip
    return overrides, run_dir, run_job(overrides)


def test_loss_falls_on_the_sample(offline_data, tmp_path):
    records = run_job(tiny_overrides(offline_data, tmp_path, 40, "logging.log_interval=5"))
    first, last = records[0], records[-1]
    assert first["ce"] > 7.5  # ~ln(4096) = 8.3 at initialisation
    assert last["ce"] < first["ce"] - 1.5, [r["ce"] for r in records]
    assert all(0 < r["lr"] <= 3e-3 for r in records)
    assert records[-1]["mfu"] is None  # no MFU on CPU
    logged = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in logged] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert len(logged[0]["active_mean"]) == 2 and len(logged[0]["dead_frac"]) == 2


def test_prefetch_thread_gives_the_same_losses_and_logs_data_wait(offline_data, tmp_path):
    """data.prefetch makes the batches on a background thread (0: on the training thread): the same
    losses; every logging window reports data_wait_s, the seconds the loop waited for data."""
    plain = run_job(tiny_overrides(offline_data, tmp_path / "plain", 4, "data.prefetch=0"))
    ahead = run_job(tiny_overrides(offline_data, tmp_path / "ahead", 4, "data.prefetch=3"))
    assert losses(ahead) == losses(plain)
    assert all(r["data_wait_s"] >= 0 for r in plain + ahead if "loss" in r)


def test_row_group_lanes_with_prefetch_resume_bit_identically(offline_data, tmp_path):
    """data.sharding=files behind the prefetch thread: a run resumed from a mid-run checkpoint (queued
    batches and lane positions saved with it) continues with the unbroken run's losses."""
    extra = ("data.sharding=files", "data.prefetch=2", "data.shuffle_buffer=16", "checkpoint.interval=3")
    ref_dir = tmp_path / "unbroken"
    reference = losses(run_job(tiny_overrides(offline_data, ref_dir, 6, *extra, "checkpoint.keep_last=0")))
    step_3 = ref_dir / "checkpoints" / "step_00000003"
    shutil.copytree(step_3, tmp_path / "resumed" / "checkpoints" / step_3.name)
    resumed = losses(run_job(tiny_overrides(offline_data, tmp_path / "resumed", 6, *extra)))
    assert list(resumed) == [4, 5, 6]
    assert all(resumed[step] == reference[step] for step in resumed), (resumed, reference)


def test_resume_gives_bit_identical_losses(reference_run, tmp_path):
    overrides, ref_dir, ref_records = reference_run
    assert sum(sum(r["reinit_units"]) for r in ref_records) > 0, "the test needs dead-unit re-inits"
    # A fresh run dir that only holds the step-4 checkpoint of the reference run.
    shutil.copytree(ref_dir / "checkpoints" / "step_00000004", tmp_path / "checkpoints" / "step_00000004")
    resumed = run_job([*overrides, f"run_dir={tmp_path}"])
    assert [r["step"] for r in resumed] == list(range(5, 13))
    reference = losses(ref_records)
    for step, loss in losses(resumed).items():
        assert loss == reference[step], f"step {step}: resumed {loss!r} != unbroken {reference[step]!r}"


def test_reinit_kernel_trains_and_redraws_the_dead_rows(reference_run, tmp_path, monkeypatch):
    """sparsity.reinit_kernel=true: the dead rows are re-drawn by kernels/reinit.py (Triton's interpreter
    here) where the reference (auto on a CPU: PyTorch's draw) draws the whole matrix: the same steps until
    its first re-init (same dead units, other noise after it), re-inits counted as before, a finite loss;
    true is refused where no kernel can run, auto is not."""
    overrides, _, ref_records = reference_run
    overrides = [o for o in overrides if not o.startswith(("run_dir=", "train.steps="))]
    got = run_job(
        [*overrides, f"run_dir={tmp_path / 'kernel'}", "train.steps=12", "sparsity.reinit_kernel=true"]
    )
    first = next(i for i, r in enumerate(ref_records) if sum(r["reinit_units"]))
    assert first < 11, "the test needs a re-init before the last step"
    for ref, new in zip(ref_records[: first + 1], got):
        assert new["loss"] == ref["loss"] and new["reinit_units"] == ref["reinit_units"], new["step"]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in got)
    assert got[first + 1]["loss"] != ref_records[first + 1]["loss"]  # other noise from the first re-init on
    import twell.training.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "interpreting", lambda: False)
    with pytest.raises(
        ValueError, match="sparsity.reinit_kernel=true runs a Triton kernel, which needs a CUDA"
    ):
        train.build_trainer(
            compose_job([*overrides, f"run_dir={tmp_path / 'cpu'}", "sparsity.reinit_kernel=true"])
        )
    auto = train.build_trainer(compose_job([*overrides, f"run_dir={tmp_path / 'auto'}"]))
    assert auto.job.sparsity.reinit_kernel == "auto"


def test_activation_checkpointing_resumes_a_plain_checkpoint_exactly(reference_run, tmp_path):
    # Recomputing each block in the backward pass changes no number, and the wrapper keeps the
    # parameter names, so a checkpoint written without it loads into a run with it.
    overrides, ref_dir, ref_records = reference_run
    shutil.copytree(ref_dir / "checkpoints" / "step_00000008", tmp_path / "checkpoints" / "step_00000008")
    resumed = run_job([*overrides, f"run_dir={tmp_path}", "train.activation_checkpointing=true"])
    reference = losses(ref_records)
    assert losses(resumed) == {step: reference[step] for step in range(9, 13)}


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(reference_run, tmp_path, caplog):
    overrides, ref_dir, _ = reference_run
    for step in (8, 12):
        name = f"step_{step:08d}"
        shutil.copytree(ref_dir / "checkpoints" / name, tmp_path / name)
    # A bit flip in the newest checkpoint's tensor data (same size: only the CRC can tell).
    data_file = next((tmp_path / "step_00000012").glob("*.distcp"))
    blob = bytearray(data_file.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data_file.write_bytes(bytes(blob))
    (tmp_path / "step_00000016.tmp").mkdir()  # a save that was killed half-way

    job = compose_job([*overrides, f"run_dir={tmp_path}"])
    trainer = train.build_trainer(job)
    checkpointer = Checkpointer(tmp_path, keep_last=0, info=trainer.info)
    with caplog.at_level("WARNING"):
        path, state, _ = checkpointer.load_latest(trainer.model, trainer.optimizer, trainer._trainer_state())
    assert path.name == "step_00000008" and state["step"] == 8
    assert "fails its CRC32 check" in caplog.text

    # With the previous one truncated as well, nothing is usable: an error, not a silent restart.
    (tmp_path / "step_00000008" / "rank_00000.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no usable checkpoint .* has 0 bytes"):
        checkpointer.load_latest(trainer.model, trainer.optimizer, trainer._trainer_state())


def test_a_checkpoint_without_a_newer_trainer_entry_still_resumes(reference_run, tmp_path):
    """The trainer's state grows entries over time (the re-draw clock came after the fire clock): a
    checkpoint written before one existed loads everything it holds, and the entry it lacks is left out
    for its owner's fallback, not an error."""
    overrides, ref_dir, _ = reference_run
    trainer = train.build_trainer(compose_job([*overrides, f"run_dir={tmp_path}"]))
    checkpointer = Checkpointer(tmp_path, keep_last=0, info=trainer.info)
    template = trainer._trainer_state()
    template["tracker"]["a_later_clock"] = torch.zeros(3)
    state, _ = checkpointer.load(
        ref_dir / "checkpoints" / "step_00000008", trainer.model, trainer.optimizer, template
    )
    assert state["step"] == 8 and "a_later_clock" not in state["tracker"]
    assert state["tracker"]["tokens_since_reinit"].sum() > 0  # what the checkpoint holds is read
    assert set(state["tracker"]) == {"tokens_since_fire", "tokens_since_reinit", "dead"}


def test_partial_checkpoint_is_refused_with_its_reason(tmp_path):
    (tmp_path / "step_00000003").mkdir()
    checkpointer = Checkpointer(tmp_path, 1, DistInfo(0, 0, 1, torch.device("cpu")))
    with pytest.raises(CheckpointError, match=f"no {MARKER}: it is partial"):
        checkpointer.verify(tmp_path / "step_00000003")


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_saves_and_the_resumed_run_matches_the_unbroken_one(reference_run, tmp_path, stop):
    # SIGTERM (preemption) and a first Ctrl-C (SIGINT) both save a checkpoint and exit cleanly.
    overrides, _, ref_records = reference_run
    # Many steps, so the signal surely lands mid-run; the LR schedule spans train.steps, so the
    # resumed run below continues with the same steps setting and is cut back by comparing steps.
    cli = [*overrides, f"run_dir={tmp_path}"]
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *cli],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert process.poll() is None and time.time() < deadline, process.communicate()[0]
        time.sleep(0.05)
    process.send_signal(stop)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output
    assert f"{stop.name}: stopping at step" in output and "Traceback" not in output, output
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    stopped_at = int(saved[-1].name.split("_")[1])
    assert 2 <= stopped_at < 12 and (saved[-1] / MARKER).is_file(), output

    resumed = run_job(cli)
    reference = losses(ref_records)
    assert [r["step"] for r in resumed] == list(range(stopped_at + 1, 13))
    for step, loss in losses(resumed).items():
        assert loss == reference[step], f"step {step}: resumed {loss!r} != unbroken {reference[step]!r}"
    # The JSONL reads as one run: the killed run's records up to the checkpoint, then the resumed ones.
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 13))


def test_a_second_sigint_quits_at_once(offline_data, tmp_path):
    trainer = train.build_trainer(compose_job(tiny_overrides(offline_data, tmp_path, 2)))
    trainer._on_stop_signal(signal.SIGINT, None)  # the first: stop after this step, with a checkpoint
    assert trainer.stop_requested and trainer.stop_signal == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
        trainer._on_stop_signal(signal.SIGINT, None)


@pytest.fixture(scope="module")
def parallel_runs(reference_run, tmp_path_factory):
    """The reference recipe on 2 processes (torchrun, gloo) under DDP and under FSDP2: 12 steps of 512
    tokens, i.e. 2 micro-batches per rank per step (4 in one process), so gradients first accumulate
    without a sync; dead units are re-initialised from step 10; a checkpoint at 6 and 12, validation
    at 6 and 12."""
    overrides = [
        *reference_run[0], "train.global_batch_tokens=512", "checkpoint.interval=6", "eval.interval=6",
        "eval.val_batches=1",
    ]  # fmt: skip
    runs = {}
    for parallel in ("ddp", "fsdp"):
        run_dir = tmp_path_factory.mktemp(parallel)
        done = run_cli([*overrides, f"train.parallel={parallel}", f"run_dir={run_dir}"], torchrun=2)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[parallel] = {
            "dir": run_dir,
            "records": read_jsonl(run_dir / "metrics.jsonl"),
            "out": done.stdout,
            "err": done.stderr,
        }
    return overrides, runs


def test_two_ddp_and_two_fsdp_processes_match_one(parallel_runs, tmp_path):
    overrides, runs = parallel_runs
    assert "(fp32, DDP), grad_accum 2" in runs["ddp"]["out"]
    assert "(fp32, FSDP2), grad_accum 2" in runs["fsdp"]["out"]
    assert "broadcast_buffers" not in runs["ddp"]["err"]  # no deprecation warning on every rank
    one = {r["step"]: r for r in run_job([*overrides, f"run_dir={tmp_path}"])}  # grad_accum 4
    assert sum(sum(r["reinit_units"]) for r in one.values()) > 0, "the test needs dead-unit re-inits"
    for parallel, run in runs.items():
        logged = {r["step"]: r for r in run["records"] if "loss" in r}
        assert sorted(logged) == list(range(1, 13))
        for step, want in one.items():
            got = logged[step]
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (parallel, step)
            # The global norm (over both ranks' shards under FSDP2), fp32 sums in another order.
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (parallel, step)
            assert got["reinit_units"] == want["reinit_units"], (parallel, step)
    # Validation runs the sharded model's forward on every rank (each evaluates its own batches).
    val = {p: [r["val_loss"] for r in run["records"] if "val_loss" in r] for p, run in runs.items()}
    assert len(val["fsdp"]) == 2 and val["fsdp"] == pytest.approx(val["ddp"], rel=1e-5)


def test_fsdp_resume_gives_bit_identical_losses(parallel_runs, tmp_path):
    # The step-6 checkpoint of the FSDP2 run, resumed by 2 FSDP2 processes with activation
    # checkpointing on (the per-block wrapper goes on before fully_shard; it changes no number).
    overrides, runs = parallel_runs
    fsdp = runs["fsdp"]
    shutil.copytree(fsdp["dir"] / "checkpoints" / "step_00000006", tmp_path / "checkpoints" / "step_00000006")
    cli = [*overrides, "train.parallel=fsdp", "train.activation_checkpointing=true", f"run_dir={tmp_path}"]
    done = run_cli(cli, torchrun=2)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = losses(fsdp["records"])
    assert losses(read_jsonl(tmp_path / "metrics.jsonl")) == {step: reference[step] for step in range(7, 13)}


def test_one_rank_fsdp_gathers_once_a_step_and_trains_as_gathering_every_micro_batch(offline_data, tmp_path):
    """FSDP2 on one rank (auto: no block reshards) keeps the blocks and the root gathered from one
    micro-batch to the next and reshards after the step's last backward: one gather a step instead of one
    a micro-batch, and the very losses of a run that gathers again for every forward and backward (a
    gathered copy left stale by the optimizer step would move them)."""
    from torch.distributed.tensor import DTensor

    from twell.training.distributed import destroy

    steps, micro_batches = 3, 4

    def run(name, *extra):
        job = compose_job(tiny_overrides(
            offline_data, tmp_path / name, steps, "train.parallel=fsdp", "train.global_batch_tokens=512", *extra
        ))  # fmt: skip
        trainer = train.build_trainer(job)
        model, micro_loss, sharded = trainer.model, trainer._micro_loss, []

        def recording(*args, **kwargs):  # which parameters are shards (not gathered) as a micro-batch starts
            params = [model.tok_embeddings.weight, *(block.ffn.w_gate for block in model.layers)]
            sharded.append(tuple(isinstance(p, DTensor) for p in params))
            return micro_loss(*args, **kwargs)

        trainer._micro_loss = recording
        return losses(trainer.fit()), sharded

    try:
        held, held_sharded = run("auto")
        regathered, regathered_sharded = run("true", "train.fsdp_reshard_after_forward=true")
    finally:
        destroy()  # the one-rank process group FSDP2 made in this process
    modules = 3  # the root and 2 blocks
    assert held_sharded == ([(True,) * modules] + [(False,) * modules] * (micro_batches - 1)) * steps
    assert regathered_sharded == [(True,) * modules] * (micro_batches * steps)
    assert len(held) == steps and held == regathered


def _full_state(trainer) -> dict:
    """Model and optimizer state as plain full tensors keyed by parameter name (a collective under
    FSDP2: the shards are all-gathered)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True)
    model, optim = get_state_dict(trainer.model, trainer.optimizer, options=options)
    # Copies: some of these tensors are the live ones (e.g. AdamW's step), which training moves on.
    copy = lambda d: {k: copy(v) if isinstance(v, dict) else v.clone() for k, v in d.items()}
    return copy({"model": model, "optim": optim["state"]})


def _trainers_on_rank(rank: int, world_size: int, port: int, overrides: list[str], out: str) -> None:
    """One rank of the scenarios checked below: trainers built by train.build_trainer (as train.py
    does) on a 2-process gloo group; rank 0 saves what it saw."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    from twell.training.distributed import destroy
    from twell.training.trainer import Evaluator

    def build(parallel: str, name: str, steps: int, *extra: str):
        cli = [*overrides, f"train.steps={steps}", f"train.parallel={parallel}", f"run_dir={out}/{name}"]
        return train.build_trainer(compose_job([*cli, *extra]))

    seen = {}
    try:
        # DDP trains 2 steps and saves; FSDP2 resumes that checkpoint (DCP reshards it).
        ddp = build("ddp", "ddp", 2, "checkpoint.save_final=true")
        ddp.fit()
        seen["after_ddp"] = _full_state(ddp)
        resume = f"checkpoint.resume={out}/ddp/checkpoints/step_00000002"
        fsdp = build("fsdp", "fsdp", 3, "checkpoint.save_final=true", resume)
        model = fsdp.model
        seen["sharded"] = isinstance(model.layers[0].ffn.w_gate, DTensor)
        seen["tied"] = model.output_weight() is model.tok_embeddings.weight
        seen["num_params"] = (model.num_params(), fsdp.job.model.num_params())
        seen["resumed_step"] = fsdp.resume()
        seen["fsdp_resumed"] = _full_state(fsdp)

        # One more step, then a rank-0-only evaluation (lm-eval's kind): it gets a gathered replica.
        replicas = []

        def probe(net) -> dict:
            replicas.append({k: v.clone() for k, v in net.state_dict().items()})
            return {"probe": 1.0}

        fsdp.evaluators = [Evaluator("probe", 3, probe, all_ranks=False)]
        seen["fsdp_records"] = fsdp.fit()
        seen["replicas"] = replicas
        seen["after_fsdp"] = _full_state(fsdp)

        # ... and the FSDP2 checkpoint back into DDP.
        back = build("ddp", "back", 3, f"checkpoint.resume={out}/fsdp/checkpoints/step_00000003")
        seen["back_step"] = back.resume()
        seen["ddp_resumed"] = _full_state(back)

        # The TwELL kernels (Triton; its interpreter on CPU) under DDP and under FSDP2: 2 steps of
        # 2 micro-batches per rank; FSDP2 again with activation checkpointing (selective: the op's
        # outputs kept, the rest of each block recomputed).
        for parallel, name, *more in (
            ("ddp", "twell_ddp"), ("fsdp", "twell_fsdp"),
            ("fsdp", "twell_fsdp_ac", "train.activation_checkpointing=true"),
        ):  # fmt: skip
            extra = ("model.ffn_impl=twell", "train.global_batch_tokens=512", *more)
            seen[name] = losses(build(parallel, name, 2, *extra).fit())
    finally:
        gc.collect()  # DDP's reducer holds the process group (see train.py)
        destroy()
    if rank == 0:
        torch.save(seen, os.path.join(out, "seen.pt"))


@pytest.fixture(scope="module")
def spawned_trainers(offline_data, tmp_path_factory):
    """What rank 0 of _trainers_on_rank saw, with its output folder and overrides."""
    out = tmp_path_factory.mktemp("spawned")
    overrides = tiny_overrides(offline_data, out, 2, "sparsity=paper", "sparsity.l1_coef=0.05")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_trainers_on_rank, args=(2, port, overrides, str(out)), nprocs=2, join=True)
    return out, overrides, torch.load(out / "seen.pt", weights_only=False)


def _assert_equal_states(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        if isinstance(value, dict):
            _assert_equal_states(got[key], value, f"{what}/{key}")
        else:
            assert torch.equal(got[key], value), f"{what}/{key}"


def test_fsdp_shards_the_model_and_keeps_the_embedding_tied(spawned_trainers):
    _, _, seen = spawned_trainers
    assert seen["sharded"] and seen["tied"]
    parameters, expected = seen["num_params"]
    assert parameters == expected  # a DTensor's numel is the global size; the tied weight counts once


def test_checkpoints_move_between_ddp_and_fsdp(spawned_trainers):
    """Same world size, the other data-parallel mode: DCP reshards the model and AdamW state exactly."""
    _, _, seen = spawned_trainers
    assert seen["resumed_step"] == 2 and seen["back_step"] == 3
    _assert_equal_states(seen["fsdp_resumed"], seen["after_ddp"], "ddp -> fsdp")
    _assert_equal_states(seen["ddp_resumed"], seen["after_fsdp"], "fsdp -> ddp")


def test_rank0_evaluation_under_fsdp_gets_a_gathered_replica(spawned_trainers):
    _, _, seen = spawned_trainers
    assert {"step": 3, "probe": 1.0} in seen["fsdp_records"]
    (replica,) = seen["replicas"]
    model = seen["after_fsdp"]["model"]
    _assert_equal_states({k: replica[k] for k in model}, model, "replica")


def test_an_fsdp_checkpoint_loads_into_one_plain_model(spawned_trainers):
    """eval.load (scripts/hf.py export, scripts/eval.py) reads an FSDP2 checkpoint into one plain
    model: DCP reassembles the shards."""
    from twell.eval.load import load_dcp_model

    out, overrides, seen = spawned_trainers
    net = load_dcp_model(out / "fsdp" / "checkpoints" / "step_00000003", compose_job(overrides).model)
    model = seen["after_fsdp"]["model"]
    _assert_equal_states({k: v for k, v in net.state_dict().items() if k in model}, model, "export")


def test_twell_ffn_trains_under_fsdp_like_under_ddp(spawned_trainers):
    """model.ffn_impl=twell: the Triton kernels (on CPU through the interpreter: tests/conftest.py sets
    TRITON_INTERPRET=1) get the weights FSDP2 gathered for the block, with and without activation
    checkpointing."""
    assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    _, _, seen = spawned_trainers
    ddp, fsdp, fsdp_ac = seen["twell_ddp"], seen["twell_fsdp"], seen["twell_fsdp_ac"]
    assert sorted(fsdp) == sorted(fsdp_ac) == [1, 2]
    for step, loss in ddp.items():
        assert fsdp[step] == pytest.approx(loss, rel=1e-5), step
        assert fsdp_ac[step] == pytest.approx(loss, rel=1e-5), step


def test_validation_record_equals_eval_validation_loss(offline_data, tmp_path):
    """The loop's val_loss / val_bpb are eval.validation_loss on the same held-out batches, with the
    bytes per token of the first eval.bpb_docs held-out documents (counted here by hand)."""
    import math

    import pyarrow.parquet as pq

    from twell.data import build_val_stream, load_tokenizer
    from twell.eval import validation_loss

    overrides = tiny_overrides(
        offline_data, tmp_path, 2, "eval.interval=2", "eval.val_batches=2", "eval.bpb_docs=20"
    )
    trainer = train.build_trainer(compose_job(overrides))
    (record,) = [r for r in trainer.fit() if "val_loss" in r]
    assert record["step"] == 2 and trainer.model.training
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1]) == record

    tokenizer = load_tokenizer(str(offline_data / "tokenizer"))
    files = sorted((offline_data / "sample").glob("val-*.parquet"))
    texts = [t for f in files for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()][:20]
    n_tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    ratio = sum(len(t.encode("utf-8")) for t in texts) / n_tokens
    batches = build_val_stream(trainer.job.data, tokenizer, 32, 4, rank=0, world_size=1, num_batches=2)
    want = validation_loss(trainer.model, batches)  # the model after step 2: the run ended there
    assert record["val_tokens"] == want["val_tokens"] == 2 * 4 * 32
    assert record["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
    assert record["val_bpb"] == pytest.approx(want["val_loss"] / math.log(2) / ratio, rel=1e-6)


def test_data_shards_takes_the_tokenizer_and_held_out_split_from_the_corpus(offline_data, tmp_path):
    """The README's pre-tokenized mode: pretokenize.py with a held-out split, then data=shards with only
    data.path: the run trains and validates with the corpus's tokenizer and 'val' split (the training
    split keeps every document), and the checkpoint's config names them, so eval and export find them."""
    from omegaconf import OmegaConf

    shards = tmp_path / "shards"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pretokenize.py"), "--path", f"{offline_data}/sample/train-*.parquet",
         "--val-path", f"{offline_data}/sample/val-*.parquet", "--tokenizer", str(offline_data / "tokenizer"),
         "--out", str(shards), "--workers", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"train with data=shards data.path={shards}\n" in done.stdout
    overrides = [o for o in tiny_overrides(offline_data, tmp_path / "run", 2) if not o.startswith("data.")]
    overrides += ["data=shards", f"data.path={shards}", "eval.interval=2", "eval.val_batches=1",
                  "checkpoint.save_final=true"]  # fmt: skip
    job = compose_job(overrides)
    assert (job.data.tokenizer, job.data.val_split, job.data.val_docs) == ("corpus", "auto", 10000)
    records = train.build_trainer(job).fit()
    assert (job.data.tokenizer, job.data.val_split, job.data.val_docs) == (
        str(offline_data / "tokenizer"),
        "val",
        0,
    )
    assert [r["step"] for r in records if "val_loss" in r] == [2]
    (saved,) = (tmp_path / "run" / "checkpoints").glob("step_*/config.yaml")
    data = OmegaConf.load(saved).data
    assert (data.tokenizer, data.val_split, data.val_docs) == (str(offline_data / "tokenizer"), "val", 0)

    # a corpus without a held-out split: the head of the training split, as before
    job = compose_job([*overrides, "data.val_docs=50"])
    manifest = json.loads((shards / "manifest.json").read_text())
    del manifest["splits"]["val"]
    (shards / "manifest.json").write_text(json.dumps(manifest))
    from twell.data.token_shards import apply_corpus_defaults

    assert (
        apply_corpus_defaults(job.data)[1]
        == "data.val_split: none in the corpus, the first data.val_docs=50 documents"
    )
    assert (job.data.val_split, job.data.val_docs) == (None, 50)
    with pytest.raises(ValueError, match="data.tokenizer=corpus takes a token corpus's own tokenizer"):
        compose_job([*overrides, "data.source=local"])


def test_a_cpu_run_of_hours_a_step_says_so_at_start(offline_data, tmp_path, monkeypatch, caplog):
    """`python train.py` on a CPU trains the paper's 1.5B model on 1M-token steps (~1e16 FLOPs each): a
    warning names the step's FLOPs and the CPU run of the README; a small run gets none."""
    from twell.training import trainer as trainer_module

    def warned(run_dir) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="twell.training.trainer"):
            run_job(tiny_overrides(offline_data, run_dir, 1))
        return [r.getMessage() for r in caplog.records if "FLOPs a step" in r.getMessage()]

    assert warned(tmp_path / "small") == []
    monkeypatch.setattr(trainer_module, "CPU_STEP_FLOPS_WARN", 1e6)  # this tiny job's steps count as huge
    (message,) = warned(tmp_path / "huge")
    assert "x 256 tokens" in message and "experiment=quickstart" in message


def test_op_graphs_asked_for_where_they_cannot_run_say_so(offline_data, tmp_path, caplog):
    """train.twell_graphs=true on a run without sparse FFNs on a GPU (here: a CPU) does nothing: a warning
    says so and names what they need, instead of the flag being taken silently."""

    def warned(run_dir, *extra) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="twell.training.trainer"):
            run_job(tiny_overrides(offline_data, run_dir, 1, *extra))
        return [r.getMessage() for r in caplog.records if "twell_graphs" in r.getMessage()]

    assert warned(tmp_path / "off") == []
    (message,) = warned(tmp_path / "on", "train.twell_graphs=true")
    assert "no effect" in message and "on cpu" in message and "model.ffn_impl=auto or twell" in message


def test_a_sparse_ffn_on_a_cpu_without_the_interpreter_says_it_runs_the_dense_math(
    offline_data, tmp_path, monkeypatch, capsys
):
    """model.ffn_impl=twell on a CPU without TRITON_INTERPRET=1 trains on the dense reference (the same
    math): the start line says so, rather than "FFN twell" alone; under the interpreter it is the kernels."""

    def start_line(run_dir) -> str:
        capsys.readouterr()
        run_job(tiny_overrides(offline_data, run_dir, 1, "model.ffn_impl=twell", "logging.console=true"))
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("FFN "))

    kernels = start_line(tmp_path / "kernels")  # conftest: interpreter on
    assert kernels.startswith("FFN twell (TwELL entry lists sized estimate), torch.compile"), kernels
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "FFN twell (the dense reference's math here" in start_line(tmp_path / "reference")


def test_lm_eval_subset_in_the_loop(offline_data, offline_tasks, tmp_path, monkeypatch):
    """eval.lm_eval_tasks runs lm-eval on rank 0 in the loop; its per-task accuracy and the mean land in
    the records (and metrics.jsonl) beside val_loss, and training continues exactly as without it."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e .[eval])")
    monkeypatch.setenv("TWELL_OFFLINE_TASKS", str(offline_tasks))
    plain = run_job(tiny_overrides(offline_data, tmp_path / "plain", 3, "eval.interval=2"))
    extra = (
        "eval.interval=2",
        "eval.lm_eval_tasks=[arc_easy]",
        "eval.lm_eval_limit=4",
        "eval.lm_eval_batch_size=4",
    )
    records = train.build_trainer(compose_job(tiny_overrides(offline_data, tmp_path, 3, *extra))).fit()
    (evaluated,) = [r for r in records if "eval/arc_easy/acc" in r]
    assert evaluated["step"] == 2 and "val_loss" in evaluated and "val_bpb" in evaluated
    assert 0.0 <= evaluated["eval/arc_easy/acc"] <= 1.0
    assert evaluated["eval/mean/acc"] == evaluated["eval/arc_easy/acc"]
    assert "eval/mean/acc_norm" in evaluated
    assert evaluated in read_jsonl(tmp_path / "metrics.jsonl")
    # eval mode, no_grad and lm-eval's global seeding leave training untouched
    assert losses(records) == losses(plain)


def test_lm_eval_tasks_need_an_interval(offline_data, tmp_path):
    with pytest.raises(ValueError, match="would never run"):
        compose_job(tiny_overrides(offline_data, tmp_path, 1, "eval.lm_eval_tasks=[arc_easy]"))
