"""The disk cache of the command line: a second process reuses the compiled programs and the converted
weights of a GGUF file, a changed file is converted again (its old entry deleted), two processes can
start at once, and `--no-cache` / `JAXLONGCTX_NO_CACHE` leave the cache alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf_synthetic import gpt2_chat_tokenizer, hf_weights, write_gguf

from jaxlongctx import weight_cache
from jaxlongctx.disk_cache import cache_disabled_by_env, default_cache_dir

REPO = Path(__file__).resolve().parent.parent
# Runs the CLI, counting GGUF conversions and JAX's persistent-cache hits, and prints them as JSON.
RUN_CLI = """
import json, sys
from jax import monitoring
hits = []
monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
)
import convert.gguf_llama as gguf_llama
conversions = []
load_gguf = gguf_llama.load_gguf
gguf_llama.load_gguf = lambda *a, **k: conversions.append(1) or load_gguf(*a, **k)
from jaxlongctx.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "cache_hits": len(hits), "conversions": len(conversions)}))
"""
TEXTS = ["the cat sat on the mat", "a dog ran in the park", "hello world"]


def start(gguf: Path, cache: Path, *extra: str) -> subprocess.Popen:
    """A `jaxlongctx generate --chat` process over `gguf` with its disk cache in `cache`."""
    env = {k: v for k, v in os.environ.items() if k != "JAXLONGCTX_NO_CACHE"}
    env.update(PYTHONPATH=str(REPO), JAXLONGCTX_CACHE_DIR=str(cache))
    argv = ["generate", "--model", str(gguf), "--chat", "--prompt", "hello", "--max-new-tokens", "3", *extra]
    return subprocess.Popen(
        [sys.executable, "-c", RUN_CLI, *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen) -> tuple[str, dict]:
    """(the generated text, the counts) of a finished `start` process."""
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    *text, counts = out.strip().splitlines()
    return "\n".join(text), json.loads(counts)


def entries(cache: Path) -> list[Path]:
    """The weight-cache entries (one folder per source version and dtype)."""
    return sorted(p for p in (cache / "weights").glob("*/*") if not p.name.startswith("."))


def test_second_process_hits_both_caches_and_a_changed_file_is_converted_again(tmp_path):
    gguf, cache = tmp_path / "model" / "m.gguf", tmp_path / "cache"
    gguf.parent.mkdir()
    write_gguf(gguf, "llama", hf_weights("llama"), "Q8_0", tokenizer=gpt2_chat_tokenizer(TEXTS))
    first_text, first = finish(start(gguf, cache))
    assert first == {"rc": 0, "cache_hits": 0, "conversions": 1}
    assert len(entries(cache)) == 1 and any((cache / "compiled").iterdir())
    assert os.listdir(gguf.parent) == ["m.gguf"]  # nothing written next to the source

    second_text, second = finish(start(gguf, cache))
    assert second["conversions"] == 0 and second["cache_hits"] >= 2  # prefill and decode step at least
    assert second_text == first_text

    # another version of the file (other weights): two processes start at once; the first to need the
    # weights converts them (the other may find them written by then), both answer alike
    write_gguf(gguf, "llama", hf_weights("llama", seed=3), "Q8_0", tokenizer=gpt2_chat_tokenizer(TEXTS))
    both = [finish(p) for p in (start(gguf, cache), start(gguf, cache))]
    assert sorted(counts["conversions"] for _, counts in both) in ([0, 1], [1, 1])
    assert both[0][0] == both[1][0]
    (entry,) = entries(cache)  # the old version's entry is gone
    assert entry.name.startswith(weight_cache.source_fingerprint(gguf))
    _, again = finish(start(gguf, cache))
    assert again["conversions"] == 0

    _, off = finish(start(gguf, tmp_path / "unused", "--no-cache"))
    assert off["conversions"] == 1 and not (tmp_path / "unused").exists()


def test_weight_cache_entry_round_trip_and_fingerprint(tmp_path):
    source = tmp_path / "m.gguf"
    source.write_bytes(os.urandom(3 * weight_cache.CHUNK + 5))
    entry = weight_cache.entry_dir(tmp_path / "weights", source, "float32")
    arrays = {"embed": np.arange(6, dtype=np.float32).reshape(2, 3), "layers/wq": np.ones((2, 2), np.int8)}
    weight_cache.write_entry(entry, source, {"vocab_size": 2}, arrays, None)
    config, read = weight_cache.read_entry(entry)
    assert config == {"vocab_size": 2}
    for name, array in arrays.items():
        np.testing.assert_array_equal(read[name], array)
        assert read[name].dtype == array.dtype
    before, stat = weight_cache.source_fingerprint(source), source.stat()
    data = bytearray(source.read_bytes())
    data[len(data) // 2] ^= 1  # one byte in the middle MiB: same size, and the same time below
    source.write_bytes(bytes(data))
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weight_cache.source_fingerprint(source) != before
    assert weight_cache.read_entry(weight_cache.entry_dir(tmp_path / "weights", source, "float32")) is None


@pytest.mark.parametrize("value, off", [("1", True), ("yes", True), ("0", False), ("", False)])
def test_cache_switch_and_folder(monkeypatch, tmp_path, value, off):
    monkeypatch.setenv("JAXLONGCTX_NO_CACHE", value)
    assert cache_disabled_by_env() is off
    monkeypatch.setenv("JAXLONGCTX_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("JAXLONGCTX_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "jaxlongctx"


# Loads a GGUF file without a mesh (filling the weight cache), then onto a tp=2 mesh from the cache;
# prints the number of conversions, the sharding of one weight and the largest logit difference.
LOAD_ONTO_MESH = """
import json, sys, threading
import numpy as np
import jaxlongctx
import convert.gguf_llama as gguf_llama
from jaxlongctx.disk_cache import enable_disk_cache
conversions = []
load_gguf = gguf_llama.load_gguf
gguf_llama.load_gguf = lambda *a, **k: conversions.append(1) or load_gguf(*a, **k)
enable_disk_cache(sys.argv[2])
plain = jaxlongctx.load(sys.argv[1], "fp32")
for thread in threading.enumerate():
    if thread.name == "jaxlongctx-weight-cache":
        thread.join()
sharded = jaxlongctx.load(sys.argv[1], "fp32", mesh=jaxlongctx.make_mesh(tp=2))
ids = np.array([[1, 5, 9, 3, 7]], np.int32)
diff = np.abs(np.asarray(plain(ids)) - np.asarray(sharded(ids))).max()
wq = sharded.module.layers.wq[...]
print(json.dumps({"conversions": len(conversions), "shards": len(wq.sharding.device_set),
                  "shard_shape": list(wq.addressable_shards[0].data.shape), "shape": list(wq.shape),
                  "diff": float(diff)}))
"""


def test_cached_weights_are_read_onto_a_mesh(tmp_path):
    gguf, cache = tmp_path / "m.gguf", tmp_path / "cache"
    write_gguf(gguf, "llama", hf_weights("llama"), "Q8_0", tokenizer=gpt2_chat_tokenizer(TEXTS))
    env = {k: v for k, v in os.environ.items() if k != "JAXLONGCTX_NO_CACHE"}
    env.update(PYTHONPATH=str(REPO), XLA_FLAGS="--xla_force_host_platform_device_count=2")
    done = subprocess.run(
        [sys.executable, "-c", LOAD_ONTO_MESH, str(gguf), str(cache)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["conversions"] == 1  # the mesh load read the cache entry
    assert report["shards"] == 2 and report["shard_shape"] != report["shape"]
    assert report["diff"] < 1e-5
