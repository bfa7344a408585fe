"""The PQ real-model bench's merge (`bench.pq_real_model`): a full retrieval run and a later `--only` run
of more settings on the same items combine per seed, paired with dense, without a model."""

from __future__ import annotations

import json

import pytest

import bench.common
from bench import pq_real_model


def _part(settings: list[str], answers: dict[int, dict[str, str]], truth: dict[int, str]) -> dict:
    return {
        "config": {"context": 8192, "noun": "secret number"},
        "settings": [{"name": name, "kind": name.split()[0], "bits_per_element": 4.0} for name in settings],
        "items": [
            {"seed": seed, "depth": 0.5, "answer": truth[seed], "answers": answers[seed]} for seed in answers
        ],
        "complete": True,
    }


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(bench.common, "_QUICK", False)
    return tmp_path


def test_an_only_run_adds_its_settings_to_the_full_runs_items(results):
    extra = "pq ds2 layer_head 6-bit cal8K"
    truth = {1: "11", 2: "22", 3: "33"}
    full = _part(["dense", "int4 g128"], {s: {"dense": truth[s], "int4 g128": "0"} for s in truth}, truth)
    full["items"][0]["answers"]["dense"] = "wrong"
    only = _part([extra], {3: {extra: "33"}, 1: {extra: "11"}, 2: {extra: "0"}}, truth)
    name = "pq_real_retrieval_t"
    (results / f"{pq_real_model.shard_name(name, (0, 1))}.json").write_text(json.dumps(full))
    only_name = pq_real_model.shard_name(name, (0, 1), [extra])
    assert only_name != pq_real_model.shard_name(name, (0, 1))  # the full run's file stays
    (results / f"{only_name}.json").write_text(json.dumps(only))

    out = pq_real_model.merge("pq_real_model_t")["retrieval"]
    rows = {r["name"]: r for r in out["rows"]}
    assert list(rows) == ["dense", extra, "int4 g128"]  # the order of `retrieval_settings`
    assert [i["seed"] for i in out["items"]] == [1, 2, 3]
    assert (rows["dense"]["right"], rows["int4 g128"]["right"], rows[extra]["right"]) == (2, 0, 2)
    # paired with dense: seed 1 right only with the extra setting, seed 2 right only with dense
    assert rows[extra]["right_where_dense_wrong"] == 1 and rows[extra]["wrong_where_dense_right"] == 1
    assert rows[extra]["points_vs_dense"] == 0.0
    assert (results / "pq_real_retrieval_t.png").is_file()


def test_a_setting_missing_on_some_items_is_left_out(results):
    truth = {1: "11", 2: "22"}
    full = _part(["dense"], {s: {"dense": truth[s]} for s in truth}, truth)
    partial = _part(["int4 g128"], {1: {"int4 g128": "11"}}, truth)
    for i, part in enumerate((full, partial)):
        (results / f"pq_real_retrieval_t_shard{i}of2.json").write_text(json.dumps(part))
    rows = pq_real_model.merge("pq_real_model_t")["retrieval"]["rows"]
    assert [r["name"] for r in rows] == ["dense"]


def test_parts_that_disagree_on_an_answer_are_refused(results):
    full = _part(["dense"], {1: {"dense": "11"}}, {1: "11"})
    other = _part(["int4 g128"], {1: {"int4 g128": "11"}}, {1: "12"})
    for i, part in enumerate((full, other)):
        (results / f"pq_real_retrieval_t_shard{i}of2.json").write_text(json.dumps(part))
    with pytest.raises(ValueError, match="disagree"):
        pq_real_model.merge("pq_real_model_t")


def test_a_run_of_later_items_adds_them_to_the_set(results):
    truth = {1: "11", 2: "22", 3: "33", 4: "44"}
    name = "pq_real_retrieval_t"
    first = _part(["dense"], {s: {"dense": truth[s]} for s in (1, 2)}, truth)
    later = _part(["dense"], {s: {"dense": truth[s] if s == 3 else "0"} for s in (3, 4)}, truth)
    later_name = pq_real_model.shard_name(name, (0, 1), first_item=2)
    assert later_name != pq_real_model.shard_name(name, (0, 1))
    (results / f"{pq_real_model.shard_name(name, (0, 1))}.json").write_text(json.dumps(first))
    (results / f"{later_name}.json").write_text(json.dumps(later))
    out = pq_real_model.merge("pq_real_model_t")["retrieval"]
    assert [i["seed"] for i in out["items"]] == [1, 2, 3, 4]
    assert (out["rows"][0]["right"], out["rows"][0]["samples"]) == (3, 4)


def test_retrieval_runs_without_dense_are_refused_by_name(results):
    only = _part(["int4 g128"], {1: {"int4 g128": "11"}}, {1: "11"})  # an --only run, no dense beside it
    (results / "pq_real_retrieval_t_shard0of1.json").write_text(json.dumps(only))
    with pytest.raises(SystemExit, match="without the dense cache"):
        pq_real_model.merge("pq_real_model_t")


def test_generate_retrieval_summary_pairs_with_dense_and_the_harness():
    from bench.pq_real_generate_retrieval import summary

    items = [
        {
            "answer": "1234",
            "answers": {"dense": "1234", "pq": "1234"},
            "harness": {"dense": "1234", "pq": "1.\n"},
        },
        {
            "answer": "5678",
            "answers": {"dense": "5678", "pq": "5.\n"},
            "harness": {"dense": None, "pq": "5.\n"},
        },
        {
            "answer": "0000",
            "answers": {"dense": "1.\n", "pq": "0000"},
            "harness": {"dense": None, "pq": None},
        },
    ]
    dense, pq = summary(items, ["dense", "pq"], {"dense": 16.0, "pq": 4.2})
    assert (dense["right"], dense["harness_items"], dense["same_answer_as_harness"]) == (2, 1, 1)
    assert (pq["right"], pq["right_where_dense_wrong"], pq["wrong_where_dense_right"]) == (2, 1, 1)
    assert (pq["harness_items"], pq["harness_right"], pq["same_answer_as_harness"]) == (2, 0, 1)
    assert pq["interval_95"][0] < 2 / 3 < pq["interval_95"][1]


def test_4bit_retrieval_rows_pair_with_dense_by_seed():
    from bench.pq_real_retrieval_4bit import paired_rows

    dense = [
        {"seed": s, "answer": a, "answers": {"dense": d}}
        for s, a, d in ((1, "1234", "1234"), (2, "5678", "5.\n"), (3, "0000", "0000"))
    ]
    run = {
        "settings": [{"name": "pq", "bits_per_element": 4.6}],
        "items": [  # item 3 unanswered; a seed dense has not is left out
            {"seed": 1, "answer": "1234", "answers": {"pq": "123."}},
            {"seed": 2, "answer": "5678", "answers": {"pq": " 5678"}},
            {"seed": 9, "answer": "9999", "answers": {"pq": "9999"}},
        ],
    }
    rows = paired_rows(dense, [("pq", "PQ", [run])])
    assert (rows[0]["right"], rows[0]["samples"]) == (2, 3)
    got = rows[1]
    assert (got["right"], got["samples"], got["bits_per_element"]) == (1, 2, 4.6)
    assert (got["right_where_dense_wrong"], got["wrong_where_dense_right"]) == (1, 1)
    run["items"][0]["answer"] = "4321"  # another item under the same seed
    with pytest.raises(ValueError, match="another answer"):
        paired_rows(dense, [("pq", "PQ", [run])])
    with pytest.raises(ValueError, match="0 items answered"):
        paired_rows(dense, [("int4", "int4", [run])])
