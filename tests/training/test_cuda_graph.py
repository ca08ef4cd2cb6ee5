"""train.cuda_graph: the micro-batch replayed from a CUDA graph trains like the eager loop, a TwELL
capacity miss is redone eagerly (nothing wrong reaches the weights), and unsupported set-ups are
refused with the fix."""

import gc
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from trainer_helpers import compose_job, tiny_overrides, train

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_graph_refuses_compile_and_activation_checkpointing(offline_data, tmp_path):
    for other in ("train.compile", "train.activation_checkpointing"):
        with pytest.raises(ValueError, match=f"does not combine with {other}=true"):
            compose_job(tiny_overrides(offline_data, tmp_path, 1, "train.cuda_graph=true", f"{other}=true"))


def test_cuda_graph_needs_a_cuda_device(offline_data, tmp_path):
    # train.device=cpu is refused with the config; auto on a machine without a GPU when the trainer starts.
    with pytest.raises(ValueError, match="train.cuda_graph=true needs a CUDA device.*train.cuda_graph=false"):
        compose_job(tiny_overrides(offline_data, tmp_path, 1, "train.cuda_graph=true", "train.device=cpu"))
    if not torch.cuda.is_available():
        job = compose_job(tiny_overrides(offline_data, tmp_path, 1, "train.cuda_graph=true"))
        with pytest.raises(ValueError, match="needs a CUDA device, but this run trains on cpu"):
            train.build_trainer(job)


def test_cuda_graph_under_torchrun_needs_ddp():
    """Several processes: DDP's gradient average runs after the replays; FSDP2 is refused with the fix."""
    from twell.training.trainer import check_cuda_graph_support

    cuda = torch.device("cuda", 0)  # only its type is checked
    check_cuda_graph_support(cuda, 2, "ddp")
    with pytest.raises(ValueError, match="needs train.parallel=ddp, not fsdp.*or train.cuda_graph=false"):
        check_cuda_graph_support(cuda, 2, "fsdp")


def test_ddp_static_gradients_are_views_into_one_flat_buffer_per_dtype():
    """Under DDP the graph's gradients live in one flat buffer per dtype (one all-reduce each): every
    parameter's .grad is a zeroed view into it, kept across captures, made anew once a .grad was
    replaced (as an eager redo may); in one process each parameter keeps a tensor of its own."""
    from twell.training.cuda_graph import GraphedMicroStep

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).to(torch.float32)
    net[1].bias.data = net[1].bias.data.double()  # a second dtype
    params = list(net.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    step = GraphedMicroStep(params, loss_fn=None, grad_accum=1, device=torch.device("cpu"), world_size=2)
    step._static_grads()
    assert [f.dtype for f in step._flats] == [torch.float32, torch.float64]
    assert [f.numel() for f in step._flats] == [12 + 4 + 8, 2]
    for p in params:
        flat = step._flats[0] if p.dtype == torch.float32 else step._flats[1]
        assert (
            p.grad.shape == p.shape
            and p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        )
        assert not p.grad.any()
    flats = [f.data_ptr() for f in step._flats]
    step._static_grads()  # all views already: kept
    assert [f.data_ptr() for f in step._flats] == flats
    params[0].grad = torch.zeros_like(params[0])  # replaced: views made anew
    step._static_grads()
    assert params[0].grad.untyped_storage().data_ptr() == step._flats[0].untyped_storage().data_ptr()
    one = GraphedMicroStep(params[:1], loss_fn=None, grad_accum=1, device=torch.device("cpu"))
    params[0].grad = None
    one._static_grads()
    assert one._flats == [] and params[0].grad is not None and not params[0].grad.any()


def _run(offline_data, tmp_path, name, steps, *extra):
    job = compose_job(tiny_overrides(offline_data, tmp_path / name, steps, "train.device=cuda", *extra))
    trainer = train.build_trainer(job)
    return trainer, {r["step"]: r["loss"] for r in trainer.fit() if "loss" in r}


# d_ff 256: multiples of 64 for the kernels; lr low enough that bf16 rounding differences stay small.
SIZES = ("model.d_ff=256", "model.d_model=128", "optim.lr=1e-3", "sparsity.l1_coef=2e-4")


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("ffn_impl", ["dense", "twell"])
def test_graphed_steps_match_eager_steps(offline_data, tmp_path, ffn_impl):
    steps = 6
    extra = (*SIZES, f"model.ffn_impl={ffn_impl}")
    _, eager = _run(offline_data, tmp_path, "eager", steps, *extra)
    trainer, graphed = _run(offline_data, tmp_path, "graph", steps, *extra, "train.cuda_graph=true")
    assert trainer.graphed.captures == 1 and trainer.graphed.redone_steps == 0
    assert sorted(graphed) == sorted(eager) == list(range(1, steps + 1))
    for step in eager:
        assert graphed[step] == pytest.approx(eager[step], rel=2e-3), step


@pytest.mark.gpu
@GPU
def test_a_capacity_miss_redoes_the_step_eagerly(offline_data, tmp_path, monkeypatch):
    """Capacities far below the entry count: every graphed step misses, is redone eagerly and the
    graph is captured again with twice the headroom; the losses are the eager run's."""
    import twell.kernels.training.train as kt

    steps = 3
    extra = (*SIZES, "model.ffn_impl=twell")
    _, eager = _run(offline_data, tmp_path, "eager", steps, *extra)
    monkeypatch.setattr(kt, "_with_margin", lambda nnz: max(64, nnz // 4))
    trainer, graphed = _run(offline_data, tmp_path, "graph", steps, *extra, "train.cuda_graph=true")
    assert trainer.graphed.redone_steps == steps and trainer.graphed.captures == steps
    assert trainer.graphed.headroom == min(kt.MAX_HEADROOM, kt.DEFAULT_HEADROOM * 2**steps)
    for step in eager:
        assert graphed[step] == pytest.approx(eager[step], rel=2e-3), step


@pytest.mark.gpu
@GPU
def test_oversized_capacities_are_captured_anew(offline_data, tmp_path, monkeypatch):
    """Every model.twell_check_interval steps the graph's TwELL capacities are compared with the last
    replay's entry counts; an oversized one (here: every check says so) is captured anew at the next
    step, and training goes on as the eager run."""
    import twell.kernels.training.train as kt

    steps = 6
    extra = (*SIZES, "model.ffn_impl=twell", "model.twell_check_interval=2")
    _, eager = _run(offline_data, tmp_path, "eager", steps, *extra)
    checked = []
    monkeypatch.setattr(kt, "oversized", lambda cap, n: checked.append((cap, n)) or True)
    trainer, graphed = _run(offline_data, tmp_path, "graph", steps, *extra, "train.cuda_graph=true")
    # checks after steps 2 and 4 (and 6): captures at steps 1, 3 and 5
    assert trainer.graphed.captures == 3 and trainer.graphed.redone_steps == 0
    assert trainer.graphed.headroom == kt.DEFAULT_HEADROOM  # clean checks keep the default
    assert checked and all(cap >= n > 0 for cap, n in checked)
    for step in eager:
        assert graphed[step] == pytest.approx(eager[step], rel=2e-3), step


def _ddp_rank(rank: int, port: int, overrides: list[str], out: str, shared_gpu: bool) -> None:
    """One of 2 ranks: eager DDP, graphed DDP, and graphed DDP where rank 1's TwELL capacities are far
    too small (its every graphed step misses, rank 0's do not); rank 0 saves the losses. Each rank on
    its own GPU (NCCL, as train.py sets it up), or both on GPU 0 with a gloo group (one-GPU machines)."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK="0" if shared_gpu else str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )  # fmt: skip
    import torch.distributed as dist

    import twell.kernels.training.train as kt
    from twell.training.distributed import destroy

    if shared_gpu:  # NCCL wants a GPU per rank; init_distributed keeps a group that already exists
        torch.cuda.set_device(0)
        dist.init_process_group("gloo")

    seen = {}
    try:
        for name, extra in (
            ("eager", ()),
            ("graph", ("train.cuda_graph=true",)),
            ("miss", ("train.cuda_graph=true",)),
        ):
            if name == "miss" and rank == 1:
                kt._with_margin = lambda nnz: max(64, nnz // 4)
            trainer = train.build_trainer(compose_job([*overrides, f"run_dir={out}/{name}", *extra]))
            seen[name] = {r["step"]: r["loss"] for r in trainer.fit() if "loss" in r}
            if trainer.graphed is not None:
                seen[f"{name}_counts"] = (trainer.graphed.captures, trainer.graphed.redone_steps)
            del trainer
            gc.collect()  # DDP's reducer holds the process group
    finally:
        destroy()
    if rank == 0:
        torch.save(seen, os.path.join(out, "seen.pt"))


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("ffn_impl", ["dense", "twell"])
def test_graphed_ddp_steps_match_eager_ddp_steps(offline_data, tmp_path, ffn_impl):
    """2 ranks (NCCL on 2 GPUs, else gloo with both on one GPU), 2 micro-batches each per step: the
    graphed steps (plain model in the graph, the gradients averaged after the replays) give the eager
    DDP losses; a capacity miss on one rank only makes both redo the step eagerly (through DDP), with
    the same losses."""
    steps = 4
    overrides = tiny_overrides(
        offline_data, tmp_path, steps, "train.device=cuda", "train.parallel=ddp", "train.global_batch_tokens=512",
        *SIZES, f"model.ffn_impl={ffn_impl}",
    )  # fmt: skip
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    shared_gpu = torch.cuda.device_count() < 2
    mp.spawn(_ddp_rank, args=(port, overrides, str(tmp_path), shared_gpu), nprocs=2, join=True)
    seen = torch.load(tmp_path / "seen.pt", weights_only=False)
    assert sorted(seen["eager"]) == list(range(1, steps + 1))
    assert seen["graph_counts"] == (1, 0)
    for name in ("graph", "miss"):
        assert sorted(seen[name]) == sorted(seen["eager"]), name
        for step, want in seen["eager"].items():
            assert seen[name][step] == pytest.approx(want, rel=2e-3), (name, step)
    if ffn_impl == "twell":  # rank 1 missed at every graphed step: each one redone, captured anew
        assert seen["miss_counts"] == (steps, steps)
