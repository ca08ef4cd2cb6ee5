"""Convert between our checkpoints and Hugging Face Llama folders (hidden_act="relu").

    python scripts/hf.py export checkpoint=outputs/quickstart/checkpoints out=exported/quickstart [dtype=bfloat16]
    python scripts/hf.py import path=SparseLM-1.5B out=imported/sparselm-1.5b.pt

export: a trainer checkpoint (or HF folder) -> LlamaForCausalLM folder with safetensors and the
tokenizer (from the run config's data.tokenizer, or tokenizer=...). Shape keys as in scripts/eval.py.
import: a Llama folder with a ReLU-gated MLP (e.g. SakanaAI/SparseLM*) -> our model; prints its
config and, with out=, saves {"config": ModelConfig fields, "model": state_dict} with torch.save.
"""

import dataclasses
import json
import sys

import torch


def _words(argv: list[str]) -> dict:
    out = {}
    for word in argv:
        key, sep, value = word.partition("=")
        if not sep:
            raise SystemExit(f"error: expected key=value, got {word!r}\n\n{__doc__}")
        out[key] = value
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("export", "import"):
        raise SystemExit(__doc__)
    args = _words(argv[1:])
    if argv[0] == "export":
        from twell.data import load_tokenizer
        from twell.eval.load import load_for_eval
        from twell.model.hf_io import export_hf

        for key in ("checkpoint", "out"):
            if key not in args:
                raise SystemExit(f"error: export needs {key}=...\n\n{__doc__}")
        dtype = getattr(torch, args["dtype"]) if "dtype" in args else None
        net, tokenizer_name = load_for_eval(
            args["checkpoint"], preset=args.get("model"), tokenizer=args.get("tokenizer")
        )
        out = export_hf(net, load_tokenizer(tokenizer_name), args["out"], dtype=dtype)
        print(
            f"wrote {out} (LlamaForCausalLM, hidden_act=relu, {net.cfg.num_params() / 1e6:.2f}M parameters)"
        )
    else:
        from twell.model.hf_io import import_hf

        if "path" not in args:
            raise SystemExit(f"error: import needs path=<HF folder>\n\n{__doc__}")
        cfg, net = import_hf(args["path"])
        print(json.dumps(dataclasses.asdict(cfg), indent=1))
        if "out" in args:
            torch.save({"config": dataclasses.asdict(cfg), "model": net.state_dict()}, args["out"])
            print(f"saved {args['out']}")


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as err:  # bad input: its message names the fix, as train.py's
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
