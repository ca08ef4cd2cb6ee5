"""scripts/compare_runs.py: the side-by-side table of training runs from their metrics.jsonl."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compare_runs.py"


def _write_run(path: Path, ces, active, dead, reinit, l1_coef, val):
    path.mkdir(parents=True)
    lines = []
    for step, ce in enumerate(ces, 1):
        lines.append(
            {
                "step": step * 10,
                "tokens": step * 1000,
                "loss": ce + 0.01,
                "ce": ce,
                "l1_coef": l1_coef,
                "active_mean": active,
                "active_frac": [a / 64 for a in active],
                "active_max": [a * 3 for a in active],
                "dead_frac": dead,
                "reinit_units": reinit,
                "overflow_rows": [0, 1],
                "tokens_per_s": 123.0,
            }
        )
    lines.append({"step": 10 * len(ces), "val_loss": val})
    lines.insert(1, "not json")  # a torn line is skipped, not fatal
    (path / "metrics.jsonl").write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines))


def test_compare_runs_table_and_json(tmp_path):
    _write_run(tmp_path / "dense", [3.0, 2.0, 2.0], [32.0, 16.0], [0.0, 0.0], [0, 0], 0.0, 2.5)
    _write_run(tmp_path / "sparse", [3.0, 2.2, 2.0], [1.0, 0.5], [0.5, 0.25], [2, 3], 1e-3, 2.6)
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "dense"), str(tmp_path / "sparse"), "--tail", "2",
         "--out", str(out)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = json.loads(out.read_text())
    dense, sparse = rows
    assert dense["ce"] == 2.0 and abs(sparse["ce"] - 2.1) < 1e-12  # mean of the last 2 records
    assert abs(sparse["ce_rel_to_first"] - 0.05) < 1e-12
    assert sparse["active_mean"] == 0.75 and sparse["d_ff"] == 64  # inferred from active / active_frac
    assert abs(sparse["active_pct_of_d_ff"] - 100 * 0.75 / 64) < 1e-12
    assert sparse["dead_frac_mean"] == 0.375 and sparse["reinit_units_total"] == 15  # 3 records x (2 + 3)
    assert sparse["val_loss"] == 2.6 and sparse["overflow_rows"] == 1
    assert "| sparse | 30 | 3000 | 0.001 | 2.100 | +5.00% | 2.600 | 0.8 | 1.17% | 0.375 | 15 |" in proc.stdout


def test_compare_runs_errors_name_the_problem(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "nope" in proc.stderr and "metrics.jsonl" in proc.stderr
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text(json.dumps({"step": 1, "val_loss": 2.0}))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "empty")], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "no training records" in proc.stderr
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "empty"), "--tail", "0"], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "--tail" in proc.stderr
