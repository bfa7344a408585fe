"""`ARMTModel`: a Llama model with ARMT memory, run by the sequential or the diagonal schedule."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import jaxlongctx.armt.stream as stream
from jaxlongctx.armt.base_adapter import adapter_bytes, apply_adapter, restore_adapter, write_adapter
from jaxlongctx.armt.base_reference import BaseReference, load_referenced_base
from jaxlongctx.armt.config import ARMTConfig
from jaxlongctx.armt.cpu_execution import CPUExecution, diagonal_pays_off
from jaxlongctx.armt.diagonal import diagonal_forward
from jaxlongctx.armt.generation import generate_ids, generation_logits
from jaxlongctx.armt.memory import MemoryState
from jaxlongctx.armt.memory_checkpoint import restore_memory, write_memory
from jaxlongctx.armt.open_segment import generate_open_segment, uses_open_segment
from jaxlongctx.armt.params import MemoryParams
from jaxlongctx.armt.projections import DiagonalProjections, as_projections
from jaxlongctx.armt.segments import Segments, compact, grid_starts, segment, segment_at, token_rows
from jaxlongctx.armt.sentences import SentenceSegmenter, make_segmenter
from jaxlongctx.armt.sequential import sequential_forward
from jaxlongctx.cache_choice import ARMTMemory, CacheChoice, OwnMemoryModel
from jaxlongctx.checkpoint import (
    CheckpointError,
    atomic_directory,
    load_module,
    read_metadata,
    save_params,
    write_metadata,
)
from jaxlongctx.config import ModelConfig
from jaxlongctx.kvcache.dense import dense_cache_bytes
from jaxlongctx.model.llama import Llama
from jaxlongctx.model.model import Model
from jaxlongctx.model.rope import inverse_frequencies
from jaxlongctx.parallel import param_shardings, shard_memory
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.tokenizer import ChatTokenizer
from jaxlongctx.validation import check_ids, check_mask, check_positive_int

SCHEDULES = stream.SCHEDULES
TRAINING_RECORD = "training.json"  # how a saved ARMT model was trained (see `ARMTModel.save`)


def saved_training_record(directory: str | Path) -> dict[str, Any]:
    """The training record an ARMT save wrote in `directory` (its `runs`, ...); {} without one."""
    file = Path(directory) / TRAINING_RECORD
    return json.loads(file.read_text()) if file.is_file() else {}


class ARMTModel(OwnMemoryModel):
    """`armt_model(ids, attention_mask=None, schedule="diagonal") -> logits [B, T, V]` (float32).

    Rows are independent: each row's real tokens (per `attention_mask`, pads anywhere) are cut into
    segments as if the row were alone: on a fixed grid of S tokens, or with `segmentation =
    "sentences"` after sentence ends (see `jaxlongctx.armt.sentences`; the calls and generation, not
    streaming). Parameters are `(base parameters, memory parameters)` (see `params`).
    """

    def __init__(self, base: Llama, armt: ARMTConfig, memory: MemoryParams, tokenizer: Any = None):
        self.base = Model(base, tokenizer)
        self.memory = memory
        self._place_memory()
        self.armt = armt
        self.config: ModelConfig = base.config
        self.tokenizer = tokenizer
        self.inv_freq = inverse_frequencies(self.config)
        self.cpu_execution = CPUExecution()  # how the diagonal schedule runs on CPU (same results)
        self._projections = DiagonalProjections()
        self._segmenter: SentenceSegmenter | None = None
        self.base_reference: BaseReference | None = None  # set when loaded from a memory-only checkpoint
        self.remat = False  # recompute each cell's activations in the backward pass (training memory)

    @classmethod
    def wrap(cls, model: Model, armt: ARMTConfig, key: jax.Array) -> ARMTModel:
        """Add freshly initialised memory parameters (reference init, W_mv = 0) to a loaded model."""
        if not isinstance(armt, ARMTConfig):
            raise ValueError(f"expected an ARMTConfig, got {type(armt).__name__}")
        embed = model.module.embed[...]
        memory = MemoryParams(
            armt,
            model.config.num_layers,
            model.config.hidden_size,
            float(jnp.std(embed.astype(jnp.float32))),
            dtype=embed.dtype,
            key=key,
        )
        return cls(model.module, armt, memory, model.tokenizer)

    # --- parameters -----------------------------------------------------------------------------
    @property
    def dtype(self) -> jnp.dtype:
        """Parameter dtype."""
        return self.base.dtype

    def _place_memory(self) -> None:
        """Put the memory parameters on the base model's mesh (W_mv column parallel); no-op without one."""
        if self.base.mesh is not None:
            shard_memory(self.memory, self.base.mesh)

    @cached_property
    def _memory_graphdef(self) -> nnx.GraphDef:
        return nnx.split(self.memory)[0]

    @property
    def params(self) -> tuple[nnx.State, nnx.State]:
        """`(base parameters, memory parameters)` as `nnx.State`s: the differentiable parameter pytree."""
        return self.base.params, nnx.state(self.memory)

    def merge(self, params: tuple[nnx.State, nnx.State]) -> tuple[Llama, MemoryParams]:
        """The base module and the memory parameters (`MemoryParams`) rebuilt from `params` (use inside
        traced functions)."""
        return self.base.merge(params[0]), nnx.merge(self._memory_graphdef, params[1])

    def astype(self, dtype: jnp.dtype) -> ARMTModel:
        """A copy with every parameter cast to `dtype` (the state dtype is unchanged)."""
        cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)
        base, memory = self.merge((cast(self.base.params), cast(nnx.state(self.memory))))
        out = ARMTModel(base, self.armt, memory, self.tokenizer)
        out.cpu_execution = self.cpu_execution
        out.projections = self.projections
        out._segmenter = self._segmenter
        return out

    def randomize_memory_params(self, key: jax.Array, scale: float = 1.0) -> ARMTModel:
        """Randomise W_mq, W_mk, W_mv, W_mb, b_mb in place (see `MemoryParams.randomize`); returns self."""
        self.memory.randomize(key, scale)
        self._place_memory()
        return self

    def set_memory_params(self, **arrays: Any) -> ARMTModel:
        """Set memory parameters by name (memory: the memory tokens; wq, wk, wv, wb, bb: the memory
        weights), shapes checked; returns self."""
        for name, value in arrays.items():
            if name not in ("memory", "wq", "wk", "wv", "wb", "bb"):
                raise ValueError(f"unknown memory parameter {name!r}")
            param = getattr(self.memory, name)
            value = jnp.asarray(value)
            if value.shape != param.shape:
                raise ValueError(f"memory parameter {name}: expected shape {param.shape}, got {value.shape}")
            param.set_value(value.astype(param.dtype))
        self._place_memory()
        return self

    @property
    def projections(self) -> DiagonalProjections:
        """How a diagonal step multiplies by the stacked layer weights (same results either way): set a
        method name ("auto", "vmap", "grouped_matmul") or a `DiagonalProjections` (method + kernel backend)."""
        return self._projections

    @projections.setter
    def projections(self, value: DiagonalProjections | str) -> None:
        self._projections = as_projections(value)

    # --- forward --------------------------------------------------------------------------------
    def run_segments(
        self, params: Any, segs: Segments, schedule: str = "diagonal", state: MemoryState | None = None
    ) -> tuple[MemoryState, jnp.ndarray]:
        """Segments `[nS, B, S]` through `schedule` -> final memory state and logits `[nS, B, S, V]` (pure
        in `params`, so differentiable). Where the diagonal schedule would not pay off (`diagonal_pays_off`:
        CPU with large segments or few of them), its cells run in sequential order instead: the same
        results, as fast as the sequential schedule."""
        if schedule == "diagonal":
            if diagonal_pays_off(self, segs.ids.shape[1], segs.count):
                return diagonal_forward(self, params, segs, state)
            return sequential_forward(self, params, segs, state)
        if schedule == "sequential":
            return sequential_forward(self, params, segs, state)
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")

    # --- segmentation ---------------------------------------------------------------------------
    @property
    def segmentation(self) -> str:
        """How rows are cut into segments: "fixed" (every S tokens, as in training) or "sentences"."""
        return "fixed" if self._segmenter is None else "sentences"

    @segmentation.setter
    def segmentation(self, value: str) -> None:
        self._segmenter = make_segmenter(value, self.tokenizer)

    def segment_starts(self, ids: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        """Each left-aligned row's segment starts `[nS_b]` (rows `ids [B, T]`, `lengths [B]`; 0 -> none)."""
        if self._segmenter is None:
            return grid_starts(lengths, self.armt.segment_size)
        return self._segmenter.row_starts(ids, lengths, self.armt.segment_size)

    def next_segment_length(self, tokens: np.ndarray, final: bool) -> int:
        """Tokens of the next segment a stream cuts from its buffered `tokens [T]` (`final`: the document
        ends after them), as `segment_starts` would cut the whole row; 0 while undecided or empty."""
        S = self.armt.segment_size
        if self._segmenter is None:
            return S if len(tokens) >= S else (len(tokens) if final else 0)
        return self._segmenter.first_segment_length(tokens, S, final)

    def segments(
        self, ids: np.ndarray, lengths: np.ndarray, starts: list[np.ndarray] | None = None
    ) -> tuple[Segments, np.ndarray | None]:
        """Left-aligned rows `ids [B, T]` with `lengths [B]` cut by `segmentation`: the segments and every
        token's slot `[B, T]` in its row's flattened segments (-1 past the row's length; None on the fixed
        grid, where a token's slot is its position). `token_rows` maps segment outputs back to tokens.
        `starts` passes the rows' `segment_starts` when the caller already cut them."""
        if self._segmenter is None:
            return segment(ids, lengths, self.armt.segment_size), None
        starts = self.segment_starts(ids, lengths) if starts is None else starts
        return segment_at(ids, lengths, starts, self.armt.segment_size)

    def run(
        self, ids: Any, attention_mask: Any = None, schedule: str = "diagonal"
    ) -> tuple[jnp.ndarray, MemoryState]:
        """Logits `[B, T, V]` (zeros at pads) and the final memory state for ids `[B, T]`."""
        ids = check_ids(ids, self.config.vocab_size)
        mask = check_mask(attention_mask, ids)
        ids_c, lengths, order = compact(ids, mask)
        segs, slots = self.segments(ids_c, lengths)
        state, logits = self.run_segments(self.params, segs, schedule)
        _b, t = ids.shape
        logits = token_rows(logits, slots, t)
        if not mask.all():
            inverse = np.argsort(order, axis=1)
            logits = jnp.take_along_axis(logits, jnp.asarray(inverse)[..., None], axis=1)
            logits = jnp.where(jnp.asarray(mask)[..., None], logits, 0.0)
        return logits, state

    def __call__(self, ids: Any, attention_mask: Any = None, schedule: str = "diagonal") -> jnp.ndarray:
        """Logits `[B, T, V]` (float32; zeros at pad positions) for ids `[B, T]`."""
        return self.run(ids, attention_mask, schedule)[0]

    # --- streaming ------------------------------------------------------------------------------
    def init_state(self, batch: int = 1, schedule: str = "diagonal") -> stream.ARMTState:
        """Empty streaming state for `batch` independent rows (streams are cut as `segmentation` cuts)."""
        return stream.init_state(self, check_positive_int(batch, "batch"), schedule)

    def feed(
        self, state: stream.ARMTState, ids: Any, end_document: Any = False
    ) -> tuple[stream.ARMTState, list[jnp.ndarray]]:
        """Append ids `[B, c]` to the streams; returns the new state and per-row logits `[t_b, V]` of
        the tokens whose segments completed (see `jaxlongctx.armt.stream`)."""
        arr = np.asarray(ids)
        empty = arr.ndim == 2 and arr.shape[1] == 0 and np.issubdtype(arr.dtype, np.integer)
        ids = arr.astype(np.int32) if empty else check_ids(arr, self.config.vocab_size)
        if ids.shape[0] != state.batch:
            raise ValueError(f"ids have {ids.shape[0]} rows but the stream state has {state.batch}")
        return stream.feed(self, self.params, state, ids, end_document)

    def flush(self, state: stream.ARMTState) -> tuple[stream.ARMTState, list[jnp.ndarray]]:
        """End every row's document: run the partial segments and drain the pipeline; returns the
        state (ready for new documents) and the remaining per-row logits."""
        return stream.feed(self, self.params, state, None, True, drain=True)

    # --- generation -----------------------------------------------------------------------------
    def generate(
        self,
        ids: Any,
        params: SamplingParams,
        *,
        cache: CacheChoice | None = None,
        stream: Callable[[np.ndarray], Any] | None = None,
        **options: Any,
    ) -> np.ndarray:
        """`jaxlongctx.generate` for ARMT: ids `[B, T]` -> `[B, T + new]`, decoding over the memory
        (`cache` None or `ARMTMemory(schedule)`; `options`: attention_mask, progress, timings; see
        `jaxlongctx.armt.generation`)."""
        if cache is None:
            cache = ARMTMemory()
        if not isinstance(cache, ARMTMemory):
            raise ValueError(
                f"cache={type(cache).__name__}(...) applies to full-attention models; an ARMT model keeps "
                "its own recurrent memory (pass cache=ARMTMemory() or leave it out)"
            )
        if uses_open_segment(self):
            return generate_open_segment(self, ids, params, cache, stream=stream, **options)
        return generate_ids(self, ids, params, cache, stream=stream, **options)

    def generation_logits(self, ids: Any, prompt_length: int, schedule: str = "diagonal") -> jnp.ndarray:
        """Logits `[B, T, V]` of ids `[B, T]` as decoding after their first `prompt_length` tokens
        computes them (the prompt's last segment stays open; see `jaxlongctx.armt.generation`). With the
        published cell (`jaxlongctx.armt.open_segment`) those are the forward's logits."""
        if uses_open_segment(self):
            return self(ids, schedule=schedule)
        return generation_logits(self, ids, prompt_length, schedule)

    # --- memory accounting ----------------------------------------------------------------------
    def state_bytes(self, batch: int = 1) -> int:
        """Bytes of the recurrent state: the memory state (A and z of every layer and, with a sliding
        window, every layer's previous-segment token keys and values) plus the memory tokens (and sink)."""
        cfg, armt = self.config, self.armt
        L, c, dk = cfg.num_layers, cfg.hidden_size // armt.mem_heads, armt.d_key
        per_row = L * dk * (c + 1) * armt.state_dtype.itemsize
        if armt.sliding_window:
            per_row += 2 * L * armt.segment_size * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        rows = self.memory.memory[...].nbytes + (self.memory.sink[...].nbytes if armt.sink else 0)
        return batch * per_row + rows

    def full_attention_kv_bytes(self, num_tokens: int, batch: int = 1) -> int:
        """Bytes of the bf16 dense KV cache a full-attention model needs for `num_tokens` tokens."""
        return dense_cache_bytes(self.config, num_tokens, batch, itemsize=2)

    # --- checkpoints ----------------------------------------------------------------------------
    def save(
        self,
        path: str | Path,
        *,
        overwrite: bool = False,
        base_reference: BaseReference | None = None,
        base_adapter: dict[str, dict[str, np.ndarray]] | None = None,
        training_record: dict[str, Any] | None = None,
        extra_files: dict[str, str] | None = None,
    ) -> Path:
        """Save the memory parameters, the ARMT config and the segmentation (loading restores it)
        atomically, with the base weights (our checkpoint layout, loadable as a plain model) and the
        tokenizer (if any); or, given `base_reference` (the base this model's weights are, see
        `jaxlongctx.armt.base_reference`), a memory-only checkpoint that names its base instead, with
        `base_adapter` (see `jaxlongctx.armt.base_adapter`) when this model's base is that base changed.
        `training_record` (how the model was trained) goes to training.json; `extra_files` (name -> text)
        are written beside."""
        if base_adapter is not None and base_reference is None:
            raise ValueError("a base adapter changes a referenced base: pass base_reference too")
        extra: dict[str, Any] = {
            "armt": self.armt.to_dict(),
            "segmentation": self.segmentation,
            "memory_dtype": str(self.memory.memory[...].dtype),
        }
        if base_adapter is not None:
            extra["base_adapter"] = {"tensors": len(base_adapter), "bytes": adapter_bytes(base_adapter)}
        with atomic_directory(path, overwrite=overwrite) as tmp:
            write_memory(tmp, self.memory)
            if base_adapter is not None:
                write_adapter(tmp, base_adapter)
            if training_record is not None:
                (tmp / TRAINING_RECORD).write_text(json.dumps(training_record, indent=2) + "\n")
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
            if base_reference is not None:
                write_metadata(
                    tmp, self.config, extra["memory_dtype"], {**extra, "base": base_reference.to_dict()}
                )
                return Path(path)
            save_params(tmp, nnx.to_pure_dict(self.base.params))
            write_metadata(tmp, self.config, str(self.dtype), extra)
            if isinstance(self.tokenizer, ChatTokenizer):
                self.tokenizer.save_to(tmp)  # with its chat template and stop ids
            elif self.tokenizer is not None:
                self.tokenizer.save(str(tmp / "tokenizer.json"))
        return Path(path)

    @classmethod
    def load(
        cls,
        path: str | Path,
        dtype: jnp.dtype | None = None,
        mesh: Mesh | None = None,
        load_base: Callable[..., Model] | None = None,
    ) -> ARMTModel:
        """Load a checkpoint written by `save`, optionally casting the parameters to `dtype` and
        restoring every tensor straight into its shard on `mesh`. A memory-only checkpoint loads its
        base with `load_base(path, dtype, mesh=mesh)` (`jaxlongctx.load` passes itself) from where it
        names it, after checking the base's fingerprint."""
        path = Path(path).absolute()
        meta = read_metadata(path)
        if "armt" not in meta:
            raise CheckpointError(f"{path}: not an ARMT checkpoint (no 'armt' entry in config.json)")
        config, armt = ModelConfig.from_dict(meta["config"]), ARMTConfig.from_dict(meta["armt"])
        memory_dtype = jnp.dtype(meta.get("memory_dtype", meta["dtype"]))
        reference, tokenizer = None, None
        if "base" in meta:
            if load_base is None:
                raise CheckpointError(f"{path}: a memory-only ARMT checkpoint; load it with jaxlongctx.load")
            reference = BaseReference.from_dict(meta["base"])
            base_model = load_referenced_base(path, reference, config, load_base, dtype, mesh)
            base, tokenizer = base_model.module, base_model.tokenizer
            if "base_adapter" in meta:
                graphdef, state = nnx.split(base)
                params = apply_adapter(nnx.to_pure_dict(state), restore_adapter(path), path)
                nnx.replace_by_pure_dict(state, params)
                base = nnx.merge(graphdef, state)
        elif "base_adapter" in meta:
            raise CheckpointError(f"{path}: a base adapter without the base it changes (no 'base' entry)")
        else:
            base = load_module(path, dtype, None if mesh is None else param_shardings(config, mesh))
        memory = restore_memory(path, config, armt, memory_dtype, dtype, mesh)
        model = cls(base, armt, memory, tokenizer)
        model.base_reference = reference
        return model
