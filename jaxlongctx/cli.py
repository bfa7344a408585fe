"""The `jaxlongctx` command line: convert, generate, demo."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

DESCRIPTION = """jaxlongctx: long-context Llama inference in JAX.

commands:
  demo       run a long prompt through prefill and decode on the embedded default model
             (or --ckpt), printing tokens/s, peak memory and the generated ids
  generate   generate text or ids from a checkpoint or HF model directory
  convert    import a HF Llama/Mistral/Qwen2/Qwen3 model (safetensors) or export one back
"""


def _cmd_demo(args: argparse.Namespace) -> int:
    from jaxlongctx.demo import DEFAULT_CONFIG, run_demo
    from jaxlongctx.loading import load
    from jaxlongctx.model.model import Model
    from jaxlongctx.parallel import mesh_from_args, shard_model

    mesh = mesh_from_args(args)
    if args.ckpt:
        model = load(args.ckpt, args.dtype, mesh=mesh)
    else:
        model = shard_model(Model.init(DEFAULT_CONFIG), mesh) if mesh else None
    result = run_demo(model, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, seed=args.seed)
    if args.json:
        print(json.dumps(result))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import numpy as np

    from jaxlongctx.generate import generate
    from jaxlongctx.loading import load

    from jaxlongctx.parallel import mesh_from_args

    model = load(args.ckpt, args.dtype, mesh=mesh_from_args(args))
    if (args.prompt is None) == (args.ids is None):
        raise ValueError("give exactly one of --prompt TEXT or --ids '1 2 3'")
    if args.prompt is not None:
        if model.tokenizer is None:
            raise ValueError(f"{args.ckpt} has no tokenizer.json; pass token ids with --ids instead of --prompt")
        ids = np.asarray([model.tokenizer.encode(args.prompt).ids], np.int32)
    else:
        try:
            ids = np.asarray([[int(x) for x in args.ids.replace(",", " ").split()]], np.int32)
        except ValueError:
            raise ValueError(f"--ids must be integers separated by spaces or commas, got {args.ids!r}") from None
    out = generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, progress=True)
    new = out[0, ids.shape[1]:].tolist()
    if model.tokenizer is not None:
        print(model.tokenizer.decode(new))
    else:
        print(" ".join(map(str, new)))
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from convert.hf_llama import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from jaxlongctx.parallel import add_parallel_arguments

    p = argparse.ArgumentParser(prog="jaxlongctx", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="long-prompt prefill + decode on the embedded default model",
                       description="Prefill a long prompt and decode greedily; prints tokens/s, peak memory "
                                   "and the generated ids.")
    d.add_argument("--ckpt", help="checkpoint or HF directory (default: the embedded default model)")
    d.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="parameter dtype (default: as stored)")
    d.add_argument("--prompt-tokens", type=int, default=8192, help="prompt length in tokens (default 8192)")
    d.add_argument("--new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="also print the measurements as one JSON line")
    add_parallel_arguments(d)
    d.set_defaults(func=_cmd_demo)

    g = sub.add_parser("generate", help="generate from a checkpoint or HF directory",
                       description="Generate from a jaxlongctx checkpoint or a HF model directory "
                                   "(converted on the fly). Text prompts need a tokenizer.json next to the model.")
    g.add_argument("--ckpt", required=True, help="jaxlongctx checkpoint or HF model directory")
    g.add_argument("--prompt", help="text prompt (needs tokenizer.json)")
    g.add_argument("--ids", help="prompt token ids, e.g. '1 2 3'")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=["bf16", "fp32"], default=None)
    add_parallel_arguments(g)
    g.set_defaults(func=_cmd_generate)

    c = sub.add_parser("convert", help="import a HF model (safetensors) or export ours to HF",
                       description="Import: --hf-dir DIR --out CKPT [--dtype bf16|fp32]. "
                                   "Export: --export CKPT --out HF_DIR. Writes are atomic.")
    from convert.hf_llama import add_arguments

    add_arguments(c)
    c.set_defaults(func=_cmd_convert)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxlongctx` command."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
