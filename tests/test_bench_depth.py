"""The depth bench: exact match by context length and the asked fact's set depth."""

import json

import pytest

from jaxlongctx.demo import ARMT_MODEL


def test_depth_grid_scores_every_cell_on_the_shipped_model(tmp_path, monkeypatch):
    import bench.common
    from bench.armt_depth import depth_grid

    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path / "results")
    depth_grid(ARMT_MODEL, [1, 2], [256, 512], [0.0, 1.0], samples=2)
    out = json.loads((tmp_path / "results" / "armt_depth.json").read_text())
    assert out["lengths"] == [256, 512] and out["depths"] == [0.0, 1.0] and out["segmentation"] == "sentences"
    assert set(out["results"]) == {"armt_1_facts", "armt_2_facts"}
    for grid in out["results"].values():
        assert [[c["length"] for c in line] for line in grid] == [[256, 256], [512, 512]]
        for line in grid:
            start, end = line
            assert (start["target_depth"], end["target_depth"]) == (0.0, 1.0)
            assert start["samples"] == end["samples"] == 2
            assert start["asked_depth"] < 0.1 and end["asked_depth"] > 0.8  # the asked fact went where asked
            assert 0.0 <= start["exact_match"] <= 1.0
    assert (tmp_path / "results" / "armt_depth.png").is_file()
    with pytest.raises(ValueError, match="depths"):
        depth_grid(ARMT_MODEL, [1], [256], [1.5], samples=1)
