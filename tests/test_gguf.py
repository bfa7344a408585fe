"""GGUF import: SmolLM2-135M-Instruct against `transformers` loading the same file (logits, greedy
tokens, tokenizer, chat template), synthetic files of every architecture and tensor type against float
references, export to HF, memory while streaming, and bad files."""

from __future__ import annotations

import io
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf_synthetic import (
    ARCHS,
    K_BLOCKS,
    VOCAB,
    gpt2_chat_tokenizer,
    hf_config,
    hf_weights,
    llama_cpp_permute,
    write_gguf,
)

import jaxlongctx
from convert.gguf_llama import SUPPORTED_TYPES, load_gguf, open_for_import
from convert.hf_llama import ConversionError, stack_params, tensor_rules
from jaxlongctx.chat import chat_messages
from jaxlongctx.cli import main as cli_main
from jaxlongctx.pretrained import smollm2_gguf

CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three colours of the rainbow and say why the sky is blue."},
]
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def area(r: float) -> float:\n    return 3.14159 * r ** 2  # circle\n\tprint('done')",
    "In 2024 there were 365 days; 1,000,000 + 12345678901234567890 = ?",
    "spaces    runs   \n\n\n  and\ttabs\t\t  end   ",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🎉🚀, Ελληνικά, русский текст.",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|><|endoftext|>",
    " leading space and I'm sure they've can't we'll",
]


# --- SmolLM2-135M-Instruct against transformers -----------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    """Our model from the GGUF, fp32."""
    return jaxlongctx.load(smollm2_gguf(), "fp32")


@pytest.fixture(scope="module")
def hf_smollm2():
    """(transformers model, tokenizer) loaded from the same GGUF, fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, tok


def _torch_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def _assert_logits_match(ours: np.ndarray, ref: np.ndarray) -> None:
    assert np.abs(ours - ref).max() <= 1e-3, np.abs(ours - ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.995


def test_smollm2_config(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.max_position_embeddings == 8192


def test_smollm2_chat_prompt_logits(smollm2, hf_smollm2):
    ids = np.asarray([smollm2.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)])
    _assert_logits_match(np.asarray(smollm2(ids)), _torch_logits(hf_smollm2[0], ids))


def test_smollm2_greedy_32_tokens(smollm2, hf_smollm2):
    import torch

    ids = np.asarray([smollm2.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)])
    ours = jaxlongctx.generate(smollm2, ids, jaxlongctx.SamplingParams(32, stop_ids=()))[0, ids.shape[1] :]
    with torch.no_grad():
        ref = hf_smollm2[0].generate(torch.tensor(ids), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    np.testing.assert_array_equal(ours, ref[0, ids.shape[1] :].numpy())


def _long_prompt(tokenizer, n: int) -> np.ndarray:
    """About `n` tokens of real text (the json package's source) in a chat prompt."""
    import json as json_module

    text = "".join(p.read_text() for p in sorted(Path(json_module.__file__).parent.glob("*.py")))
    body = tokenizer.decode(tokenizer.encode(text).ids[: n - 40])
    messages = [{"role": "user", "content": body + "\n\nSummarise this code in one sentence."}]
    return np.asarray([tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)])


@pytest.mark.slow
def test_smollm2_2k_prompt_logits(smollm2, hf_smollm2):
    ids = _long_prompt(smollm2.tokenizer, 2048)
    assert 1900 <= ids.shape[1] <= 2100
    _assert_logits_match(np.asarray(smollm2(ids)), _torch_logits(hf_smollm2[0], ids))


@pytest.mark.slow
def test_smollm2_convert_and_export_match_transformers(smollm2, hf_smollm2, tmp_path):
    """convert --gguf, then --export: transformers loads the HF directory with the same logits and
    chat prompt as it gets from the GGUF file itself."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert cli_main(["convert", "--gguf", str(smollm2_gguf()), "--out", str(tmp_path / "ckpt")]) == 0
    assert cli_main(["convert", "--export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    ids = np.asarray([smollm2.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    _assert_logits_match(_torch_logits(exported, ids), _torch_logits(hf_smollm2[0], ids))
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == hf_smollm2[
        1
    ].apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert all(hf_tok(t).input_ids == hf_smollm2[1](t).input_ids for t in TEXTS)


def test_smollm2_tokenizer_matches_transformers(smollm2, hf_smollm2):
    ours, ref = smollm2.tokenizer, hf_smollm2[1]
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    assert ours.encode("<|im_start|><|im_end|>").ids == [1, 2]  # special tokens stay whole
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (ref.bos_token, ref.eos_token, ref.pad_token)
    assert 2 in ours.stop_ids  # <|im_end|> ends a turn


def test_smollm2_chat_template_matches_transformers(smollm2, hf_smollm2):
    ref = hf_smollm2[1]
    conversations = [
        CHAT,
        CHAT[1:],
        CHAT
        + [
            {"role": "assistant", "content": "Red, green, blue."},
            {"role": "user", "content": "Thanks! And at sunset?"},
        ],
    ]
    for messages in conversations:
        for gen in (True, False):
            ours = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=gen)
            assert ours == ref.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert (
                smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
                == ref(ours, add_special_tokens=False).input_ids
            )


# --- synthetic files --------------------------------------------------------------------------


def _torch_reference(arch: str, weights: dict[str, np.ndarray]):
    """A transformers model of `arch` holding `weights` (the float reference)."""
    import torch
    import transformers

    cfg = hf_config(arch)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(v) for k, v in weights.items()}, strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_architecture_logits_match_float_reference(arch, tmp_path):
    weights = hf_weights(arch)
    write_gguf(tmp_path / "m.gguf", arch, weights)
    model = jaxlongctx.load(tmp_path / "m.gguf")
    c = model.config
    assert (c.model_type, c.qkv_bias, c.qk_norm, c.tie_word_embeddings, c.head_dim) == (
        arch,
        ARCHS[arch]["qkv_bias"],
        ARCHS[arch]["qk_norm"],
        ARCHS[arch]["tie"],
        ARCHS[arch]["head_dim"],
    )
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 48)).astype(np.int32)
    ref = _torch_logits(_torch_reference(arch, weights), ids)
    np.testing.assert_allclose(np.asarray(model(ids)), ref, atol=1e-4 * np.abs(ref).max())


def test_load_casts_to_bf16(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", hf_weights("llama"), "F16")
    fp32, bf16 = jaxlongctx.load(tmp_path / "m.gguf"), jaxlongctx.load(tmp_path / "m.gguf", dtype="bf16")
    assert str(fp32.dtype) == "float32" and str(bf16.dtype) == "bfloat16"
    ids = np.arange(32, dtype=np.int32)[None] * 7 % VOCAB
    ref = np.asarray(fp32(ids))
    assert np.abs(np.asarray(bf16(ids)) - ref).max() < 0.05 * np.abs(ref).max()


def _hf_layout(model) -> dict[str, np.ndarray]:
    """Our parameters under HF names and layout."""
    params = {k: np.asarray(v) for k, v in _flat(model)}
    out = {}
    for rule in tensor_rules(model.config):
        value = params[".".join(rule.ours)]
        for i in range(model.config.num_layers) if rule.per_layer else [None]:
            t = value[i] if rule.per_layer else value
            out[rule.template.format(i=i)] = t.T if rule.transpose else t
    return out


def _flat(model):
    from flax import nnx

    def walk(tree, prefix):
        for k, v in tree.items():
            name = f"{prefix}.{k}" if prefix else k
            yield from walk(v, name) if isinstance(v, dict) else [(name, v)]

    return walk(nnx.to_pure_dict(model.params), "")


def _hf_rows_from_gguf(rows: np.ndarray, heads: int) -> np.ndarray:
    """HF row order of a llama Q/K weight stored in llama.cpp's order (by indexing, not reshaping)."""
    perm = llama_cpp_permute(np.arange(rows.shape[0]), heads)  # GGUF row r holds HF row perm[r]
    out = np.empty_like(rows)
    out[perm] = rows
    return out


# Relative Frobenius error of a round trip through the type (the quantizer's own error, with margin).
_TOLERANCE = {
    "F32": 0.0,
    "F16": 1e-3,
    "BF16": 5e-3,
    "Q8_0": 1e-2,
    "Q5_0": 0.06,
    "Q5_1": 0.06,
    "Q4_0": 0.12,
    "Q4_1": 0.12,
}


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_tensor_type_matches_reference(qtype, tmp_path):
    """Every weight of a llama file in `qtype` loads in HF layout (Q/K rope rows restored) equal to the
    float weights it was quantized from (within the type's error), or for K-quants (no quantizer in
    gguf) to transformers' own dequantization of the same blocks."""
    import gguf
    import torch
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    weights = hf_weights("llama")
    written = write_gguf(tmp_path / "m.gguf", "llama", weights, qtype)
    ours = _hf_layout(jaxlongctx.load(tmp_path / "m.gguf"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, ARCHS["llama"]["layers"])
    assert set(ours) == set(weights)
    for hf, w in weights.items():
        if qtype in K_BLOCKS and w.ndim == 2:
            raw = written[names.get_name(hf, try_suffixes=(".weight",))]
            ref = torch_dequantize(torch.from_numpy(raw), int(gguf.GGMLQuantizationType[qtype])).numpy()
            ref = ref.reshape(w.shape)
            if ".q_proj." in hf or ".k_proj." in hf:
                ref = _hf_rows_from_gguf(ref, ARCHS["llama"]["heads" if ".q_proj." in hf else "kv_heads"])
            np.testing.assert_allclose(ours[hf], ref, rtol=0, atol=1e-6, err_msg=hf)
        else:
            err = np.linalg.norm(ours[hf] - w) / np.linalg.norm(w)
            assert err <= (_TOLERANCE[qtype] if w.ndim == 2 else 0.0), (hf, err)


def test_metadata_tensor_types_are_what_the_file_says(tmp_path):
    import gguf

    write_gguf(tmp_path / "m.gguf", "llama", hf_weights("llama"), "Q4_K")
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert kinds["blk.0.attn_q.weight"] == "Q4_K" and kinds["blk.0.attn_norm.weight"] == "F32"


def test_convert_cli_export_and_chat_files(tmp_path, capsys):
    """`jaxlongctx convert --gguf` writes our checkpoint with the tokenizer and chat template; `--export`
    of it is a HF directory that transformers loads with the same logits and chat prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = tmp_path / "m.gguf"
    write_gguf(gguf_file, "llama", hf_weights("llama"), "Q8_0", tokenizer=gpt2_chat_tokenizer(TEXTS))
    assert cli_main(["convert", "--gguf", str(gguf_file), "--out", str(tmp_path / "ckpt")]) == 0
    assert cli_main(["convert", "--export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    direct = load_gguf(gguf_file)
    from_ckpt = jaxlongctx.load(tmp_path / "ckpt")
    ids = np.asarray([direct.tokenizer.encode(TEXTS[0] + TEXTS[1]).ids])
    ref = _torch_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32), ids)
    np.testing.assert_allclose(np.asarray(direct(ids)), ref, atol=1e-4 * np.abs(ref).max())
    np.testing.assert_array_equal(np.asarray(from_ckpt(ids)), np.asarray(direct(ids)))

    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    gguf_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in TEXTS:
        assert direct.tokenizer.encode(text).ids == hf_tok(text).input_ids == gguf_tok(text).input_ids, text
    prompt = from_ckpt.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert prompt == hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    from_hf_dir = jaxlongctx.load(
        tmp_path / "hf"
    ).tokenizer  # HF directories: chat from tokenizer_config.json
    assert from_hf_dir.apply_chat_template(CHAT, add_generation_prompt=True) == prompt
    assert from_ckpt.tokenizer.stop_ids[0] == 2


@pytest.mark.parametrize("pre", ["default", "llama-bpe", "qwen2"])
def test_byte_level_pre_splits_match_transformers(pre, tmp_path):
    """The text split named by tokenizer.ggml.pre (GPT-2's, Llama 3's, Qwen2's) as transformers applies it."""
    from transformers import AutoTokenizer

    from convert.gguf_tokenizer import build_tokenizer

    meta = dict(gpt2_chat_tokenizer(TEXTS), pre=pre)
    write_gguf(tmp_path / "m.gguf", "llama", hf_weights("llama"), tokenizer=meta)
    ours = build_tokenizer(open_for_import(tmp_path / "m.gguf")[0], "m.gguf")
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in TEXTS + ["x = 1234567 + 89;\r\n\r\n  y's  ok"]:
        assert ours.encode(text).ids == ref(text).input_ids, text


def test_smollm_pre_split_keeps_digits_apart(tmp_path):
    """`smollm` (like llama.cpp's starcoder family) splits every digit before BPE, as SmolLM2's own
    tokenizer does, even where the vocabulary has multi-digit merges."""
    from convert.gguf_tokenizer import build_tokenizer

    meta = dict(gpt2_chat_tokenizer(TEXTS + ["in 2024 in 2024 in 2024"] * 500), pre="smollm")
    write_gguf(tmp_path / "m.gguf", "llama", hf_weights("llama"), tokenizer=meta)
    ours = build_tokenizer(open_for_import(tmp_path / "m.gguf")[0], "m.gguf")
    assert ours.token_to_id("\u01202024") is not None  # the vocabulary merges " 2024" whole
    assert [ours.decode([i]) for i in ours.encode("in 2024").ids][-4:] == ["2", "0", "2", "4"]


def _trained_sentencepiece_tokenizer() -> dict:
    """A SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, then BPE pieces scored by rank."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(head) + 64, show_progress=False)
    tok.train_from_iterator(TEXTS * 3, trainer)
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])][: VOCAB - len(head)]
    tokens = head + pieces + [f"<unused{i}>" for i in range(VOCAB - len(head) - len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [5] * (VOCAB - len(head) - len(pieces))
    scores = [0.0] * len(head) + [-float(i) for i in range(VOCAB - len(head))]
    return dict(model="llama", tokens=tokens, types=types, scores=scores, bos=1, eos=2, unk=0, add_bos=True)


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    write_gguf(
        tmp_path / "m.gguf", "llama", hf_weights("llama"), tokenizer=_trained_sentencepiece_tokenizer()
    )
    ours = load_gguf(tmp_path / "m.gguf").tokenizer
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in TEXTS + ["x", "  two leading spaces", "unseen 字 falls back to bytes"]:
        ids = ours.encode(text).ids
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.encode("hi").ids[0] == 1  # <s> first


def test_streaming_keeps_memory_near_one_tensor(tmp_path):
    """Import holds about one tensor at a time: stacking a 12-layer file into file-backed buffers
    (what `convert --gguf` does before orbax writes the checkpoint) peaks at a few tensors of Python
    heap (numpy included), far below the model; `load_gguf` peaks at the model plus a few tensors."""
    weights = hf_weights("llama", layers=12)
    write_gguf(tmp_path / "m.gguf", "llama", weights, "Q8_0")
    largest = max(w.nbytes for w in weights.values())
    model_bytes = sum(w.nbytes for w in weights.values())
    _, config, tensors = open_for_import(tmp_path / "m.gguf")

    def buffer(name, shape):
        return np.lib.format.open_memmap(tmp_path / f"{name}.npy", mode="w+", dtype=np.float32, shape=shape)

    tracemalloc.start()
    try:
        stack_params(
            tensors, config, np.dtype(np.float32), tmp_path / "m.gguf", progress=False, allocate=buffer
        )
        stack_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        load_gguf(tmp_path / "m.gguf")
        load_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert stack_peak < 6 * largest < model_bytes / 6, (stack_peak, largest, model_bytes)
    assert load_peak < model_bytes + 6 * largest, (load_peak, largest, model_bytes)


# --- bad files ---------------------------------------------------------------------------------


def _bad_file(kind: str, tmp_path: Path) -> Path:
    import gguf

    f = tmp_path / "bad.gguf"
    if kind == "not_gguf":
        f.write_text("this is a text file, not a model\n")
    elif kind == "unsupported_arch":
        write_gguf(f, "llama", hf_weights("llama"), arch_name="phi2")
    elif kind == "bad_tokenizer":
        write_gguf(f, "llama", hf_weights("llama"), tokenizer=dict(gpt2_chat_tokenizer(TEXTS), eos=VOCAB + 5))
    elif kind == "unsupported_type":
        writer = gguf.GGUFWriter(str(f), "llama")
        writer.add_block_count(1)
        writer.add_embedding_length(256)
        writer.add_feed_forward_length(512)
        writer.add_head_count(4)
        q2_k_blocks = np.zeros((VOCAB, 84), np.uint8)  # one 84-byte Q2_K block per row of 256
        writer.add_tensor("token_embd.weight", q2_k_blocks, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    else:
        write_gguf(f, "llama", hf_weights("llama"), "Q4_0")
        data = f.read_bytes()
        f.write_bytes(data[:200] if kind == "truncated_header" else data[: len(data) - 1000])
    return f


@pytest.mark.parametrize(
    "kind, message",
    [
        ("not_gguf", "not a GGUF file"),
        ("unsupported_arch", "unsupported architecture 'phi2'"),
        ("unsupported_type", "type Q2_K, which is not supported"),
        ("bad_tokenizer", f"eos_token_id={VOCAB + 5} is outside the {VOCAB}-token vocabulary"),
        ("truncated_header", "corrupt or truncated GGUF file"),
        ("truncated_data", "truncated"),
    ],
)
def test_bad_file_is_a_clear_error_and_leaves_nothing(kind, message, tmp_path, capsys):
    f = _bad_file(kind, tmp_path)
    out = tmp_path / "out"
    before = set(tmp_path.iterdir())
    assert cli_main(["convert", "--gguf", str(f), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and str(f) in err, err
    assert set(tmp_path.iterdir()) == before  # no output, no temporary sibling
    with pytest.raises(
        ConversionError, match=message
    ):  # GGUFError for the file, ConversionError for its tokenizer
        jaxlongctx.load(f)


def test_smollm2_generate_chat_stops_at_end_of_turn(smollm2, monkeypatch, capsys):
    """`generate --chat --prompt -` (prompt on standard input) ends the answer at <|im_end|>, where the
    model, left to run, goes on into a new turn."""
    question = "What is the capital of France?"
    prompt = smollm2.tokenizer.apply_chat_template(
        chat_messages(question), add_generation_prompt=True, tokenize=True
    )
    free = jaxlongctx.generate(smollm2, np.asarray([prompt]), jaxlongctx.SamplingParams(24, stop_ids=()))
    free = free[0, len(prompt) :].tolist()
    end = free.index(2)  # <|im_end|>
    assert 1 in free[end + 1 :]  # <|im_start|>: a new turn
    monkeypatch.setattr("sys.stdin", io.StringIO(question + "\n"))
    assert (
        cli_main(
            ["generate", "--ckpt", str(smollm2_gguf()), "--chat", "--prompt", "-", "--max-new-tokens", "24"]
        )
        == 0
    )
    assert capsys.readouterr().out == smollm2.tokenizer.decode(free[:end]) + "\n"
