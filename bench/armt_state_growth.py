"""How the ARMT memory state grows over a long input: ||A_l|| and ||z_l|| of every layer after each
segment of one held-out haystack.

    python -m bench.armt_state_growth [--quick] [--armt-ckpt DIR] [--tokens N]

The associative memory has no decay: `A_l` changes only through delta-rule writes and `z_l` only
grows. The plot shows whether the state settles or keeps growing over inputs longer than the
model was trained on; compare checkpoints with `--armt-ckpt`. Writes
bench/results/armt_state_growth.{json,png}.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from tqdm import tqdm

from bench.common import plot_path, repo_path, save_plot, subplots, use_quick_results, write_result
from jaxlongctx.data.haystack import eval_seed, make_sample
from jaxlongctx.data.tokenizer import load_default_tokenizer
from jaxlongctx.demo import ARMT_MODEL
from jaxlongctx.loading import load


def state_norms(armt, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Frobenius norms of A and z of every layer after each segment of ids `[1, T]` (cut as the model
    cuts, `armt.segmentation`): `[nS, L]` each, and where each segment ends (`ends [nS]`, tokens read)."""
    segs = armt.segments(ids, np.array([ids.shape[1]]))[0]
    state, a_norms, z_norms = None, [], []
    for i in tqdm(range(segs.count), desc="segments", unit="seg"):
        state, _ = armt.run_segments(armt.params, segs[i : i + 1], "sequential", state)
        a_norms.append(np.linalg.norm(np.asarray(state.A)[:, 0], axis=(1, 2)))
        z_norms.append(np.linalg.norm(np.asarray(state.z)[:, 0], axis=1))
    return {"A": np.stack(a_norms), "z": np.stack(z_norms), "ends": np.cumsum(segs.n[:, 0])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4,096 tokens")
    p.add_argument("--armt-ckpt", default=str(ARMT_MODEL))
    p.add_argument("--tokens", type=int, default=32768, help="haystack length (default 32,768)")
    args = p.parse_args()
    use_quick_results(args.quick)
    tokens = 4096 if args.quick else args.tokens
    armt = load(args.armt_ckpt, "fp32")
    sample = make_sample(eval_seed(0), tokens, load_default_tokenizer(), num_facts=4)
    t0 = time.perf_counter()
    norms = state_norms(armt, sample.ids[None].astype(np.int32))
    ends = norms["ends"].tolist()
    write_result(
        "armt_state_growth",
        {
            "armt_ckpt": repo_path(args.armt_ckpt),
            "tokens": tokens,
            "segment_size": armt.armt.segment_size,
            "segmentation": armt.segmentation,
            "quick": args.quick,
            "segment_end_tokens": ends,
            "A_norm_per_layer": norms["A"].tolist(),
            "z_norm_per_layer": norms["z"].tolist(),
            "wall_s": time.perf_counter() - t0,
            "plot": "armt_state_growth.png",
        },
    )
    fig, axes = subplots(1, 2, figsize=(11, 4))
    for ax, name in zip(axes, ("A", "z")):
        for layer in range(norms[name].shape[1]):
            ax.plot(ends, norms[name][:, layer], label=f"layer {layer}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens read")
        ax.set_ylabel(f"||{name}_l||")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"ARMT memory state over one {tokens:,}-token haystack ({repo_path(args.armt_ckpt)})")
    save_plot(fig, plot_path("armt_state_growth"), dpi=110)


if __name__ == "__main__":
    main()
