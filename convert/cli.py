"""The converter's command line (the same options as `jaxlongctx convert`):

python -m convert.cli --hf-dir DIR --out CKPT [--dtype bf16|fp32]
python -m convert.cli --gguf FILE --out CKPT [--dtype bf16|fp32]
python -m convert.cli --export CKPT --out HF_DIR
python -m convert.cli --armt-hf DIR --out CKPT [--base-config BASE_DIR]   (published ARMT format)
python -m convert.cli --export-armt-hf CKPT --out DIR
"""

from __future__ import annotations

import argparse
import sys

from convert.armt_hf import convert_armt_hf_to_ckpt, export_ckpt_to_armt_hf
from convert.gguf_llama import convert_gguf_to_ckpt
from convert.hf_llama import DTYPES, ConversionError, convert_hf_to_ckpt, export_ckpt_to_hf


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The converter's command-line options (shared with `jaxlongctx convert`)."""
    p.add_argument("--hf-dir", help="HF model directory (config.json + *.safetensors) to import")
    p.add_argument(
        "--gguf",
        metavar="FILE",
        help="llama.cpp GGUF file (llama, qwen2, qwen3; F32/F16/BF16 or "
        "Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K) to import, with its tokenizer and chat template",
    )
    p.add_argument(
        "--export", metavar="CKPT", help="export this jaxlongctx checkpoint to a HF directory instead"
    )
    p.add_argument(
        "--armt-hf",
        metavar="DIR",
        help="an ARMT in the authors' published format (config.json model_type 'armt') to import",
    )
    p.add_argument(
        "--export-armt-hf", metavar="CKPT", help="export this ARMT checkpoint to the published format instead"
    )
    p.add_argument(
        "--base-config",
        metavar="DIR",
        help="with --armt-hf: the base model's HF directory (or config.json) when the ARMT config names "
        "a base that is not built in",
    )
    p.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="parameter dtype of the import (default: bf16 if the source is bf16, else fp32)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")


def run(args: argparse.Namespace) -> int:
    """Run a parsed conversion command; returns the exit code."""
    try:
        if sum(map(bool, (args.hf_dir, args.gguf, args.armt_hf, args.export, args.export_armt_hf))) != 1:
            raise ConversionError(
                "give exactly one of --hf-dir, --gguf or --armt-hf (import) or --export or --export-armt-hf "
                "(export)"
            )
        if args.base_config and not args.armt_hf:
            raise ConversionError("--base-config goes with --armt-hf")
        if args.armt_hf:
            out = convert_armt_hf_to_ckpt(
                args.armt_hf, args.out, args.dtype, base_config_dir=args.base_config, overwrite=args.overwrite
            )
        elif args.export_armt_hf:
            out = export_ckpt_to_armt_hf(args.export_armt_hf, args.out, overwrite=args.overwrite)
        elif args.export:
            out = export_ckpt_to_hf(args.export, args.out, overwrite=args.overwrite)
        elif args.gguf:
            out = convert_gguf_to_ckpt(args.gguf, args.out, args.dtype, overwrite=args.overwrite)
        else:
            out = convert_hf_to_ckpt(args.hf_dir, args.out, args.dtype, overwrite=args.overwrite)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m convert.cli` entry point."""
    p = argparse.ArgumentParser(
        prog="python -m convert.cli",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
