"""The Llama-family decoder: embedding, stacked layers run by `jax.lax.scan`, final norm and head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlongctx.config import ModelConfig
from jaxlongctx.model.attention_strategies import CachedDecode, CausalPrefill
from jaxlongctx.model.layers import DecoderLayer, Dense, FusedDense, rms_norm, stacked_layers
from jaxlongctx.model.rope import inverse_frequencies, rope_tables
from jaxlongctx.sharding import embed_lookup, matmul, reshard_like
from pallas_kernels import decode_attention_cpu, prefill_attention_cpu
from pallas_kernels.layer_matvec_cpu import MAX_ROWS, layer_matvec, layer_matvecs, native_kernel_error

# Decode steps on CPU multiply by the weight matrices where they lie in the stacked arrays
# (`pallas_kernels.layer_matvec_cpu`) instead of XLA's dot on per-layer copies. Read when a step is
# traced; the decode bench and the tests turn it off to run XLA's path side by side.
IN_PLACE_DECODE = True
# Most token rows whose products go through the in-place matvec kernel (more are a GEMM for XLA's dot).
# Read when a step is traced; the serving engine lowers it to 1 for its batched steps, where XLA's dot
# was the faster program (4x at 8 rows, SmolLM2 on 2 cores) while the cache is still read in place.
IN_PLACE_WEIGHT_ROWS = MAX_ROWS
# Inference prefills (`forward_hidden(..., in_place=True)`) of at least this many token rows multiply by
# the stacked weights in place too, through the kernel's GEMM path (bf16 widened in registers; XLA's
# CPU dot widens a bf16 operand through memory and runs at its float32 rate). Read when traced.
IN_PLACE_PREFILL_ROWS = 64


def reads_cache_in_place(model: Llama, cache_k: jax.Array, rows: int) -> bool:
    """Whether a decode step over `rows` token rows reads the stacked dense cache `cache_k [L, B, K, S, hd]`
    in place (`pallas_kernels.decode_attention_cpu`)."""
    cfg = model.config
    return (
        _in_place_possible(model.embed[...])
        and rows <= MAX_ROWS
        and cache_k.dtype in (jnp.float32, jnp.bfloat16)
        and jax.typeof(cache_k).sharding.mesh.empty
        and decode_attention_cpu.supports(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        and decode_attention_cpu.native_kernel_error() is None
    )


def reads_weights_in_place(weights: jax.Array, rows: int) -> bool:
    """Whether a product of `rows` token rows by `weights` (a float32/bf16 array on one CPU device) goes
    through the in-place native kernel: few rows, and the kernel built on this machine."""
    return _in_place_possible(weights) and rows <= min(MAX_ROWS, IN_PLACE_WEIGHT_ROWS)


def prefill_reads_weights_in_place(weights: jax.Array, rows: int) -> bool:
    """Whether an inference prefill of `rows` token rows multiplies by `weights` in place (the GEMM path)."""
    return _in_place_possible(weights) and rows >= IN_PLACE_PREFILL_ROWS


def _in_place_possible(weights: jax.Array) -> bool:
    """Whether the native in-place CPU kernels can run next to `weights` (on / on CPU / one device / built)."""
    return (
        IN_PLACE_DECODE
        and jax.default_backend() == "cpu"
        and weights.dtype in (jnp.float32, jnp.bfloat16)
        and jax.typeof(weights).sharding.mesh.empty
        and native_kernel_error() is None
    )


class Llama(nnx.Module):
    """Parameters of a Llama-family model; per-layer parameters carry a leading axis `[L, ...]`."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Param(
            (
                0.02 * jax.random.normal(rngs.params(), (config.vocab_size, config.hidden_size), jnp.float32)
            ).astype(dtype)
        )
        self.layers = stacked_layers(config, dtype=dtype, rngs=rngs)
        self.final_norm = nnx.Param(jnp.ones((config.hidden_size,), dtype))
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(
                (
                    0.02
                    * jax.random.normal(rngs.params(), (config.hidden_size, config.vocab_size), jnp.float32)
                ).astype(dtype)
            )

    def embed_ids(self, ids: jnp.ndarray) -> jnp.ndarray:
        """Token embeddings `[B, T, D]` for ids `[B, T]`."""
        return embed_lookup(self.embed[...], ids)

    def head(self, h: jnp.ndarray) -> jnp.ndarray:
        """Final norm and LM head: `[B, T, D]` -> float32 logits `[B, T, V]`."""
        x = rms_norm(h, self.final_norm[...], self.config.rms_norm_eps)
        if self.config.tie_word_embeddings:  # contract the embedding's D axis in place: a transposed
            # copy of the [V, D] table would be built on every call
            logits = vocab_logits(x, self.embed[...], vocab_axis=0)
        else:
            logits = vocab_logits(x, self.lm_head[...], vocab_axis=1)
        return reshard_like(logits, x)  # vocab-parallel head: gather the per-shard logits

    def rope(self, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        """cos/sin tables `[B, T, hd]` for positions `[B, T]`."""
        return rope_tables(positions, inverse_frequencies(self.config))

    def scan_layers(self, body, carry, xs=None):
        """Run `body(layer, carry, x) -> (carry, y)` over the stacked layers with `jax.lax.scan`."""
        graphdef, state = nnx.split(self.layers)

        def step(c, per_layer):
            layer_state, x = per_layer
            return body(nnx.merge(graphdef, layer_state), c, x)

        return jax.lax.scan(step, carry, (state, xs))

    def scan_decode_layers(self, body, h: jnp.ndarray, xs=None):
        """`scan_layers` for a step of few token rows `h [B, T, D]`: `body(layer, dense, h, x) -> (h, y)`,
        where the layer is called with `dense` as its product.

        Where `reads_weights_in_place`, the layer's weight matrices are the whole stacked `[L, in, out]`
        arrays and `dense` multiplies by this layer's slice of them in place (only the per-layer vectors
        are sliced); elsewhere the layer is sliced as in `scan_layers` and `dense` is the plain product.
        """
        in_place = reads_weights_in_place(self.embed[...], h.shape[0] * h.shape[1])
        return self.scan_layers_with_products(body, h, xs, in_place)

    def scan_layers_with_products(self, body, h: jnp.ndarray, xs, in_place: bool):
        """`scan_decode_layers` with the choice made by the caller: `in_place` multiplies by the stacked
        weights in place (the native kernel: few rows, or a prefill's GEMM), else the plain product."""
        graphdef, state = nnx.split(self.layers)
        if not in_place:
            return self.scan_layers(lambda layer, c, x: body(layer, matmul, c, x), h, xs)

        def step(c, per_layer):
            i, x = per_layer
            layer = nnx.merge(graphdef, jax.tree.map(lambda w: w if w.ndim == 3 else w[i], state))
            dense = FusedDense(
                lambda v, w: layer_matvec(v, w, i),
                lambda v, ws: layer_matvecs(v, ws, i),
                lambda v, gain, eps, ws: layer_matvecs(v, ws, i, norm=(gain, eps)),
            )
            return body(layer, dense, c, x)

        return jax.lax.scan(step, h, (jnp.arange(self.config.num_layers), xs))


HEAD_TILE_MAX_TOKENS = 64  # inputs of at most this many tokens (decode steps, a prompt's last token) ...
HEAD_VOCAB_TILE = 1024  # ... walk a low-precision head in vocabulary tiles of this many rows on CPU


def vocab_logits(x: jnp.ndarray, w: jnp.ndarray, vocab_axis: int) -> jnp.ndarray:
    """Float32 logits `[B, T, V]` of `x [B, T, D]` against head weights `w` (`[V, D]` for vocab_axis 0,
    a tied embedding; `[D, V]` for 1).

    XLA's CPU dot upcasts a bf16 operand to float32 before multiplying; for the whole table that copy
    goes through memory (SmolLM2's 49,152 x 576 head: 188 ms against 8 ms tiled). So on CPU, for
    weights below float32 and few tokens, the vocabulary is walked in tiles of `HEAD_VOCAB_TILE` rows
    whose upcast copies stay in cache. Every logit is the same length-D dot product either way.
    """
    if reads_weights_in_place(w, x.shape[0] * x.shape[1]):  # read in place, bf16 widened in registers
        return layer_matvec(x.astype(jnp.float32), w[None], 0, transposed=vocab_axis == 0)
    spec = "btd,vd->btv" if vocab_axis == 0 else "btd,dv->btv"
    vocab = w.shape[vocab_axis]
    tiles = vocab // HEAD_VOCAB_TILE
    if (
        jax.default_backend() != "cpu"
        or w.dtype == jnp.float32
        or tiles < 2
        or x.shape[0] * x.shape[1] > HEAD_TILE_MAX_TOKENS
        or not jax.typeof(w).sharding.mesh.empty
    ):
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)

    def tile(_, i):
        wi = jax.lax.dynamic_slice_in_dim(w, i * HEAD_VOCAB_TILE, HEAD_VOCAB_TILE, axis=vocab_axis)
        return None, jnp.einsum(spec, x, wi, preferred_element_type=jnp.float32)

    _, out = jax.lax.scan(tile, None, jnp.arange(tiles))  # n B T tile
    out = jnp.moveaxis(out, 0, 2).reshape(*x.shape[:2], tiles * HEAD_VOCAB_TILE)
    rest = jax.lax.slice_in_dim(w, tiles * HEAD_VOCAB_TILE, vocab, axis=vocab_axis)  # the last partial tile
    return jnp.concatenate([out, jnp.einsum(spec, x, rest, preferred_element_type=jnp.float32)], axis=-1)


def positions_from_mask(mask: jnp.ndarray) -> jnp.ndarray:
    """RoPE positions `[B, T]` that count only real tokens (HF convention; pads get position 0)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def forward_with(model: Llama, ids: jnp.ndarray, mask: jnp.ndarray, attend, in_place: bool = False):
    """Full forward of ids `[B, T]` (padding mask `[B, T]`) with the attention strategy `attend` (see
    `attention_strategies`) in every layer; returns hidden states `[B, T, D]` and its aux per layer,
    stacked on a leading `L` axis. `in_place` (inference only: its gradients are not meant for training)
    multiplies by the stacked weights in place on CPU where `prefill_reads_weights_in_place`."""
    cos, sin = model.rope(positions_from_mask(mask))
    h = model.embed_ids(ids)
    in_place = in_place and prefill_reads_weights_in_place(model.embed[...], ids.shape[0] * ids.shape[1])

    def body(layer: DecoderLayer, dense: Dense, h, _):
        return layer(h, cos, sin, attend, dense)

    return model.scan_layers_with_products(body, h, None, in_place)


def forward_hidden(
    model: Llama, ids: jnp.ndarray, mask: jnp.ndarray, collect_kv: bool = False, in_place: bool = False
):
    """Full causal forward; returns hidden states `[B, T, D]` and, if asked, per-layer post-RoPE
    k/v `[L, B, T, K, hd]` (for filling a cache). `in_place`: see `forward_with`; where the weights are
    read in place the attention is the native CPU kernel too (`pallas_kernels.prefill_attention_cpu`)."""
    native = (
        in_place
        and prefill_reads_weights_in_place(model.embed[...], ids.shape[0] * ids.shape[1])
        and prefill_attention_cpu.native_kernel_error() is None
    )
    attend = CausalPrefill(mask, collect_kv=collect_kv, native=native)
    h, kv = forward_with(model, ids, mask, attend, in_place)
    return (h, kv) if collect_kv else h


def forward(model: Llama, ids: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """Logits `[B, T, V]` (float32) for ids `[B, T]` with padding mask `[B, T]` (True = real token)."""
    return model.head(forward_hidden(model, ids, mask))


def decode_hidden(
    model: Llama,
    ids: jnp.ndarray,
    positions: jnp.ndarray,
    slot: jnp.ndarray,
    cache_k: jnp.ndarray,
    cache_v: jnp.ndarray,
    key_valid: jnp.ndarray,
):
    """One decode step over a static cache.

    ids `[B, 1]`, positions `[B, 1]` (RoPE), slot: scalar int (cache index the new token is written
    to, the same for every row), cache_k/v `[L, B, K, S, hd]`, key_valid `[B, S]` (already True at
    `slot`; the other slots it marks may lie anywhere, before or after `slot`, as in the serving
    engine's ring of slots) -> hidden `[B, 1, D]` and the updated caches.

    On CPU (`reads_cache_in_place`) every layer reads its slots from the whole cache in place;
    elsewhere the layer scan takes each layer's cache slice as a scanned input (never carrying the
    whole cache, which would make XLA copy it every layer). The new token attends to the cached
    slots and to its own key/value separately, so no layer writes into the cache; the new
    keys/values of all layers go into the (donated) cache in place after the scan.
    """
    cos, sin = model.rope(positions)
    visible = key_valid & (jnp.arange(cache_k.shape[3]) != slot)[None]  # cached tokens but the new one
    h = model.embed_ids(ids)
    if reads_cache_in_place(model, cache_k, h.shape[0] * h.shape[1]):  # the whole cache, layer i in place

        def body(layer: DecoderLayer, dense: Dense, h, i):
            return layer(h, cos, sin, CachedDecode(cache_k, cache_v, visible, layer=i), dense)

        xs = jnp.arange(model.config.num_layers)
    else:  # each layer's cache slice as a scanned input

        def body(layer: DecoderLayer, dense: Dense, h, layer_cache):
            ck, cv = layer_cache  # [B, K, S, hd]
            return layer(h, cos, sin, CachedDecode(ck, cv, visible), dense)

        xs = (cache_k, cache_v)
    h, (k_new, v_new) = model.scan_decode_layers(body, h, xs)  # k_new: L B K 1 hd
    cache_k = jax.lax.dynamic_update_slice(cache_k, k_new, (0, 0, 0, slot, 0))
    cache_v = jax.lax.dynamic_update_slice(cache_v, v_new, (0, 0, 0, slot, 0))
    return h, cache_k, cache_v
