"""Generation with the KV cache (model/generate.py, model/kv_cache.py) on CPU, fp32, small random models:
cached steps give the full forward's logits, a padded batch gives what each prompt gives alone, greedy
tokens equal transformers' generate on the exported Llama, sparse (TwELL, interpreter) FFNs decode as the
dense ones, sampling reproduces from a seed, and bad inputs name the fix."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from twell.model import Decoder, ModelConfig, Transformer
from twell.model.generate import check_sampling, generate, sample_next

# Untied head, larger init than training's and grouped-query attention: the next token depends on the
# context (a tied small-init model mostly repeats its input), and the KV-head grouping is exercised.
SHAPE = dict(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64)
SHAPE.update(tie_embeddings=False, init_std=0.1)


def make_model(seed: int, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{**SHAPE, **overrides})).eval()


def random_prompts(lengths, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def teacher_forced_logits(model, prompts, continuations, **options):
    """Per row, the cached decoder's logits after each prompt token from the last on: prefill, then
    one step per continuation token (all rows step together). options: the Decoder's."""
    decoder = Decoder(model, len(prompts), 64, **options)
    rows = [[logits] for logits in decoder.prefill(prompts)]
    for step in range(len(continuations[0])):
        logits = decoder.step(torch.tensor([c[step] for c in continuations]))
        for row, value in zip(rows, logits):
            row.append(value.clone())
    return [torch.stack(row) for row in rows]


@pytest.mark.parametrize("seed", [0, 1])
def test_cached_decoding_equals_full_forward_at_every_position(seed):
    model = make_model(seed)
    # A 1-token prompt: every later position of its row comes from a cached step.
    prompts = random_prompts([1, 7, 4], SHAPE["vocab_size"], seed)
    continuations = random_prompts([9, 9, 9], SHAPE["vocab_size"], seed + 100)
    cached = teacher_forced_logits(model, prompts, continuations)
    for prompt, cont, got in zip(prompts, continuations, cached):
        with torch.no_grad():
            full = model(torch.tensor([prompt + cont]), with_stats=False).logits[0]
        want = full[len(prompt) - 1 :]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_batch_of_different_lengths_gives_what_each_gives_alone():
    model = make_model(2)
    prompts = random_prompts([3, 11, 1, 6], SHAPE["vocab_size"], 2)
    together = generate(model, prompts, 8)
    for prompt, tokens in zip(prompts, together.tokens):
        assert len(tokens) == 8
        assert generate(model, [prompt], 8).tokens == [tokens]
    assert together.steps == 7 and together.new_tokens == 32
    # Not a model that ignores its context: the prompts lead to different continuations.
    assert len({tuple(t) for t in together.tokens}) > 1


def test_greedy_equals_transformers_generate_on_the_exported_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    from twell.model.hf_io import export_hf

    model = make_model(3)
    folder = export_hf(model, None, tmp_path / "llama")
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # Llama's default EOS id would stop it early
    hf.generation_config.pad_token_id = SHAPE["vocab_size"] - 1
    prompts = random_prompts([5, 2, 9], SHAPE["vocab_size"], 3)
    ours = model.generate(prompts, 12).tokens
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            ids = torch.tensor([prompt])  # an explicit mask: HF would take pad-id tokens for padding
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert theirs[0, len(prompt) :].tolist() == tokens


@pytest.mark.slow
def test_sparse_ffn_decodes_as_the_dense_one():
    """TwELL kernels (interpreter; the fused schedule at 1-2 tokens a step, row above; the prefill
    through them too, prefill_ffn="model") in every layer, and in one layer of two ("auto" routing),
    against the dense FFN: the same logits within fp32 rounding, the same greedy tokens."""
    shape = dict(n_layers=2, n_heads=2, n_kv_heads=2, d_ff=128)
    dense = make_model(4, **shape)
    prompts = random_prompts([3, 1], SHAPE["vocab_size"], 4)
    continuations = random_prompts([2, 2], SHAPE["vocab_size"], 104)
    want = teacher_forced_logits(dense, prompts, continuations)
    want_tokens = generate(dense, prompts, 3).tokens
    for routing in ("all", "second"):
        sparse = make_model(4, **shape, ffn_impl="twell" if routing == "all" else "auto")
        if routing == "second":
            sparse.layers[1].ffn.set_sparse(True)
            assert sparse.ffn_routing() == [False, True]
        got = teacher_forced_logits(sparse, prompts, continuations, prefill_ffn="model")
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
        if routing == "all":
            assert generate(sparse, prompts, 3).tokens == want_tokens


@pytest.mark.parametrize("prefill_ffn", ["model", "auto", "auto, long prompts", "dense"])
def test_the_ffn_takes_the_twell_kernels_where_the_layer_is_sparse(monkeypatch, prefill_ffn):
    """The FFN of a sparse layer, and only there, reaches twell_ffn_inference: at every step, one row
    per sequence, and at the prefill with the padded prompts as prefill_ffn says: "model" always,
    "auto" from DENSE_PREFILL_TOKENS prompt tokens (here lowered to 6), "dense" never."""
    from twell import kernels
    from twell.model import generate as generation

    if prefill_ffn == "auto, long prompts":
        monkeypatch.setattr(generation, "DENSE_PREFILL_TOKENS", 6)
    model = make_model(5, n_heads=2, n_kv_heads=2, ffn_impl="auto")
    model.layers[0].ffn.set_sparse(True)
    calls, kernel = [], kernels.twell_ffn_inference

    def recorded(x, *weights, **options):
        calls.append((x.shape[0], weights[0].data_ptr()))
        return kernel(x, *weights, **options)

    monkeypatch.setattr(kernels, "twell_ffn_inference", recorded)
    prompts = [[1, 2, 3], [4]]
    decoder = Decoder(model, 2, 8, prefill_ffn=prefill_ffn.split(",")[0])
    tokens = generate(model, prompts, 3, decoder=decoder).tokens
    layer0 = model.layers[0].ffn.w_gate.data_ptr()
    sparse_prefill = prefill_ffn in ("model", "auto, long prompts")
    # the prefill (padded prompts) where it is sparse, then two steps
    assert calls == [(2 * 3, layer0)] * sparse_prefill + [(2, layer0), (2, layer0)]
    dense = make_model(5, n_heads=2, n_kv_heads=2)
    assert tokens == generate(dense, [[1, 2, 3], [4]], 3).tokens


def test_eos_stops_each_row_and_on_token_streams_what_is_returned():
    model = make_model(6)
    prompts = random_prompts([4, 2], SHAPE["vocab_size"], 6)
    free = generate(model, prompts, 10).tokens
    eos = free[0][3]  # row 0 emits it at step 3 (or earlier)
    stop_at = free[0].index(eos)
    streamed = []
    out = generate(model, prompts, 10, eos_token_id=[eos, 10**6], on_token=streamed.append)
    assert out.tokens[0] == free[0][: stop_at + 1]
    other = free[1][: free[1].index(eos) + 1] if eos in free[1] else free[1]
    assert out.tokens[1] == other
    assert len(streamed) == out.steps + 1
    for row in range(2):
        assert [s[row] for s in streamed if s[row] is not None] == out.tokens[row]
    # Once every row has stopped, no step runs.
    assert generate(model, [prompts[0]], 10, eos_token_id=eos).steps == stop_at


def test_seeded_sampling_is_reproducible():
    model = make_model(7)
    prompts = random_prompts([3, 5], SHAPE["vocab_size"], 7)

    def draw(seed, **options):
        return generate(model, prompts, 12, generator=torch.Generator().manual_seed(seed), **options).tokens

    for options in ({"temperature": 1.0}, {"temperature": 0.8, "top_k": 5, "top_p": 0.9}):
        assert draw(0, **options) == draw(0, **options)
        assert draw(0, **options) != draw(1, **options)
    greedy = generate(model, prompts, 12).tokens
    assert draw(3, temperature=1.0, top_k=1) == greedy  # one candidate: the argmax
    assert draw(3, temperature=1.0, top_p=1e-6) == greedy  # the first token alone reaches p


def test_sample_next_keeps_to_top_k_and_top_p_and_follows_the_probabilities():
    gen = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(20000, 4)
    counts = torch.bincount(sample_next(logits, 1.0, generator=gen), minlength=4) / 20000
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015, rtol=0)
    assert set(sample_next(logits, 1.0, top_k=2, generator=gen).tolist()) == {0, 1}
    # top_p 0.75: 0.5 + 0.3 reaches it, so the third token goes; 0.85 keeps it, not the fourth.
    assert set(sample_next(logits, 1.0, top_p=0.75, generator=gen).tolist()) == {0, 1}
    assert set(sample_next(logits, 1.0, top_p=0.85, generator=gen).tolist()) == {0, 1, 2}
    # A low temperature sharpens towards the argmax.
    assert (sample_next(logits, 0.05, generator=gen) == 0).float().mean() > 0.99


def test_bad_inputs_name_the_fix():
    model = make_model(8)
    with pytest.raises(ValueError, match=r"top_p=1\.5 must be in \(0, 1\]"):
        generate(model, [[1]], 2, top_p=1.5)
    with pytest.raises(ValueError, match="top_p=0 must be"):
        check_sampling(1.0, 0, 0)
    with pytest.raises(ValueError, match="temperature=-1 must be a finite number >= 0"):
        generate(model, [[1]], 2, temperature=-1)
    with pytest.raises(ValueError, match="top_k=2.5 must be an integer >= 0"):
        generate(model, [[1]], 2, top_k=2.5)
    with pytest.raises(ValueError, match="max_new_tokens=0 must be a positive integer"):
        generate(model, [[1]], 0)
    with pytest.raises(ValueError, match=r"positions exceed the model's max_seq_len=64; shorten"):
        generate(model, [[1] * 60], 6)
    decoder = Decoder(model, 2, 16)
    with pytest.raises(ValueError, match="exceed the decoder's KV cache max_len=16"):
        generate(model, [[1] * 10], 8, decoder=decoder)
    with pytest.raises(ValueError, match="3 prompts exceed the decoder's batch_size=2; build a Decoder"):
        generate(model, [[1], [2], [3]], 2, decoder=decoder)
    with pytest.raises(ValueError, match="a prompt of 17 tokens is longer than the KV cache"):
        decoder.prefill([[1] * 17])
    with pytest.raises(
        ValueError, match=r"prompt 1 must be a flat list of token ids in \[0, vocab_size=96\)"
    ):
        decoder.prefill([[1], [96]])
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        decoder.prefill([[1], []])
    with pytest.raises(RuntimeError, match="step\\(\\) before prefill"):
        Decoder(model, 1, 8).step(torch.tensor([1]))
    decoder.prefill([[1] * 15])
    decoder.step(torch.tensor([2]))  # slot 15, the last
    with pytest.raises(ValueError, match="the KV cache is full: max_len=16"):
        decoder.step(torch.tensor([2]))
    with pytest.raises(ValueError, match="KV cache max_len=65 exceeds the model's max_seq_len=64"):
        Decoder(model, 1, 65)
    with pytest.raises(ValueError, match=r"prefill_ffn='sparse' is not one of \('auto', 'dense', 'model'\)"):
        Decoder(model, 1, 8, prefill_ffn="sparse")
    with pytest.raises(ValueError, match=r"attention='flash' is not one of \('sdpa', 'flash_decode'\)"):
        Decoder(model, 1, 8, attention="flash")
    with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device"):
        Decoder(model, 1, 8, cuda_graph=True)


@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor needs a C++ compiler on CPU"
)
def test_compiled_decoder_equals_eager_and_compiles_one_block_for_every_layer():
    """Decoder(compile=True): the same logits as eager through a prefill and the steps after it (the
    cache writes land in the cache, not in a copy), one graph per kind of call shared by every layer, and
    no recompile from one step to the next."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = make_model(5, n_layers=3)
    prompts = random_prompts([3, 6], SHAPE["vocab_size"], 5)
    logits = {}
    for compile_blocks in (False, True):
        decoder = Decoder(model, 2, 16, compile=compile_blocks)
        logits[compile_blocks] = [decoder.prefill(prompts)]
        for _ in range(4):
            logits[compile_blocks].append(decoder.step(logits[compile_blocks][-1].argmax(-1)).clone())
    for eager, compiled in zip(logits[False], logits[True]):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    # prefill block, decode block, final norm: three graphs for three layers and five calls each.
    assert counters["stats"]["unique_graphs"] == 3
    torch._dynamo.reset()


def test_fused_qkv_projection_decodes_as_the_three_and_follows_weight_updates():
    """Decoder(fuse_qkv=True) reads q, k and v as one weight: the same logits as the three projections,
    and a weight changed in place after the decoder was built (an optimizer step) is picked up."""
    model = make_model(6)
    prompts = random_prompts([4, 7], SHAPE["vocab_size"], 6)

    def decode(fuse_qkv, decoder=None):
        decoder = decoder or Decoder(model, 2, 16, fuse_qkv=fuse_qkv)
        logits = [decoder.prefill(prompts)]
        for _ in range(3):
            logits.append(decoder.step(logits[-1].argmax(-1)).clone())
        return torch.stack(logits), decoder

    fused, decoder = decode(True)
    assert decoder.fused_qkv and not decode(False)[1].fused_qkv
    torch.testing.assert_close(fused, decode(False)[0], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        model.layers[1].attn.wk.weight.mul_(1.5)
    refreshed = decode(True, decoder)[0]
    torch.testing.assert_close(refreshed, decode(False)[0], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(refreshed, fused)


@pytest.mark.parametrize("compile_blocks", [False, True], ids=["eager", "compiled"])
def test_flash_decode_attention_decodes_as_sdpa(compile_blocks):
    """Decoder(attention="flash_decode"): the Triton decode attention (interpreter here; one opaque op in a
    compiled block) gives PyTorch's attention's logits at every step, rows of different lengths included
    (each row reads its cache only up to its own position)."""
    torch._dynamo.reset()
    model = make_model(12)
    prompts = random_prompts([1, 9, 4], SHAPE["vocab_size"], 12)
    continuations = random_prompts([6, 6, 6], SHAPE["vocab_size"], 112)
    want = teacher_forced_logits(model, prompts, continuations)
    got = teacher_forced_logits(
        model, prompts, continuations, attention="flash_decode", compile=compile_blocks
    )
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["dense", "twell"])
def test_cuda_graph_steps_equal_eager_steps_on_gpu(impl):
    """bf16 on the GPU, teacher-forced on the eager run's greedy tokens: the graphed decode gives the
    eager decode's logits; with compiled blocks and fused q/k/v (inductor rounds its fused norms and
    RoPE to bf16 at other points than eager) the logits stay as close to the fp32 model's as eager's."""
    model = make_model(9, ffn_impl=impl, d_model=128, d_ff=384).cuda()
    reference = copy.deepcopy(model)  # fp32
    model.to(torch.bfloat16)
    prompts = random_prompts([5, 17, 2, 9, 1, 30, 4, 8], SHAPE["vocab_size"], 9)

    def decode(net, batch, graph=False, compile_blocks=False, tokens=None, attention="sdpa"):
        decoder = Decoder(net, 8, 64, cuda_graph=graph, compile=compile_blocks, attention=attention)
        logits, fed = [decoder.prefill(prompts[:batch]).float()], []
        for step in range(6):
            fed.append(logits[-1].argmax(-1) if tokens is None else tokens[step])
            logits.append(decoder.step(fed[-1]).float())
        return torch.stack(logits), fed

    for batch in (1, 2, 8):
        eager, tokens = decode(model, batch)
        truth = decode(reference, batch, tokens=tokens)[0]
        graphed = decode(model, batch, graph=True, tokens=tokens)[0]
        torch.testing.assert_close(graphed, eager, rtol=2e-2, atol=2e-2)
        compiled = decode(model, batch, graph=True, compile_blocks=True, tokens=tokens)[0]
        eager_error, compiled_error = (eager - truth).abs().max(), (compiled - truth).abs().max()
        assert compiled_error <= 2 * eager_error + 1e-2, (batch, float(compiled_error), float(eager_error))
        flash = decode(
            model, batch, graph=True, compile_blocks=True, tokens=tokens, attention="flash_decode"
        )[0]
        flash_error = (flash - truth).abs().max()
        assert flash_error <= 2 * eager_error + 1e-2, (batch, float(flash_error), float(eager_error))
    out = generate(model, prompts, 6, cuda_graph=True)
    assert out.tokens == generate(model, prompts, 6).tokens
    # The graph captured at the cache's last slot (its warm-up steps must stay inside the cache).
    full = [[3] * 63]
    assert generate(model, full, 2, cuda_graph=True).tokens == generate(model, full, 2).tokens
    with pytest.raises(ValueError, match="generator is on cpu but the model is on cuda"):
        generate(model, prompts, 2, temperature=1.0, generator=torch.Generator())


def test_generate_script_streams_one_prompt_and_batches_a_file(tmp_path, capsys):
    import generate as generate_script  # scripts/, on sys.path through tests/conftest.py

    from twell.data.tokenizer import train_bpe_tokenizer
    from twell.model.hf_io import export_hf

    texts = [f"the cache holds {w} keys and {w} values for every layer." for w in ("old", "new", "many")] * 20
    tokenizer = train_bpe_tokenizer(texts, 300, tmp_path / "tok")
    model = make_model(10, vocab_size=len(tokenizer))
    folder = export_hf(model, tokenizer, tmp_path / "hf")
    base = [f"checkpoint={folder}", "max_new_tokens=6", "stop_at_eos=false"]

    rows = generate_script.main(base + ["prompt=the cache"])
    printed = capsys.readouterr().out
    prompt_ids = [tokenizer.eos_token_id] + tokenizer("the cache", add_special_tokens=False)["input_ids"]
    assert rows[0]["tokens"] == generate(model, [prompt_ids], 6).tokens[0]
    assert printed == "the cache" + rows[0]["completion"] + "\n"  # streamed piece by piece

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cache\n\nholds\nevery layer\n")
    out = tmp_path / "out.jsonl"
    rows = generate_script.main(base + [f"file={prompts}", "batch_size=2", f"out={out}"])
    assert [r["prompt"] for r in rows] == ["the cache", "holds", "every layer"]
    for row in rows:  # batched greedy = each alone
        ids = [tokenizer.eos_token_id] + tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        assert row["tokens"] == generate(model, [ids], 6).tokens[0]
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    with pytest.raises(ValueError, match='exactly one of prompt="<text>" or file='):
        generate_script.main(base)
    with pytest.raises(ValueError, match="stop_at_eos='maybe' must be true or false"):
        generate_script.main([f"checkpoint={folder}", "prompt=x", "stop_at_eos=maybe"])
    # numbers are checked by name before the checkpoint is read (nothing printed, nothing loaded)
    capsys.readouterr()
    for setting, message in [
        ("max_new_tokens=-3", "max_new_tokens=-3 must be >= 1"),
        ("max_new_tokens=ten", "max_new_tokens='ten' must be an integer"),
        ("top_p=1.5", r"top_p=1.5 must be in \(0, 1\]"),
        ("temperature=hot", "temperature='hot' must be a number"),
    ]:
        with pytest.raises(ValueError, match=message):
            generate_script.main(["checkpoint=/nowhere", "prompt=x", setting])
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_bench_generate_quick_writes_table_json_and_png(tmp_path):
    import bench_generate  # scripts/

    rows = bench_generate.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    assert [(r["impl"], r["batch"]) for r in rows] == [("dense", 1), ("dense", 2), ("twell", 1), ("twell", 2)]
    for row in rows:
        assert row["ttft_ms"] > 0 and row["decode_tok_s"] > 0 and row["new_tokens"] == 3
        assert row["x_dense"] == pytest.approx(
            row["decode_tok_s"] / rows[0 if row["batch"] == 1 else 1]["decode_tok_s"]
        )
    for row in rows[2:]:  # fp32: the TwELL kernels give dense's greedy tokens
        assert row["agreement"]["rows_equal"] == row["agreement"]["rows"] == row["batch"]
    for dense, sparse in zip(rows[:2], rows[2:]):  # the bytes floor: TwELL skips w_up / w_down
        assert dense["sparse_layers"] == 0 and sparse["sparse_layers"] == 1
        assert dense["step_bytes"] == dense["dense_step_bytes"] == sparse["dense_step_bytes"]
        assert sparse["step_bytes"] == dense["step_bytes"] - 2 * 128 * 64 * 4  # d_ff x d_model x 2, fp32
        assert sparse["tb_s"] == pytest.approx(sparse["step_bytes"] / (sparse["step_ms"] * 1e-3) / 1e12)
    doc = json.loads((tmp_path / "bench_generate.json").read_text())
    assert doc["rows"] == rows and doc["calibration"]["tiny"]["tokens"] == 2 * 8
    assert (tmp_path / "bench_generate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_generate_step_bytes_counts_weights_once_and_the_cache_as_attention_reads_it():
    import bench_generate  # scripts/

    cfg = ModelConfig.preset("1.5b")  # 28 layers, d 2048, 32 of 32 KV heads, d_ff 5632, vocab 49152
    d, f, layers = 2048, 5632, 28
    weights = layers * (4 * d * d + 3 * f * d) + 49152 * d
    slot = 2 * d  # k and v of one position, one layer
    sdpa = bench_generate.step_bytes(cfg, 8, 512, 256, 768, "sdpa", sparse_layers=0)
    assert sdpa == 2 * (weights + layers * 8 * 768 * slot)
    flash = bench_generate.step_bytes(cfg, 8, 512, 256, 768, "flash_decode", sparse_layers=0)
    assert flash == 2 * (weights + layers * 8 * (512 + 128) * slot)  # each row up to its own position
    sparse = bench_generate.step_bytes(cfg, 8, 512, 256, 768, "sdpa", sparse_layers=layers)
    assert sparse == sdpa - 2 * layers * 2 * f * d  # a TwELL layer's floor: no w_up / w_down row
    # at batch 64 the cache outweighs the weights: the most TwELL can gain is 1.10x (1.099)
    big = [bench_generate.step_bytes(cfg, 64, 512, 256, 768, "sdpa", n) for n in (0, layers)]
    assert 1.05 < big[0] / big[1] < 1.1
    gqa = ModelConfig.preset("1.5b", n_kv_heads=8)
    assert bench_generate.step_bytes(gqa, 1, 512, 256, 768, "sdpa", 0) < sdpa


def test_bench_generate_agreement_finds_the_first_difference_and_its_logit_gap():
    import bench_generate  # scripts/

    model = make_model(11)
    prompts = torch.tensor(random_prompts([5, 5], SHAPE["vocab_size"], 11))
    dense = generate(model, prompts, 6).tokens
    sparse = [list(dense[0]), dense[1][:2] + [(dense[1][2] + 1) % SHAPE["vocab_size"]] + dense[1][3:]]
    report = bench_generate.agreement(model, prompts, dense, sparse)
    assert report["rows_equal"] == 1 and report["rows"] == 2
    assert report["equal_share"] == pytest.approx((1 + 2 / 6) / 2)
    # dense's own token is its argmax there: a positive gap in bf16 steps
    assert len(report["gap_steps"]) == 1 and report["gap_steps"][0] > 0
    assert report["ties"] == (report["gap_steps"][0] <= 1)
