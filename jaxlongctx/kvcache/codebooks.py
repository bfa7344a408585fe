"""PQ codebooks for the KV cache: training, per-layer access, atomic save/load, byte accounting."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxlongctx.kvcache.kmeans import Init, kmeans
from jaxlongctx.kvcache.pq_codec import MAX_CENTROIDS
from jaxlongctx.output_dir import atomic_directory
from pallas_kernels.pq_codes import packs

Granularity = Literal["shared", "layer", "layer_head"]
GRANULARITIES: tuple[str, ...] = ("shared", "layer", "layer_head")
MAX_BITS = MAX_CENTROIDS.bit_length() - 1  # the codec's widest codes (12 bits; uint16 above 8)
CACHE_MAX_BITS = 8  # the PQ cache and its kernels store codes of at most a byte (4-bit codes two a byte)
FORMAT_VERSION = 1
_META_FILE = "codebooks.json"
_ARRAYS_DIR = "arrays"


def _check_bits(bits: int) -> None:
    """Reject code widths the codec cannot hold."""
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(
            f"bits must be in [1, {MAX_BITS}], got {bits}: at most 2**{MAX_BITS} = 4096 centroids per "
            "subspace (codes of up to 8 bits are uint8, wider ones uint16)"
        )


def check_cache_bits(bits: int) -> None:
    """Reject codebooks whose codes the PQ cache cannot store (it holds codes of at most a byte)."""
    if bits > CACHE_MAX_BITS:
        raise ValueError(
            f"these codebooks have {bits}-bit codes; the PQ cache and its decode kernels store 8-bit "
            f"codes (bits <= {CACHE_MAX_BITS}). Wider codes serve quality evaluation "
            "(jaxlongctx.kv_quality); calibrate with --bits 8 or fewer to generate"
        )


def _check_ds(ds: int, head_dim: int) -> None:
    """Reject subspace sizes that do not tile the head dim."""
    if ds < 1 or head_dim % ds:
        raise ValueError(f"ds must be a positive divisor of head_dim={head_dim}, got {ds}")


def centroid_shape(
    granularity: str, num_layers: int, num_kv_heads: int, head_dim: int, ds: int, bits: int
) -> tuple[int, ...]:
    """Shape of the key (or value) centroid array for a granularity."""
    base = (head_dim // ds, 2**bits, ds)  # [M, C, ds]
    if granularity == "shared":
        return base
    if granularity == "layer":
        return (num_layers, *base)
    if granularity == "layer_head":
        return (num_layers, num_kv_heads, *base)
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def weight_shape(granularity: str, num_layers: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of the per-channel encode weights for a granularity: [D], [L, D] or [L, K, D]."""
    lead = centroid_shape(granularity, num_layers, num_kv_heads, head_dim, head_dim, 1)[:-3]
    return (*lead, head_dim)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Codebooks:
    """Key and value PQ centroids (float32) and how they map onto layers and kv heads.

    key_centroids / value_centroids by granularity:
      "shared"     [M, C, ds]        one codebook for every layer and head (the MILLION reference)
      "layer"      [L, M, C, ds]
      "layer_head" [L, K, M, C, ds]
    with M = head_dim // ds and C = 2**bits. metadata holds JSON scalars, including
    "model_fingerprint". key_weights / value_weights (optional, `weight_shape`: [D], [L, D] or
    [L, K, D]) weight each channel's squared error when encoding (see `pq_codec.encode`); None means
    plain squared L2. Arrays are pytree leaves; everything else is static.
    """

    key_centroids: jax.Array
    value_centroids: jax.Array
    granularity: Granularity
    ds: int
    bits: int
    head_dim: int
    num_layers: int
    num_kv_heads: int
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    key_weights: jax.Array | None = None
    value_weights: jax.Array | None = None

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        _check_ds(self.ds, self.head_dim)
        for k, v in self.metadata.items():
            if not isinstance(k, str) or not isinstance(v, (str, int, float, bool)):
                raise ValueError(
                    f"metadata must map str to str/int/float/bool (JSON scalars), got {k!r}: {v!r}"
                )
        want = centroid_shape(
            self.granularity, self.num_layers, self.num_kv_heads, self.head_dim, self.ds, self.bits
        )
        for name in ("key_centroids", "value_centroids"):
            got = tuple(getattr(self, name).shape)
            if got != want:
                raise ValueError(
                    f"{name} has shape {got}, expected {want} for granularity={self.granularity!r}"
                )
        want_w = weight_shape(self.granularity, self.num_layers, self.num_kv_heads, self.head_dim)
        for name in ("key_weights", "value_weights"):
            w = getattr(self, name)
            if w is not None and tuple(w.shape) != want_w:
                raise ValueError(
                    f"{name} has shape {tuple(w.shape)}, expected {want_w} for granularity={self.granularity!r}"
                )

    @property
    def num_subspaces(self) -> int:
        """M = head_dim // ds."""
        return self.head_dim // self.ds

    @property
    def num_centroids(self) -> int:
        """C = 2**bits."""
        return 2**self.bits

    @property
    def model_fingerprint(self) -> str:
        """The fingerprint of the model these codebooks were trained for ("" if unknown)."""
        return str(self.metadata.get("model_fingerprint", ""))

    def for_layer(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """(key, value) centroids of one layer: [M, C, ds] (shared/layer) or [K, M, C, ds] (layer_head)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        if self.granularity == "shared":
            return self.key_centroids, self.value_centroids
        return self.key_centroids[layer], self.value_centroids[layer]

    def stacked(self) -> tuple[jax.Array, jax.Array]:
        """(key, value) centroids with a leading layer axis for lax.scan: [L, M, C, ds] or [L, K, M, C, ds]."""
        if self.granularity == "shared":
            shape = (self.num_layers, *self.key_centroids.shape)
            return jnp.broadcast_to(self.key_centroids, shape), jnp.broadcast_to(self.value_centroids, shape)
        return self.key_centroids, self.value_centroids

    @property
    def weighted(self) -> bool:
        """Whether encoding weights channels (key_weights / value_weights are set)."""
        return self.key_weights is not None

    def stacked_weights(self) -> tuple[jax.Array | None, jax.Array | None]:
        """(key, value) encode weights with a leading layer axis: [L, D] or [L, K, D]; (None, None) if unweighted."""
        if not self.weighted:
            return None, None
        if self.granularity == "shared":
            shape = (self.num_layers, self.head_dim)
            return jnp.broadcast_to(self.key_weights, shape), jnp.broadcast_to(self.value_weights, shape)
        return self.key_weights, self.value_weights

    def tree_flatten(self) -> tuple[tuple[jax.Array | None, ...], tuple[Any, ...]]:
        """Pytree protocol: arrays are leaves, the rest (with metadata as sorted items) is static."""
        static = (self.granularity, self.ds, self.bits, self.head_dim, self.num_layers, self.num_kv_heads)
        leaves = (self.key_centroids, self.value_centroids, self.key_weights, self.value_weights)
        return leaves, (*static, tuple(sorted(self.metadata.items())))

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], leaves: tuple[jax.Array | None, ...]) -> Codebooks:
        """Pytree protocol (skips validation: leaves may be tracers or placeholders)."""
        obj = object.__new__(cls)
        names = ("granularity", "ds", "bits", "head_dim", "num_layers", "num_kv_heads")
        for name, value in zip(names, aux[:-1]):
            object.__setattr__(obj, name, value)
        object.__setattr__(obj, "metadata", dict(aux[-1]))
        object.__setattr__(obj, "key_centroids", leaves[0])
        object.__setattr__(obj, "value_centroids", leaves[1])
        object.__setattr__(obj, "key_weights", leaves[2])
        object.__setattr__(obj, "value_weights", leaves[3])
        return obj


def _problems(x: jax.Array, granularity: str, ds: int) -> jax.Array:
    """Calibration vectors x[L, N, K, D] -> k-means problems [P, n, ds], P ordered as the centroid shape."""
    nl, n, kv, d = x.shape
    m = d // ds
    sub = x.reshape(nl, n, kv, m, ds)
    if granularity == "shared":
        return sub.transpose(3, 0, 1, 2, 4).reshape(m, nl * n * kv, ds)  # P = M
    if granularity == "layer":
        return sub.transpose(0, 3, 1, 2, 4).reshape(nl * m, n * kv, ds)  # P = L*M
    return sub.transpose(0, 2, 3, 1, 4).reshape(nl * kv * m, n, ds)  # P = L*K*M


@partial(jax.jit, static_argnames=("granularity", "ds"))
def _key_and_value_problems(
    keys: jax.Array, values: jax.Array, k_scale: jax.Array, v_scale: jax.Array, granularity: str, ds: int
) -> jax.Array:
    """The k-means problems of scaled keys then values, [2P, n, ds], in one fused copy (building them
    eagerly costs seconds more for a real model's calibration set)."""
    return jnp.concatenate(
        [_problems(keys * k_scale, granularity, ds), _problems(values * v_scale, granularity, ds)]
    )


def train_codebooks(
    keys: jax.Array,
    values: jax.Array,
    ds: int,
    bits: int,
    granularity: Granularity = "shared",
    iters: int = 25,
    *,
    key: jax.Array,
    init: Init = "random",
    progress: bool = True,
    model_fingerprint: str = "",
    points_per_centroid: int = 256,
    tol: float = 0.0,
    key_weights: jax.Array | None = None,
    value_weights: jax.Array | None = None,
) -> Codebooks:
    """k-means codebooks from calibration keys (post-RoPE) and values, both [L, N, K, D]; each k-means
    problem keeps at most `points_per_centroid` * 2**bits sampled vectors and stops early at `tol`
    (see `kmeans`). With per-channel `key_weights` / `value_weights` (`weight_shape`, both or neither)
    the k-means is weighted: it runs on the vectors scaled by sqrt(weight), and the centroids are
    scaled back."""
    keys, values = jnp.asarray(keys), jnp.asarray(values)
    if keys.ndim != 4:
        raise ValueError(f"keys must have shape [L, N, K, D], got {keys.shape}")
    if values.shape != keys.shape:
        raise ValueError(f"values shape {values.shape} must equal keys shape {keys.shape}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    _check_bits(bits)
    num_layers, _, num_kv_heads, head_dim = keys.shape
    _check_ds(ds, head_dim)
    shape = centroid_shape(granularity, num_layers, num_kv_heads, head_dim, ds, bits)
    if (key_weights is None) != (value_weights is None):
        raise ValueError("give both key_weights and value_weights, or neither")
    k_scale = _channel_scale(key_weights, granularity, keys.shape)
    v_scale = _channel_scale(value_weights, granularity, keys.shape)
    problems = _key_and_value_problems(keys, values, k_scale, v_scale, granularity, ds)
    cent, history = kmeans(
        problems,
        2**bits,
        iters,
        key=key,
        init=init,
        progress=progress,
        max_points_per_centroid=points_per_centroid,
        tol=tol,
    )
    half = cent.shape[0] // 2
    final = np.asarray(history[:, -1])
    metadata = {
        "model_fingerprint": model_fingerprint,
        "iters": iters,
        "iters_run": int(history.shape[1] - 1),
        "points_per_centroid": points_per_centroid,
        "tol": tol,
        "init": init,
        "calibration_samples_per_layer": int(keys.shape[1]),
        "key_mse": float(final[:half].mean()),  # mean squared error per subspace, calibration set
        "value_mse": float(final[half:].mean()),
    }
    return Codebooks(
        key_centroids=_unscale_centroids(cent[:half].reshape(shape), k_scale, granularity),
        value_centroids=_unscale_centroids(cent[half:].reshape(shape), v_scale, granularity),
        granularity=granularity,
        ds=ds,
        bits=bits,
        head_dim=head_dim,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        metadata={**metadata, "weighted": key_weights is not None},
        key_weights=None if key_weights is None else jnp.asarray(key_weights, jnp.float32),
        value_weights=None if value_weights is None else jnp.asarray(value_weights, jnp.float32),
    )


def _channel_scale(weights: jax.Array | None, granularity: str, x_shape: tuple[int, ...]) -> jax.Array:
    """sqrt(weights) broadcastable to calibration vectors [L, N, K, D] (1.0 without weights)."""
    if weights is None:
        return jnp.ones((), jnp.float32)
    num_layers, _, num_kv_heads, head_dim = x_shape
    weights = jnp.asarray(weights, jnp.float32)
    want = weight_shape(granularity, num_layers, num_kv_heads, head_dim)
    if weights.shape != want:
        raise ValueError(f"channel weights must have shape {want} for {granularity!r}, got {weights.shape}")
    if not bool(jnp.all(weights > 0)):
        raise ValueError("channel weights must be positive")
    scale = jnp.sqrt(weights)
    return {"shared": scale, "layer": scale[:, None, None], "layer_head": scale[:, None]}[granularity]


def _unscale_centroids(cent: jax.Array, scale: jax.Array, granularity: str) -> jax.Array:
    """Centroids [..., M, C, ds] trained on scaled vectors, back in the vectors' own space."""
    if scale.ndim == 0:
        return cent
    per_problem = {"shared": scale, "layer": scale[:, 0, 0], "layer_head": scale[:, 0]}[granularity]
    m, _, ds = cent.shape[-3:]
    return cent / per_problem.reshape(*per_problem.shape[:-1], m, 1, ds)


def _static_fields(cb: Codebooks) -> dict[str, Any]:
    """The JSON-serialisable description written next to the arrays."""
    return {
        "format_version": FORMAT_VERSION,
        "granularity": cb.granularity,
        "ds": cb.ds,
        "bits": cb.bits,
        "head_dim": cb.head_dim,
        "num_layers": cb.num_layers,
        "num_kv_heads": cb.num_kv_heads,
        "centroid_shape": list(cb.key_centroids.shape),
        "metadata": cb.metadata,
    }


def save_codebooks(
    cb: Codebooks, path: str | Path, *, overwrite: bool = False, inputs: Iterable[str | Path | None] = ()
) -> Path:
    """Write codebooks to directory `path` (orbax arrays + codebooks.json), atomically; `inputs`
    (the model they were calibrated on) may not lie inside `path`."""
    import orbax.checkpoint as ocp

    check_finite_centroids(cb, str(path))
    with atomic_directory(path, overwrite=overwrite, kind="codebooks", inputs=inputs) as tmp:
        arrays = {
            "key_centroids": np.asarray(cb.key_centroids),
            "value_centroids": np.asarray(cb.value_centroids),
        }
        if cb.weighted:
            arrays.update(key_weights=np.asarray(cb.key_weights), value_weights=np.asarray(cb.value_weights))
        with ocp.PyTreeCheckpointer() as ckptr:
            ckptr.save(tmp / _ARRAYS_DIR, arrays)
        (tmp / _META_FILE).write_text(json.dumps(_static_fields(cb), indent=2) + "\n")
    return Path(path)


def check_finite_centroids(cb: Codebooks, where: str) -> None:
    """Refuse codebooks with a NaN or infinite centroid (they would turn every attention score into NaN)."""
    for name in ("key_centroids", "value_centroids", "key_weights", "value_weights"):
        array = getattr(cb, name)
        if array is not None and not bool(np.isfinite(np.asarray(array, np.float32)).all()):
            raise ValueError(f"codebooks at {where}: {name} holds non-finite values")


def _read_meta(path: Path) -> dict[str, Any]:
    """Parse and validate codebooks.json."""
    meta_file = path / _META_FILE
    if not meta_file.is_file():
        raise ValueError(f"codebooks at {path}: missing {_META_FILE}")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"codebooks at {path}: {_META_FILE} is corrupt ({e})") from e
    required = (
        "format_version",
        "granularity",
        "ds",
        "bits",
        "head_dim",
        "num_layers",
        "num_kv_heads",
        "metadata",
    )
    missing = [f for f in required if not isinstance(meta, dict) or f not in meta]
    if missing:
        raise ValueError(f"codebooks at {path}: {_META_FILE} lacks fields {missing}")
    if meta["format_version"] != FORMAT_VERSION:
        raise ValueError(
            f"codebooks at {path}: format_version {meta['format_version']}, expected {FORMAT_VERSION}"
        )
    return meta


def codebooks_fingerprint(path: str | Path) -> str:
    """The model fingerprint recorded in the codebooks at `path` ("" if none), read without their arrays."""
    return str(_read_meta(Path(path))["metadata"].get("model_fingerprint", ""))


def load_codebooks(path: str | Path, expected_fingerprint: str | None = None) -> Codebooks:
    """Read codebooks written by save_codebooks; ValueError on fingerprint mismatch or bad files."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if not path.is_dir():
        raise ValueError(f"codebooks directory {path} does not exist")
    meta = _read_meta(path)
    found = str(meta["metadata"].get("model_fingerprint", ""))
    if expected_fingerprint is not None and found != expected_fingerprint:
        raise ValueError(f"codebooks at {path} were made for model {found!r}, not {expected_fingerprint!r}")
    if not (path / _ARRAYS_DIR).is_dir():
        raise ValueError(f"codebooks at {path}: missing {_ARRAYS_DIR}/ directory")
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            arrays = ckptr.restore(path / _ARRAYS_DIR)
    except Exception as e:  # orbax/tensorstore raise many types for damaged files
        raise ValueError(f"codebooks at {path}: cannot read {_ARRAYS_DIR}/ ({type(e).__name__}: {e})") from e
    plain, weights = {"key_centroids", "value_centroids"}, {"key_weights", "value_weights"}
    if not isinstance(arrays, dict) or set(arrays) not in (plain, plain | weights):
        raise ValueError(
            f"codebooks at {path}: {_ARRAYS_DIR}/ must hold key_centroids and value_centroids "
            "(and key_weights with value_weights, or neither)"
        )
    try:
        cb = Codebooks(
            key_centroids=jnp.asarray(arrays["key_centroids"], jnp.float32),
            value_centroids=jnp.asarray(arrays["value_centroids"], jnp.float32),
            granularity=meta["granularity"],
            ds=int(meta["ds"]),
            bits=int(meta["bits"]),
            head_dim=int(meta["head_dim"]),
            num_layers=int(meta["num_layers"]),
            num_kv_heads=int(meta["num_kv_heads"]),
            metadata=dict(meta["metadata"]),
            **{name: jnp.asarray(arrays[name], jnp.float32) for name in weights if name in arrays},
        )
    except ValueError as e:
        raise ValueError(f"codebooks at {path} do not match {_META_FILE}: {e}") from e
    check_finite_centroids(cb, str(path))
    return cb


def cache_bytes(
    num_tokens: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    ds: int,
    bits: int,
    window: int,
    *,
    granularity: Granularity = "shared",
    batch: int = 1,
) -> dict[str, int | float]:
    """Exact bytes of a PQ KV cache (codes + bf16 window + f32 codebooks) vs a dense bf16 cache.

    `window` of the num_tokens tokens are held exactly in bf16, the rest as one code per subspace, as
    the PQ cache stores them: half a byte for codes of up to 4 bits over an even number of subspaces
    (packed two a byte), else a byte up to 8 bits (even when bits < 8); wider codes (10-12 bits, which
    only the codec and quality evaluation use) are counted packed at their width.
    Codebooks are counted once (not per batch row).
    """
    for name, value in (("num_tokens", num_tokens), ("window", window)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("batch", batch)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    _check_bits(bits)
    _check_ds(ds, head_dim)
    m = head_dim // ds
    exact = min(window, num_tokens)
    coded = num_tokens - exact
    kv_layers_heads = 2 * num_layers * num_kv_heads * batch  # K and V
    code_bits = 4 if packs(2**bits, m) else 8 if bits <= CACHE_MAX_BITS else bits
    codes = -(-kv_layers_heads * coded * m * code_bits // 8)
    window_bytes = kv_layers_heads * exact * head_dim * 2
    codebook = 2 * int(np.prod(centroid_shape(granularity, num_layers, num_kv_heads, head_dim, ds, bits))) * 4
    total = codes + window_bytes + codebook
    dense = kv_layers_heads * num_tokens * head_dim * 2
    return {
        "codes_bytes": codes,
        "window_bytes": window_bytes,
        "codebook_bytes": codebook,
        "total_bytes": total,
        "dense_bf16_bytes": dense,
        "compression": dense / total if total else float("inf"),
        "bits_per_element": 8 * total / (kv_layers_heads * num_tokens * head_dim)
        if num_tokens
        else float("inf"),
    }
