"""ARMT (associative recurrent memory transformer) with sequential and diagonal schedules.

    armt = ARMTModel.wrap(model, ARMTConfig(segment_size=1024, num_mem_tokens=128), jax.random.key(0))
    logits = armt(ids, attention_mask, schedule="diagonal")        # [B, T, V]; "sequential" = ground truth
    logits, state = armt.run(ids, attention_mask, schedule=...)    # + MemoryState: A [L,B,dk,D], z [L,B,dk]
    state = armt.init_state(batch); state, per_row = armt.feed(state, chunk, end_document=...)
    state, per_row = armt.flush(state)                             # streaming; see `stream`
    jaxlongctx.generate(armt, ids, SamplingParams(n), cache=ARMTMemory(schedule="diagonal"))  # decoding
    armt.segmentation = "sentences"                                # cut after sentence ends (needs the tokenizer)
    armt.projections = "grouped_matmul"                            # diagonal products: "auto" | "vmap" | this
    armt.state_bytes(); armt.full_attention_kv_bytes(num_tokens); armt.save(path); ARMTModel.load(path)
    armt = jaxlongctx.load("published_dir")                        # the authors' HF `armt` format (sink,
                                                                   # sliding window: ARMTConfig options)

Words: *memory tokens* are the learned embeddings `[M, D]` appended to every segment (their buffer
rows: memory-token rows); the *memory state* (`MemoryState`: A, z per layer) is the associative memory
that segments read and write; the *memory weights* (W_mq, W_mk, W_mv, W_mb, b_mb per layer) project
hidden states to read and write it; the *memory parameters* (`MemoryParams`) are the memory tokens
and the memory weights, what ARMT adds to the base model.

Modules: `config` (ARMTConfig), `memory` (DPFP, read, write), `params` (memory parameters),
`cell` (one segment through one layer), `segments` (host-side segmentation), `sentences` (segment
starts after sentence ends), `sequential`,
`diagonal` (schedules), `projections` (how a diagonal step multiplies by the stacked weights),
`stream`, `generation`, `open_segment` (generation of the published cell), `model` (ARMTModel).
"""

from jaxlongctx.armt.config import ARMTConfig
from jaxlongctx.armt.memory import MemoryState
from jaxlongctx.armt.model import ARMTModel
from jaxlongctx.armt.projections import DiagonalProjections

__all__ = ["ARMTConfig", "ARMTModel", "DiagonalProjections", "MemoryState"]
