import json

import pytest
import torch

from twell.model import ModelConfig, Transformer
from twell.model.hf_io import export_hf, import_hf


def hf_logits(folder, tokens):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(tokens).logits


@pytest.mark.parametrize("n_kv_heads, tie", [(4, True), (2, False)])
def test_export_loads_in_transformers_with_our_logits_and_imports_back(
    tmp_path, tiny_tokenizer, n_kv_heads, tie
):
    cfg = ModelConfig(
        vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, d_ff=128,
        max_seq_len=64, rope_theta=float(torch.randint(1000, 200000, ()).item()), tie_embeddings=tie,
    )  # fmt: skip
    net = Transformer(cfg).eval()
    out = export_hf(net, tiny_tokenizer, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_act"] == "relu" and config["tie_word_embeddings"] == tie
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()

    tokens = torch.randint(0, 512, (2, 40))
    with torch.no_grad():
        ours = net(tokens).logits
    torch.testing.assert_close(hf_logits(out, tokens), ours, atol=1e-5, rtol=1e-5)

    cfg_back, back = import_hf(out)
    assert cfg_back.rope_theta == cfg.rope_theta and cfg_back.n_kv_heads == n_kv_heads
    assert cfg_back.tie_embeddings == tie
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, ours, atol=1e-6, rtol=1e-6)

    from transformers import AutoTokenizer

    text = "a round trip of the tokenizer"
    assert AutoTokenizer.from_pretrained(out).encode(text) == tiny_tokenizer.encode(text)


def write_sparselm_style_checkpoint(folder, d=64, f=192, layers=2, heads=4, vocab=256):
    """A small checkpoint in the released SakanaAI/SparseLM layout: Llama config with a ReLU-gated
    MLP, bf16 safetensors sharded in two files with an index, tied embeddings (no lm_head tensor)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "relu",
        "hidden_size": d, "intermediate_size": f, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "vocab_size": vocab,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "attention_bias": False,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))

    def w(*shape):
        return (torch.randn(*shape) * 0.05).to(torch.bfloat16)

    shards = [{"model.embed_tokens.weight": w(vocab, d), "model.norm.weight": 1 + w(d)}, {}]
    for i in range(layers):
        p = f"model.layers.{i}."
        shard = shards[i % 2]
        shard.update({p + f"self_attn.{n}_proj.weight": w(d, d) for n in "qkvo"})
        shard.update({p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d)})
        shard[p + "mlp.down_proj.weight"] = w(d, f)  # [D, F], nn.Linear layout
        shard.update(
            {p + "input_layernorm.weight": 1 + w(d), p + "post_attention_layernorm.weight": 1 + w(d)}
        )
    weight_map = {}
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return {k: v for shard in shards for k, v in shard.items()}


def test_import_sparselm_layout_matches_transformers(tmp_path):
    folder = tmp_path / "SparseLM-small"
    weights = write_sparselm_style_checkpoint(folder)
    cfg, net = import_hf(folder)
    assert (cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size, cfg.rope_theta) == (64, 192, 2, 256, 1e5)
    assert cfg.tie_embeddings and net.output_weight() is net.tok_embeddings.weight
    down = weights["model.layers.1.mlp.down_proj.weight"].float()
    torch.testing.assert_close(net.layers[1].ffn.w_down, down.t())  # neuron-major: [F, D]
    tokens = torch.randint(0, 256, (3, 30))
    with torch.no_grad():
        torch.testing.assert_close(net(tokens).logits, hf_logits(folder, tokens), atol=1e-5, rtol=1e-5)


def test_import_refuses_what_it_cannot_represent(tmp_path):
    folder = tmp_path / "silu"
    write_sparselm_style_checkpoint(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "silu"}))
    with pytest.raises(ValueError, match="hidden_act='silu'.*relu"):
        import_hf(folder)
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    shard = folder / "model-00002-of-00002.safetensors"  # holds layer 1
    tensors = load_file(str(shard))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(shard))
    with pytest.raises(KeyError, match=r"model.layers.1.mlp.up_proj.weight"):
        import_hf(folder)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        import_hf(tmp_path)


def test_a_failed_export_leaves_nothing_behind(tmp_path):
    net = Transformer(
        ModelConfig(vocab_size=512, d_model=64, n_layers=1, n_heads=2, d_ff=128, max_seq_len=64)
    )
    out = tmp_path / "exported"
    # Not a tokenizer: the export fails after the weights and config.json are written.
    with pytest.raises(AttributeError, match="save_pretrained"):
        export_hf(net, "not a tokenizer", out)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # A previous export is replaced only by a complete one; a folder of other files is refused.
    export_hf(net, None, out)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="is not a Hugging Face model folder"):
        export_hf(net, None, tmp_path / "notes")
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep"
