"""Synthetic GGUF files written with `gguf.GGUFWriter` from random float weights in HF layout.

Tensor names come from gguf's own HF -> GGUF name map, and the Q/K rows of `llama` files are
permuted as llama.cpp's converter permutes them, so the importer is tested against llama.cpp's
conventions rather than its own tables.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# One small model per architecture; in-features are multiples of 256 where K-quants must fit.
ARCHS: dict[str, dict] = {
    "llama": dict(
        hidden=256,
        intermediate=512,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=64,
        tie=False,
        qkv_bias=False,
        qk_norm=False,
    ),
    "qwen2": dict(
        hidden=128,
        intermediate=256,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=32,
        tie=False,
        qkv_bias=True,
        qk_norm=False,
    ),
    "qwen3": dict(
        hidden=128,
        intermediate=256,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=24,
        tie=True,
        qkv_bias=False,
        qk_norm=True,
    ),
}
VOCAB = 512
ROPE_THETA = 50000.0
RMS_EPS = 1e-5
# Byte layout of the K-quant blocks: (bytes per block, byte offsets of float16 scales).
K_BLOCKS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def hf_weights(arch: str, seed: int = 0, layers: int | None = None) -> dict[str, np.ndarray]:
    """Random float32 weights of `arch`'s small model (`layers` overrides its depth) under HF names,
    layout `(out, in)`."""
    s = dict(ARCHS[arch], **({"layers": layers} if layers else {}))
    rng = np.random.default_rng(seed)
    d, hd, f = s["hidden"], s["head_dim"], s["intermediate"]
    w = {
        "model.embed_tokens.weight": rng.normal(0, 0.5, (VOCAB, d)),
        "model.norm.weight": 1 + 0.1 * rng.normal(size=d),
    }
    if not s["tie"]:
        w["lm_head.weight"] = rng.normal(0, 0.05, (VOCAB, d))
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (s["heads"] * hd, d),
            "self_attn.k_proj": (s["kv_heads"] * hd, d),
            "self_attn.v_proj": (s["kv_heads"] * hd, d),
            "self_attn.o_proj": (d, s["heads"] * hd),
            "mlp.gate_proj": (f, d),
            "mlp.up_proj": (f, d),
            "mlp.down_proj": (d, f),
        }
        for name, shape in shapes.items():
            w[p + name + ".weight"] = rng.normal(0, shape[1] ** -0.5, shape)
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rng.normal(size=d)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.normal(size=d)
        if s["qkv_bias"]:
            for x in "qkv":
                w[p + f"self_attn.{x}_proj.bias"] = 0.1 * rng.normal(size=shapes[f"self_attn.{x}_proj"][0])
        if s["qk_norm"]:
            w[p + "self_attn.q_norm.weight"] = 1 + 0.1 * rng.normal(size=hd)
            w[p + "self_attn.k_norm.weight"] = 1 + 0.1 * rng.normal(size=hd)
    return {k: v.astype(np.float32) for k, v in w.items()}


def hf_config(arch: str) -> dict:
    """The HF config.json dict of `arch`'s small model (for a transformers reference model)."""
    s = ARCHS[arch]
    return {
        "model_type": arch,
        "vocab_size": VOCAB,
        "hidden_size": s["hidden"],
        "intermediate_size": s["intermediate"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": s["tie"],
        "hidden_act": "silu",
    }


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for the Q/K projections of `llama` models."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks `[rows, cols / 256 * bytes]` with small positive float16 scales."""
    nbytes, scale_offsets = K_BLOCKS[qtype]
    blocks = rng.integers(0, 256, (rows, cols // 256, nbytes), dtype=np.uint8)
    for off in scale_offsets:
        scales = rng.uniform(1e-3, 1e-2, (rows, cols // 256)).astype(np.float16)
        blocks[..., off : off + 2] = scales.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def encode_tensor(w: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """(data for GGUFWriter.add_tensor, the GGML type) of a float weight; K-quants get random blocks."""
    import gguf

    if qtype == "F32" or w.ndim == 1:
        return w.astype(np.float32), "F32"
    if qtype == "F16":
        return w.astype(np.float16), "F16"
    if qtype in K_BLOCKS:
        return random_k_blocks(qtype, *w.shape, rng), qtype
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype]), qtype


def write_gguf(
    path: Path,
    arch: str,
    weights: dict[str, np.ndarray],
    qtype: str = "F32",
    *,
    tokenizer: dict | None = None,
    arch_name: str | None = None,
    seed: int = 0,
    context_length: int = 2048,
) -> dict[str, np.ndarray]:
    """Write `weights` (HF names) as a GGUF of `arch` with 2-D weights in `qtype` (norms and biases
    F32); `tokenizer` adds `tokenizer.*` metadata (keys: model, pre, tokens, types, merges, scores,
    bos, eos, pad, add_bos, chat_template). Returns the raw data written per GGUF name."""
    import gguf

    layers = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("model.layers."))
    s = dict(ARCHS[arch], layers=layers)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch_name or arch)
    writer.add_block_count(s["layers"])
    writer.add_context_length(context_length)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_dimension_count(s["head_dim"])
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_vocab_size(VOCAB)
    if tokenizer is not None:
        _add_tokenizer(writer, tokenizer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], s["layers"])
    written = {}
    for hf, w in weights.items():
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            w = llama_cpp_permute(w, s["heads"] if ".q_proj." in hf else s["kv_heads"])
        data, kind = encode_tensor(w, qtype, rng)
        raw_dtype = None if kind in ("F32", "F16") else gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
        written[name] = data
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def _add_tokenizer(writer, tok: dict) -> None:
    writer.add_tokenizer_model(tok["model"])
    if "pre" in tok:
        writer.add_tokenizer_pre(tok["pre"])
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    if "merges" in tok:
        writer.add_token_merges(tok["merges"])
    if "scores" in tok:
        writer.add_token_scores(tok["scores"])
    for key, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("pad", writer.add_pad_token_id),
        ("unk", writer.add_unk_token_id),
    ):
        if key in tok:
            add(tok[key])
    if "add_bos" in tok:
        writer.add_add_bos_token(tok["add_bos"])
    if "chat_template" in tok:
        writer.add_chat_template(tok["chat_template"])


CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def gpt2_chat_tokenizer(texts: list[str]) -> dict:
    """`write_gguf` tokenizer metadata: a byte-level BPE vocabulary of VOCAB tokens trained with
    `tokenizers` on `texts` (and the json package's source), with chat tokens and template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(texts) * 3 + [Path(json.__file__).read_text()], trainer)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [f"<unused{i}>" for i in range(VOCAB - len(vocab))]
    types = [3 if t in specials else 5 if t.startswith("<unused") else 1 for t in tokens]
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    return dict(
        model="gpt2",
        pre="default",
        tokens=tokens,
        types=types,
        merges=merges,
        bos=1,
        eos=2,
        pad=0,
        add_bos=False,
        chat_template=CHAT_TEMPLATE,
    )
