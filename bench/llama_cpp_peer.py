"""llama.cpp (through `llama-cpp-python`) as an optional peer of the real-model bench, on the same
SmolLM2 weights: the shipped GGUF as it is (Q4_1, its embedding Q8_0) and converted to F16.

`llama-cpp-python` is not a dependency of the project (it builds llama.cpp from source, minutes on 2
cores): `available()` says whether it is installed, and the bench leaves the column out where not.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import numpy as np


def available() -> bool:
    """Whether `llama_cpp` can be imported."""
    return importlib.util.find_spec("llama_cpp") is not None


def f16_gguf(source: Path, cache: Path | None = None) -> Path:
    """`source` GGUF with every quantized tensor dequantized to F16 (float32 tensors stay float32),
    written once into `cache` (default `~/.cache/jaxlongctx/gguf`); its path."""
    import gguf

    cache = cache or Path.home() / ".cache" / "jaxlongctx" / "gguf"
    out = cache / f"{source.stem.rsplit('.', 1)[0]}.F16.gguf"
    if out.is_file() and out.stat().st_mtime >= source.stat().st_mtime:
        return out
    cache.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer writes the header and the architecture itself
        value = field.contents()
        if field.name == "general.file_type":
            value = int(gguf.LlamaFileType.MOSTLY_F16)
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy shape: GGUF's dims reversed
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            data = data.astype(np.float16)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out


class LlamaCpp:
    """One llama.cpp context on a GGUF file: prefill of a prompt and greedy decode steps after it."""

    def __init__(self, path: Path, threads: int, context: int):
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(path),
            n_ctx=context,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
        )

    def prefill(self, ids: np.ndarray) -> None:
        """Evaluate prompt `ids [T]` from an empty cache (its K/V stay for `decode`)."""
        self.llm.reset()
        self.llm.eval([int(i) for i in ids])

    def decode(self, steps: int) -> float:
        """Seconds for `steps` greedy steps after the evaluated prompt (then rolled back to it)."""
        start = self.llm.n_tokens
        ctx = self.llm._ctx.ctx
        import llama_cpp

        vocab = self.llm.n_vocab()
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(vocab,))
            self.llm.eval([int(np.argmax(logits))])
        elapsed = time.perf_counter() - t0
        self.llm.n_tokens = start  # the next eval drops the decoded tokens' K/V
        return elapsed

    def close(self) -> None:
        """Free the model and its context."""
        self.llm.close()


def info() -> dict[str, Any]:
    """The llama-cpp-python version and llama.cpp's system info (its SIMD flags)."""
    import llama_cpp

    return {
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(),
    }
