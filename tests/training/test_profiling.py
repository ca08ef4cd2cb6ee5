"""logging.profile_at: the profiled steps' trace and summary, the kernel kinds and the GPU busy time."""

import json

import pytest
from trainer_helpers import run_job, tiny_overrides

from twell.training.config import LoggingConfig
from twell.training.profiling import (
    busy_us,
    format_summary,
    kernel_kind,
    phase,
    split_events,
    summarize,
    uncovered_us,
)


@pytest.mark.parametrize(
    "name, kind",
    [
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
        ("_segment_axpy_kernel", "twell"),
        ("_relu_bits_persistent_kernel", "twell"),
        ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "inductor"),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
            "optimizer",
        ),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
        ("void cub::DeviceRadixSortOnesweepKernel<Policy, false, int, int>", "other"),
    ],
)
def test_kernel_kinds_by_name(name, kind):
    assert kernel_kind(name) == kind


def test_busy_time_is_the_union_of_kernel_intervals():
    # two streams overlapping (0-10 and 5-12), one nested (6-8), then a gap and one more (20-25)
    assert busy_us([(0, 10), (5, 12), (6, 8), (20, 25)]) == pytest.approx(17.0)
    assert busy_us([]) == 0.0


def test_summary_per_step_and_by_kind():
    kernels = [
        ("nvjet_gemm", 0.0, 600.0),
        ("_row_fwd_kernel", 600.0, 900.0),
        ("_row_fwd_kernel", 2000.0, 2300.0),
    ]
    s = summarize(kernels, wall_s=4e-3, steps=2)  # 2 steps in 4 ms, kernels busy 1.2 ms of it
    assert s["wall_ms"] == pytest.approx(2.0)
    assert s["gpu_busy_ms"] == pytest.approx(0.6)
    assert s["gpu_idle_ms"] == pytest.approx(1.4)
    assert s["gpu_busy_share"] == pytest.approx(0.3)
    assert s["kernels"] == pytest.approx(1.5)
    assert s["gpu_ms_by_kind"] == {"gemm": pytest.approx(0.3), "twell": pytest.approx(0.3)}
    text = format_summary(s)
    assert "GPU busy 0.60 ms (30.0%), idle 1.40 ms" in text and "twell" in text


def test_uncovered_time_is_the_ranges_minus_the_kernels():
    assert uncovered_us([(0, 100)], [(10, 20), (15, 30), (90, 120)]) == pytest.approx(70.0)
    assert uncovered_us([(0, 10), (5, 20)], []) == pytest.approx(20.0)
    assert uncovered_us([(0, 10)], [(-5, 50)]) == 0.0


def test_idle_time_is_charged_to_the_hosts_phase():
    """A gap between kernels counts for the phase the host was in; an inner phase (settle inside the
    backward's range) takes its share from the outer one; idle outside every phase is left unnamed."""
    kernels = [
        ("nvjet_gemm", 0.0, 600.0),
        ("_row_fwd_kernel", 600.0, 900.0),
        ("_row_dx_kernel", 2000.0, 2300.0),
    ]
    phases = [
        ("forward", 0.0, 1500.0), ("backward", 1500.0, 2500.0), ("settle", 1600.0, 1700.0),
        ("optimizer", 2500.0, 3500.0),
    ]  # fmt: skip
    s = summarize(kernels, wall_s=4e-3, steps=1, phases=phases)
    assert s["gpu_idle_ms_by_phase"] == {
        "forward": pytest.approx(0.6), "backward": pytest.approx(0.6), "settle": pytest.approx(0.1),
        "optimizer": pytest.approx(1.0),
    }  # fmt: skip
    assert list(s["gpu_idle_ms_by_phase"]) == ["forward", "backward", "settle", "optimizer"]  # PHASES order
    text = format_summary(s)
    assert "GPU idle by what the host was doing" in text and "(no phase)" in text
    assert text.splitlines()[-1].split() == ["(no", "phase)", "0.50"]  # 2.8 ms idle, 2.3 in phases
    with pytest.raises(ValueError, match="unknown phase 'bogus'"):
        phase("bogus")


def test_gpu_copies_of_the_phase_ranges_are_not_kernels():
    """On a GPU the profiler mirrors each record_function range on the GPU's timeline (a
    gpu_user_annotation spanning the kernels launched inside it). Counted as a kernel, the forward's
    range covered the forward's gaps: a 1.5b step on the H200 read 2.96 ms idle instead of 25.8."""
    import torch
    from torch.autograd.profiler_util import FunctionEvent

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [
        FunctionEvent(0, "twell/forward", 0, 0.0, 100.0, device_type=cpu, is_user_annotation=True),
        FunctionEvent(1, "twell/forward", 0, 5.0, 95.0, device_type=cuda, is_user_annotation=True),
        FunctionEvent(2, "nvjet_gemm", 0, 5.0, 40.0, device_type=cuda),
        FunctionEvent(3, "Memset (Device)", 0, 60.0, 95.0, device_type=cuda),
        FunctionEvent(4, "aten::mm", 0, 1.0, 4.0, device_type=cpu),
    ]
    kernels, phases = split_events(events)
    assert kernels == [("nvjet_gemm", 5.0, 40.0), ("Memset (Device)", 60.0, 95.0)]
    assert phases == [("forward", 0.0, 100.0)]
    summary = summarize(kernels, 100e-6, 1, phases)
    assert summary["gpu_busy_ms"] == pytest.approx(70e-3) and summary["gpu_idle_ms"] == pytest.approx(30e-3)
    assert summary["gpu_idle_ms_by_phase"] == {"forward": pytest.approx(30e-3)}


def test_profile_settings_are_checked():
    with pytest.raises(ValueError, match="logging.profile_steps=0"):
        LoggingConfig(profile_steps=0)
    with pytest.raises(ValueError, match="logging.profile_at=-1"):
        LoggingConfig(profile_at=-1)


def test_a_run_profiles_the_steps_after_profile_at(offline_data, tmp_path):
    """steps 3-4 of a 5-step CPU run are profiled: a trace, a summary with its table, one JSONL record
    (kind profile) at step 4; the training records and their steps are those of an unprofiled run."""
    plain = run_job(tiny_overrides(offline_data, tmp_path / "plain", 5, "logging.log_interval=1"))
    run_dir = tmp_path / "profiled"
    train = run_job(
        tiny_overrides(
            offline_data,
            run_dir,
            5,
            "logging.log_interval=1",
            "logging.profile_at=2",
            "logging.profile_steps=2",
        )
    )
    trace = json.loads((run_dir / "profile" / "step_2.trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {f"twell/{p}" for p in ("data", "forward", "backward", "optimizer", "sparsity")} <= names
    summary = (run_dir / "profile" / "step_2.txt").read_text()
    assert summary.startswith("2 steps profiled: wall") and "Self CPU" in summary
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    profiled = [r for r in logged if r.get("kind") == "profile"]
    assert len(profiled) == 1 and profiled[0]["step"] == 4 and profiled[0]["profile/wall_ms"] > 0
    assert [(r["step"], r["loss"]) for r in train] == [(r["step"], r["loss"]) for r in plain if "loss" in r]


def test_a_run_that_ends_inside_the_profiled_steps_still_writes_them(offline_data, tmp_path):
    """profile_at=3 with 3 steps to profile in a 5-step run: steps 4-5 are profiled and summarised at the
    end (2 steps), nothing is left open."""
    run_dir = tmp_path / "short"
    run_job(tiny_overrides(offline_data, run_dir, 5, "logging.profile_at=3", "logging.profile_steps=3"))
    assert (run_dir / "profile" / "step_3.txt").read_text().startswith("2 steps profiled")
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["profile/steps"]) for r in logged if r.get("kind") == "profile"] == [(5, 2)]


def test_the_profile_record_flattens_kinds_and_phases(tmp_path):
    """One JSONL / wandb record: profile/gpu_ms/<kind> and profile/gpu_idle_ms/<phase>, beside the scalars."""
    from types import SimpleNamespace

    from twell.training.trainer import Trainer

    kernels = [("nvjet_gemm", 0.0, 600.0), ("_row_fwd_kernel", 1000.0, 1300.0)]
    summary = summarize(kernels, wall_s=2e-3, steps=1, phases=[("forward", 0.0, 2000.0)])
    logged, said = [], []
    trainer = SimpleNamespace(step=7, _say=said.append, logger=SimpleNamespace(log=logged.append))
    record = Trainer._log_profile(trainer, summary, tmp_path)
    assert logged == [record] and record["step"] == 7 and record["kind"] == "profile"
    assert record["profile/gpu_ms/gemm"] == pytest.approx(0.6) and record[
        "profile/gpu_ms/twell"
    ] == pytest.approx(0.3)
    assert record["profile/gpu_idle_ms/forward"] == pytest.approx(1.1)
    assert (
        record["profile/gpu_idle_ms"] == pytest.approx(1.1) and "profile/gpu_idle_ms_by_phase" not in record
    )
    assert "GPU idle by what the host was doing" in said[-1]
