"""Convert between our Transformer and a Hugging Face `LlamaForCausalLM` folder (hidden_act="relu").

Our layers use Llama's layouts (rotate-half RoPE, q/k/v/o in nn.Linear layout), so weights map
1:1 by name; the only change is the down projection, which we store neuron-major ([d_ff, d_model])
while Llama's `down_proj.weight` is [d_model, d_ff]. The released SakanaAI/SparseLM checkpoints use
this same Llama layout with a ReLU-gated MLP, so `import_hf` reads them too.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from twell.model.config import ModelConfig
from twell.model.transformer import Transformer


def llama_config(cfg: ModelConfig, dtype: torch.dtype | None = None):
    """The `transformers.LlamaConfig` describing the same network as `cfg`."""
    from transformers import LlamaConfig

    kwargs = {"torch_dtype": dtype} if dtype is not None else {}
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="relu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        architectures=["LlamaForCausalLM"],
        **kwargs,
    )


def _name_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our name, HF name) for every weight except the down projections."""
    pairs = [("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        pairs.append(("lm_head.weight", "lm_head.weight"))
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        pairs += [
            (ours + "attn_norm.weight", hf + "input_layernorm.weight"),
            (ours + "ffn_norm.weight", hf + "post_attention_layernorm.weight"),
            (ours + "ffn.w_gate", hf + "mlp.gate_proj.weight"),
            (ours + "ffn.w_up", hf + "mlp.up_proj.weight"),
        ]
        pairs += [(ours + f"attn.w{p}.weight", hf + f"self_attn.{p}_proj.weight") for p in "qkvo"]
    return pairs


def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    ours = model.state_dict()
    state = {hf: ours[name] for name, hf in _name_pairs(model.cfg)}
    for i in range(model.cfg.n_layers):
        state[f"model.layers.{i}.mlp.down_proj.weight"] = ours[f"layers.{i}.ffn.w_down"].t()
    return state


def export_hf(model: Transformer, tokenizer, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write a `LlamaForCausalLM` folder (config.json, model.safetensors, tokenizer files).

    dtype: store weights in this dtype (e.g. torch.bfloat16); default: the model's own.
    Written into `<out_dir>.tmp` and renamed at the end: a failed export leaves no half-written folder
    at out_dir. An existing out_dir is replaced only once the new one is complete.
    """
    import shutil

    final = Path(out_dir)
    # A previous export (or an empty folder) is replaced at the end; any other folder is left alone.
    if final.exists() and (
        not final.is_dir() or (any(final.iterdir()) and not (final / "config.json").is_file())
    ):
        raise FileExistsError(
            f"out={final} exists and is not a Hugging Face model folder (no config.json); export to a new "
            "folder, or remove it first"
        )
    out = final.with_name(final.name + ".tmp")
    shutil.rmtree(out, ignore_errors=True)  # left by an export that failed
    out.mkdir(parents=True)
    try:
        _write_hf(model, tokenizer, out, dtype)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    out.replace(final)
    return final


def _write_hf(model: Transformer, tokenizer, out: Path, dtype: torch.dtype | None) -> None:
    from safetensors.torch import save_file

    state = {
        name: t.detach().to(device="cpu", dtype=dtype or t.dtype).contiguous()
        for name, t in to_hf_state_dict(model).items()
    }
    source = getattr(model, "source", None)  # the checkpoint step it was read from (eval.load.load_for_eval)
    metadata = {"format": "pt", **({"twell_source": source} if source else {})}
    save_file(state, str(out / "model.safetensors"), metadata=metadata)
    hf_config = llama_config(model.cfg, dtype or model.tok_embeddings.weight.dtype)
    if source:
        hf_config.twell_source = source  # kept in config.json: which training step this export holds
    hf_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig from a Llama config.json dict; refuses what our model cannot represent."""
    act = hf.get("hidden_act", "silu")
    if act != "relu":
        raise ValueError(
            f"hidden_act={act!r}: this model has a ReLU-gated FFN and can only import Llama checkpoints "
            f'with hidden_act="relu" (SiLU/SwiGLU Llamas are a different network)'
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"{flag}=true: our model has no biases; this checkpoint cannot be imported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"RoPE scaling {rope} is not supported (only plain RoPE)")
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    d_model, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d_model // n_heads
    if head_dim * n_heads != d_model:
        raise ValueError(f"head_dim={head_dim} x num_attention_heads={n_heads} != hidden_size={d_model}")
    fields = dict(
        vocab_size=hf["vocab_size"],
        d_model=d_model,
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope_theta),
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        init_std=hf.get("initializer_range", 0.02),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )
    return ModelConfig(**{**fields, **overrides})


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"{folder} has no model.safetensors (or model.safetensors.index.json); "
            "only safetensors checkpoints can be imported"
        )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(folder / name)))
    return state


def import_hf(
    path: str | Path, dtype: torch.dtype = torch.float32, **overrides
) -> tuple[ModelConfig, Transformer]:
    """Read a Llama (ReLU-gated MLP) folder into (ModelConfig, Transformer) on the CPU.

    overrides: ModelConfig fields to set, e.g. ffn_impl="twell".
    """
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    hf = json.loads(config_file.read_text())
    state = {k.removeprefix("module."): v for k, v in _read_safetensors(folder).items()}
    if "tie_word_embeddings" not in hf:
        # Llama's own default is untied; a checkpoint without an lm_head tensor can only be tied.
        hf = {**hf, "tie_word_embeddings": "lm_head.weight" not in state}
    cfg = config_from_hf(hf, **overrides)
    if not cfg.tie_embeddings and "lm_head.weight" not in state:
        raise KeyError(f"{folder}: tie_word_embeddings is false but there is no lm_head.weight")

    with torch.device("meta"):
        net = Transformer(cfg)
    ours: dict[str, torch.Tensor] = {}
    missing = []
    for name, hf_name in _name_pairs(cfg):
        if hf_name in state:
            ours[name] = state[hf_name]
        else:
            missing.append(hf_name)
    for i in range(cfg.n_layers):
        hf_name = f"model.layers.{i}.mlp.down_proj.weight"
        if hf_name in state:
            ours[f"layers.{i}.ffn.w_down"] = state[hf_name].t()
        else:
            missing.append(hf_name)
    if missing:
        raise KeyError(f"{folder}: {len(missing)} weights missing, e.g. {missing[:3]}")
    net.to_empty(device="cpu")
    net.init_weights()  # RoPE tables and routing flags; the weights are overwritten next
    for name, tensor in ours.items():
        expected = net.get_parameter(name).shape
        if tensor.shape != expected:
            raise ValueError(
                f"{folder}: {name} has shape {tuple(tensor.shape)}, config implies {tuple(expected)}"
            )
    net.load_state_dict(ours, strict=False)
    return cfg, net.to(dtype)
