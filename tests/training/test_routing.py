"""Routing of model.ffn_impl=auto by measured break-even (training/routing.py): the interpolation, the
per-GPU cache (written, loaded, applied; a broken one ignored), the CPU fallback and the config values."""

import json
import logging
import math

import pytest
import torch
from trainer_helpers import compose_job, tiny_overrides, train

from twell.kernels.training.train import hot_units_for
from twell.model import ModelConfig, Transformer
from twell.training import routing
from twell.training.routing import BreakEven, break_even, choose_threshold, load_cached, routing_key, store

CPU = torch.device("cpu")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TWELL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def table(threshold: float, **key_changes) -> BreakEven:
    key = {**routing_key(CPU, 64, 128, 128, "fp32", None, False), **key_changes}
    return BreakEven(key, [8.0, 16.0], [1.0, 1.0], [0.5, 2.0], threshold, measured_at="2026-01-01 00:00:00")


def test_break_even_interpolates_where_twell_stops_being_faster():
    active = [8.0, 16.0, 32.0, 64.0]
    # TwELL's time grows with activity, dense's does not: gains 6, 2, -2, -6 ms cross zero at 16 + 16 * 2 / 4.
    assert break_even(active, [10.0] * 4, [4.0, 8.0, 12.0, 16.0]) == pytest.approx(24.0)
    assert break_even(active, [10.0] * 4, [1.0, 2.0, 3.0, 4.0]) == 64.0  # faster everywhere: the top rung
    assert break_even(active, [10.0] * 4, [11.0, 12.0, 13.0, 14.0]) == 0.0  # nowhere: never sparse
    # A noisy low rung does not hide a later win: the crossing above the highest faster rung counts.
    assert break_even(active, [10.0] * 4, [11.0, 7.0, 9.0, 11.0]) == pytest.approx(48.0)
    with pytest.raises(ValueError, match="3 rungs, 2 dense and 3 TwELL times"):
        break_even(active[:3], [1.0, 1.0], [1.0] * 3)
    with pytest.raises(ValueError, match="must increase"):
        break_even([8.0, 8.0], [1.0, 1.0], [1.0, 1.0])


def test_threshold_config_values():
    assert ModelConfig().twell_threshold == 50.0  # "auto" is opt-in (see model/config.py)
    assert ModelConfig().routing_threshold == routing.TWELL_THRESHOLD_FALLBACK == 50.0
    assert ModelConfig(twell_threshold=12).twell_threshold == 12.0
    assert ModelConfig(twell_threshold=12).routing_threshold == 12.0
    for bad in ("fast", 0, -3.0, True, math.nan, None):
        with pytest.raises(
            ValueError, match=f"twell_threshold={bad!r} must be auto .* model.twell_threshold=50"
        ):
            ModelConfig(twell_threshold=bad)
    # From the command line: a number and auto compose, anything else is refused naming the value.
    assert compose_job(["model=1.5b", "model.twell_threshold=30"]).model.twell_threshold == 30.0
    assert compose_job(["model=1.5b", "model.twell_threshold=auto"]).model.twell_threshold == "auto"
    with pytest.raises(ValueError, match="twell_threshold='often' must be auto"):
        compose_job(["model=1.5b", "model.twell_threshold=often"])


def test_update_ffn_routing_takes_the_threshold_it_is_given():
    net = Transformer(ModelConfig(d_model=64, n_heads=2, d_ff=128, n_layers=3, ffn_impl="auto"))
    active = torch.tensor([10.0, 30.0, 60.0])
    assert net.update_ffn_routing(active) == [True, True, False]  # "auto" alone: the fallback 50
    assert net.update_ffn_routing(active, 20.0) == [True, False, False] == net.ffn_routing()
    assert net.update_ffn_routing(active, 0.0) == [False] * 3  # a break-even of 0: never sparse


def test_cache_is_written_loaded_and_replaced_per_key(cache_dir):
    path = routing.cache_path()
    assert path == cache_dir / "routing.json"
    store(path, table(24.0))
    store(path, table(40.0, d_ff=256))  # another shape: a second entry
    assert load_cached(path, table(0.0).key).threshold == 24.0
    assert load_cached(path, table(0.0, d_ff=256).key).threshold == 40.0
    assert load_cached(path, table(0.0, torch="0.0").key) is None  # another torch: measured again
    store(path, table(30.0))  # the same key again: replaced, not added
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 2 and sorted(e["threshold"] for e in entries) == [30.0, 40.0]
    loaded = load_cached(path, table(0.0).key)
    assert (loaded.active, loaded.dense_ms, loaded.twell_ms) == ([8.0, 16.0], [1.0, 1.0], [0.5, 2.0])


@pytest.mark.parametrize(
    "content, warning",
    [
        ("{not json", "ignoring the routing cache"),
        ('{"version": 99, "entries": []}', "not a routing table of version 1"),
        ('{"version": 1, "entries": {"a": 1}}', "is not a list of tables"),
        (None, "ignoring a broken entry"),  # the right key with a threshold that is no number
    ],
)
def test_a_broken_cache_is_ignored_with_a_warning(cache_dir, caplog, content, warning):
    path = routing.cache_path()
    path.parent.mkdir(parents=True)
    if content is None:
        content = json.dumps({"version": 1, "entries": [{**table(1.0).to_dict(), "threshold": "low"}]})
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="twell.training.routing"):
        choice = choose_threshold(ModelConfig(d_model=64, n_heads=2, d_ff=128, twell_threshold="auto"), 128, CPU, precision="fp32",
                                  compiled=False)  # fmt: skip
    assert warning in caplog.text
    assert (choice.threshold, choice.source) == (50.0, "fallback")
    store(path, table(24.0))  # a new table replaces the broken file
    assert load_cached(path, table(0.0).key).threshold == 24.0


def test_choice_on_cpu_is_the_number_the_cache_or_the_fallback(cache_dir):
    mcfg = ModelConfig(d_model=64, n_heads=2, d_ff=128, ffn_impl="auto", twell_threshold="auto")
    choose = lambda cfg: choose_threshold(cfg, 128, CPU, precision="fp32", compiled=False)  # noqa: E731
    fallback = choose(mcfg)
    assert (fallback.threshold, fallback.source) == (50.0, "fallback")
    assert fallback.describe() == (
        "FFN routing: a layer goes sparse below 50.0 active units/token (model.twell_threshold=auto, the "
        "fallback: no break-even is measured on cpu)"
    )
    assert not cache_dir.exists()  # nothing is measured, nothing written
    configured = choose(ModelConfig(d_model=64, n_heads=2, d_ff=128, twell_threshold=7))
    assert (configured.threshold, configured.source, configured.record()) == (
        7.0, "config", {"twell_threshold": 7.0, "twell_threshold_source": "config"},
    )  # fmt: skip
    store(routing.cache_path(), table(24.0))
    loaded = choose(mcfg)
    assert (loaded.threshold, loaded.source) == (24.0, "loaded")
    assert (
        "loaded from" in loaded.describe()
        and "\n           8.0     1.000     0.500        0.50" in loaded.describe()
    )
    assert loaded.record()["twell_break_even"] == {"active": [8.0, 16.0], "dense_ms": [1.0, 1.0],
                                                   "twell_ms": [0.5, 2.0]}  # fmt: skip


def test_measurement_writes_the_cache_the_trainer_loads(cache_dir, tmp_path):
    # The real measurement (Triton interpreter on CPU: slow, so one rung and one timed step), as on a GPU.
    measured = routing.main(["--d-model", "64", "--d-ff", "128", "--tokens", "128", "--dtype", "fp32",
                             "--device", "cpu", "--ladder", "8", "--iters", "1", "--warmup", "1", "--out", str(tmp_path)])  # fmt: skip
    assert measured.key == routing_key(CPU, 64, 128, 128, "fp32", None, False)
    assert measured.key["hot_units"] == hot_units_for(128, 128) and len(measured.active) == 1
    assert 4.0 < measured.active[0] < 16.0  # the synthetic inputs' activity is near its rung
    assert measured.threshold in (0.0, measured.active[0])  # one rung: TwELL wins there or not
    written = json.loads((tmp_path / "break_even.json").read_text())
    assert written["threshold"] == measured.threshold and written["seconds"] > 0
    cached = load_cached(routing.cache_path(), measured.key)
    assert cached.threshold == measured.threshold and cached.twell_ms == measured.twell_ms


def test_trainer_routes_by_the_cached_break_even(cache_dir, offline_data, tmp_path):
    # A hand-written table for this run's key (the tiny run: CPU, fp32, eager, 4 x 32 tokens) says
    # TwELL wins up to 1000 active units: the fallback 50 would keep the half-active random layers dense.
    store(routing.cache_path(), table(1000.0))
    overrides = tiny_overrides(
        offline_data,
        tmp_path / "run",
        2,
        "model.ffn_impl=auto",
        "model.twell_threshold=auto",
        "model.twell_check_interval=2",
    )
    trainer = train.build_trainer(compose_job(overrides))
    records = [r for r in trainer.fit() if "loss" in r]
    assert trainer.twell_threshold == 1000.0
    assert [r["ffn_sparse"] for r in records] == [[0, 0], [1, 1]]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    info = [r for r in logged if "twell_threshold" in r]
    assert info == [{"step": 0, "twell_threshold": 1000.0, "twell_threshold_source": "loaded",
                     "twell_break_even": {"active": [8.0, 16.0], "dense_ms": [1.0, 1.0], "twell_ms": [0.5, 2.0]}}]  # fmt: skip


def test_wandb_gets_the_routing_per_layer_and_the_threshold(tmp_path, monkeypatch):
    from twell.training.config import LoggingConfig
    from twell.training.loggers import WandbSink

    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(LoggingConfig(), tmp_path, "routing", {}, mode="offline")
    try:
        sink.log_run_info({"step": 0, "twell_threshold": 24.0, "twell_threshold_source": "measured"})
        sink.log({"step": 1, "ffn_sparse": [0, 1, 1]})
        sink.log({"step": 2, "loss": 1.0})  # wandb commits a step's values to the summary at the next one
        assert (sink.run.config["twell_threshold"], sink.run.config["twell_threshold_source"]) == (
            24.0,
            "measured",
        )
        summary = sink.run.summary
        assert [summary[f"ffn_sparse/layer_{i:02d}"] for i in range(3)] == [0, 1, 1]
        assert (summary["ffn_sparse/count"], summary["ffn_sparse/layers"]) == (2, "011")
    finally:
        sink.close()
