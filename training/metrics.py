"""Throughput and model FLOPs utilisation (MFU).

    MFU = flops_per_token * tokens_per_second / (peak FLOP/s per device * devices)
    flops_per_token = 6 N + 6 L d S

N = all parameters (the tied embedding once: it is the LM-head matmul), L layers, d = d_model,
S = seq_len: 6N for the forward and backward matmuls of the weights, 6LdS for the causal attention
score and value matmuls (PAPER.md, `ModelConfig.flops_per_token`). The peak is the dense bf16
tensor-core rate of the GPU; MFU is only reported for bf16 training on a GPU we know (or with
train.peak_flops set), never on CPU.
"""

import torch

# Dense (no sparsity) bf16 tensor-core peak per GPU, FLOP/s. Longest names first: "H100 PCIe" must
# win over "H100".
PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "GH200": 989e12,
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
}


def peak_flops(device: torch.device, precision: str, override: float = 0.0) -> float | None:
    """Peak FLOP/s of one device for MFU, or None when MFU is not meaningful (CPU, fp32, unknown GPU)."""
    if override > 0:
        return override
    if device.type != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value
    return None


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None, world_size: int) -> float | None:
    if peak is None:
        return None
    return flops_per_token * tokens_per_s / (peak * world_size)


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30
