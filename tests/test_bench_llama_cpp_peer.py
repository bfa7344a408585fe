"""bench/llama_cpp_peer.py's F16 conversion of a quantized GGUF (llama.cpp itself is not needed)."""

from __future__ import annotations

import gguf
import numpy as np

from bench import llama_cpp_peer


def test_f16_conversion_dequantizes_and_keeps_the_metadata(tmp_path):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 64)).astype(np.float32)
    norm = rng.standard_normal(64).astype(np.float32)
    source = tmp_path / "tiny.Q8_0.gguf"
    writer = gguf.GGUFWriter(source, "llama")
    writer.add_block_count(1)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    q8 = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_up.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out = llama_cpp_peer.f16_gguf(source, cache=tmp_path / "cache")
    assert out.name == "tiny.F16.gguf"
    assert llama_cpp_peer.f16_gguf(source, cache=tmp_path / "cache") == out  # converted once
    reader = gguf.GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    up, nw = tensors["blk.0.ffn_up.weight"], tensors["blk.0.attn_norm.weight"]
    assert up.tensor_type == gguf.GGMLQuantizationType.F16
    assert nw.tensor_type == gguf.GGMLQuantizationType.F32
    dequantized = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_allclose(np.asarray(up.data, np.float32).reshape(weight.shape), dequantized, rtol=1e-3)
    np.testing.assert_array_equal(np.asarray(nw.data), norm)
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_F16)
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    assert reader.fields["llama.block_count"].contents() == 1
