"""TwELL inference: the FFN forward schedules (row, csr, fused decode) and the prefix GEMM."""
