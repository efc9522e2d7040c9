"""Graph imputation's rules (zoo/domain/imputation.py): what an adapter inherits along the edges found from its weights."""

from __future__ import annotations

from typing import Literal

import pytest

from zoo.domain.imputation import COPIES, Link, carrying, impute


def link(
    other: int,
    relation: str,
    labels: dict[str, str],
    other_is: Literal["parent", "child"] = "parent",
    confidence: float = 1.0,
    weight: float | None = None,
) -> Link:
    return Link(other, relation, other_is, confidence, labels, weight)


@pytest.mark.parametrize("relation", sorted(COPIES))
@pytest.mark.parametrize("other_is", ["parent", "child"])
def test_a_copy_carries_every_label_both_ways(relation: str, other_is: Literal["parent", "child"]) -> None:
    found = impute([link(3, relation, {"task": "invert", "dataset": "shapes"}, other_is)])
    assert {k: [v.value for v in i.values] for k, i in found.items()} == {"dataset": ["shapes"], "task": ["invert"]}
    assert found["task"].kind == "copy" and found["task"].values[0].score == 1.0
    assert [s.other for s in found["task"].values[0].sources] == [3]


def test_a_known_key_is_not_inherited_and_a_weak_edge_carries_nothing() -> None:
    assert impute([link(3, "cast", {"task": "invert", "style": "x"})], known=["task"]).keys() == {"style"}
    assert impute([link(3, "cast", {"task": "invert"}, confidence=0.4)]) == {}
    assert impute([link(3, "cast", {"task": "invert"}, confidence=0.4)], min_confidence=0.3)["task"].values[0].score == 0.4


def test_a_merge_inherits_the_union_of_its_parents_scored_by_weight() -> None:
    found = impute([link(1, "merge", {"task": "a"}, weight=0.75), link(2, "merge", {"task": "b"}, weight=0.25)])
    merged = found["task"]
    assert merged.kind == "merge" and [(v.value, v.score) for v in merged.values] == [("a", 0.75), ("b", 0.25)]
    same = impute([link(1, "merge", {"task": "a"}, weight=0.3), link(2, "merge", {"task": "a"}, weight=0.3)])["task"]
    assert [(v.value, v.score) for v in same.values] == [("a", pytest.approx(1.0))] and len(same.values[0].sources) == 2
    # a parent without the label leaves its share unknown
    partial = impute([link(1, "merge", {"task": "a"}, weight=0.5), link(2, "merge", {}, weight=0.5)])["task"]
    assert [(v.value, v.score) for v in partial.values] == [("a", 0.5)] and not partial.complete and merged.complete


def test_a_parent_inherits_nothing_from_its_merge() -> None:
    assert impute([link(9, "merge", {"task": "a+b"}, other_is="child", weight=0.5)]) == {}


def test_a_copy_answers_before_a_merge_and_disagreeing_copies_split_the_score() -> None:
    links = [
        link(1, "merge", {"task": "a"}, weight=1.0),
        link(2, "merge", {"task": "b"}, weight=1.0),
        link(3, "truncated", {"task": "a+b"}, other_is="child"),
        link(4, "rescaled", {"task": "c"}),
    ]
    found = impute(links)["task"]
    assert found.kind == "copy" and [(v.value, v.score) for v in found.values] == [("a+b", 0.5), ("c", 0.5)]
    assert impute(links[:2])["task"].kind == "merge"


def test_continuations_carry_labels_only_when_asked() -> None:
    links = [link(5, "continuation", {"task": "a"}, confidence=0.8)]
    assert impute(links) == {}
    found = impute(links, kinds=("copy", "merge", "continuation"))["task"]
    assert found.kind == "continuation" and found.values[0].score == pytest.approx(0.8)


def test_carrying_names_the_relations_of_the_kinds() -> None:
    assert carrying(("copy",)) == COPIES
    assert carrying(("merge", "continuation")) == {"merge", "continuation"}
