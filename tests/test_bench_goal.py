"""The retrieval bench's goal check: 90% exact match at 4x the longest training sample."""

import json

import pytest

from bench.armt_retrieval import goal_check, longest_training_tokens, unseen_filler_split
from jaxlongctx.demo import ARMT_MODEL
from jaxlongctx.train.evaluate import exact_match_interval


def _cell(length, right, samples):
    return {
        "length": length,
        "samples": samples,
        "exact_match": right / samples,
        "exact_match_ci95": exact_match_interval(right, samples),
    }


def test_longest_training_tokens_reads_the_shipped_lineage_only(tmp_path):
    assert longest_training_tokens(ARMT_MODEL) == 16384  # the last runs trained on 16K-token samples
    record = {
        "runs": [{"curriculum": [{"tokens": 128}, {"tokens": 2048}]}, {"stopped": "by hand"}],
        "not_shipped": [{"curriculum": [{"tokens": 65536}]}],
    }
    (tmp_path / "training.json").write_text(json.dumps(record))
    assert longest_training_tokens(tmp_path) == 2048
    assert longest_training_tokens(tmp_path / "missing") is None


def test_goal_check_scores_armt_rows_at_four_times_the_longest_sample():
    rows = {
        "armt_1_facts": [_cell(2048, 64, 64), _cell(8192, 63, 64)],  # the whole interval above 90%
        "armt_2_facts": [_cell(8192, 58, 64)],  # 90.6%: met, but the interval reaches below
        "armt_4_facts": [_cell(8192, 32, 64)],  # 50%: the whole interval below
        "armt_8_facts": [_cell(4096, 1, 2)],  # no cell at the goal length
        "full_attention": [_cell(8192, 64, 64)],
    }  # not ARMT
    goal = goal_check(rows, 2048)
    assert goal["length"] == 8192 and goal["exact_match_goal"] == 0.9
    assert set(goal["rows"]) == {"armt_1_facts", "armt_2_facts", "armt_4_facts"}
    one, two, four = (goal["rows"][f"armt_{n}_facts"] for n in (1, 2, 4))
    assert one["met"] and one["met_with_confidence"] and not one["missed_with_confidence"]
    assert two["met"] and not two["met_with_confidence"] and not two["missed_with_confidence"]
    assert not four["met"] and four["missed_with_confidence"] and four["samples"] == 64
    assert goal_check(rows, 16384) is None and goal_check(rows, None) is None


def test_unseen_filler_split_is_the_first_split_the_lineage_never_drew_filler_from(tmp_path):
    assert (
        unseen_filler_split(ARMT_MODEL) == "calibration"
    )  # the shipped runs drew validation, then train filler
    cases = [
        ([{"filler_split": "validation"}, {}], "train"),  # a run without the field predates it: validation
        ([{"filler_split": "validation"}, {"filler_split": "train"}], "calibration"),  # train text seen
        ([{}, {"filler_split": "train"}, {"filler_split": "calibration"}], None),  # every split seen
        ([{"filler_split": "train"}], None),
    ]  # validation filler is new to it: the main rows are held out
    for runs, expected in cases:
        (tmp_path / "training.json").write_text(json.dumps({"runs": runs}))
        assert unseen_filler_split(tmp_path) == expected
    assert unseen_filler_split(tmp_path / "missing") is None


def test_goal_only_scores_each_fact_count_at_the_goal_length(tmp_path, monkeypatch):
    """`--goal-only` on the shipped weights with a lineage whose longest sample is 128 tokens: one
    512-token cell per fact count, scored against the goal, written as its own result."""
    import shutil

    import bench.common
    from bench.armt_retrieval import goal_only

    ckpt = tmp_path / "armt"
    shutil.copytree(ARMT_MODEL, ckpt)
    (ckpt / "training.json").write_text(json.dumps({"runs": [{"curriculum": [{"tokens": 128}]}]}))
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "segmentation": "fixed"}))  # saved on the grid
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path / "results")
    goal_only(ckpt, [1, 2], samples=4)
    out = json.loads((tmp_path / "results" / "armt_retrieval_goal.json").read_text())
    assert out["goal"]["length"] == 512 and set(out["goal"]["rows"]) == {"armt_1_facts", "armt_2_facts"}
    cell = out["results"]["armt_2_facts"][0]
    assert cell["length"] == 512 and cell["samples"] == 4 and cell["num_facts"] == 2
    assert out["goal"]["rows"]["armt_2_facts"]["exact_match"] == cell["exact_match"]
    assert out["segmentation"] == "fixed"
    goal_only(ckpt, [1], samples=4, segmentation="sentences")  # an override: its own file, the default's kept
    sentences = json.loads((tmp_path / "results" / "armt_retrieval_goal_sentences.json").read_text())
    assert (
        sentences["segmentation"] == "sentences" and sentences["results"]["armt_1_facts"][0]["samples"] == 4
    )
    assert json.loads((tmp_path / "results" / "armt_retrieval_goal.json").read_text()) == out
    (ckpt / "training.json").unlink()
    with pytest.raises(SystemExit, match=r"training\.json"):
        goal_only(ckpt, [1], samples=4)


def test_split_facts_scores_one_fact_as_drawn_and_split(tmp_path, monkeypatch):
    """`--split-lengths` on the shipped weights: per length, one fact as drawn and the same samples with a
    boundary splitting every asked fact, on the fixed grid and in sentence segments, with the plot."""
    import bench.common
    from bench.armt_retrieval import split_facts

    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path / "results")
    split_facts(ARMT_MODEL, [512], samples=4)
    out = json.loads((tmp_path / "results" / "armt_split_facts.json").read_text())
    drawn, split = out["results"]["one_fact"][0], out["results"]["split_fact"][0]
    assert drawn["length"] == split["length"] == 512 and drawn["num_facts"] == split["num_facts"] == 1
    assert split["split_facts"] and split["code_split_samples"] == 4 and not drawn["split_facts"]
    for name in ("one_fact", "split_fact"):  # the same samples again, cut after sentence ends
        fixed, sentences = out["results"][name][0], out["results"][f"{name}_sentences"][0]
        assert (fixed["segmentation"], sentences["segmentation"]) == ("fixed", "sentences")
        assert (
            sentences["samples"] == fixed["samples"] == 4 and sentences["split_facts"] == fixed["split_facts"]
        )
    assert out["results"]["split_fact_sentences"][0]["code_split_samples"] == 0  # counted on its own segments
    assert (tmp_path / "results" / "armt_split_facts.png").is_file()
