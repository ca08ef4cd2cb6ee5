"""Profile a few training steps of a finished race run (resumed from its final checkpoint): CUDA time
per kernel, top rows, and the step's wall time vs the GPU's busy time."""

import importlib.util
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from torch.profiler import ProfilerActivity, profile

ROOT = Path.cwd()
spec = importlib.util.spec_from_file_location("twell_train_entry", ROOT / "train.py")
train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train)
run_dir, steps, *overrides = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    cfg = compose("train", overrides=[*overrides, f"run_dir={run_dir}", f"train.steps={steps + 40}"])
trainer = train.build_trainer(train.parse_config(cfg))
start = trainer.resume()
print("resumed at", start, "routing", trainer.model.ffn_routing())
trainer.model.train()
for _ in range(3):  # recompile / warm at this state
    trainer.train_step()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(5):
    trainer.train_step()
torch.cuda.synchronize()
print(f"wall per step: {(time.perf_counter() - t0) / 5 * 1e3:.1f} ms")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        trainer.train_step()
    torch.cuda.synchronize()
table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
print(table)
