"""Calibrated class probabilities (embed/selection/calibration.py): fit out of fold, they say how often they are right."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from embed.selection.calibration import (
    ECE_BINS,
    NEVER_SURE,
    SURE,
    SURE_SLACK,
    Calibration,
    TopLabel,
    class_prior,
    earned_sure,
    expected_calibration_error,
    fit,
    is_sure,
    knn_calibration,
    with_earned_sure,
)
from embed.selection.metrics import knn_vote_shares


def _overconfident(n: int, n_classes: int, accuracy: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One-hot shares (a 1-NN: always "100 %") that are right with probability `accuracy`."""
    rng = np.random.default_rng(seed)
    truth = rng.integers(0, n_classes, n)
    wrong = (truth + rng.integers(1, n_classes, n)) % n_classes
    pred = np.where(rng.random(n) < accuracy, truth, wrong)
    return np.eye(n_classes)[pred], truth


@settings(max_examples=50, deadline=None)
@given(
    arrays(np.float64, (7, 5), elements=st.floats(0, 1)),
    st.sampled_from((0.25, 1.0, 4.0)),
    st.floats(0.01, 0.9),
)
def test_calibrated_rows_are_distributions_that_never_say_certain(shares: np.ndarray, temperature: float, mix: float) -> None:
    c = Calibration(temperature, mix, class_prior(np.arange(5), 5), 10)
    p = c.apply(shares)
    assert p.shape == shares.shape and np.allclose(p.sum(axis=1), 1.0)
    assert (p > 0).all() and (p.max(axis=1) < 1.0).all()
    assert np.allclose(c.apply(shares[0]), p[0])  # one row or many, the same


def test_a_one_nn_that_is_right_60_percent_of_the_time_says_about_60_percent() -> None:
    shares, truth = _overconfident(400, 8, 0.6, seed=0)
    raw_ece = _ece(shares, truth)
    c = fit(shares, truth, class_prior(truth, 8))
    fresh, fresh_truth = _overconfident(2000, 8, 0.6, seed=1)  # the same predictor on adapters it was not fit on
    calibrated = c.apply(fresh)
    assert raw_ece > 0.3 and _ece(calibrated, fresh_truth) < 0.05
    assert abs(calibrated.max(axis=1).mean() - 0.6) < 0.05
    assert (calibrated.argmax(axis=1) == fresh.argmax(axis=1)).all()  # calibration keeps the answer


def test_a_perfect_record_on_few_items_is_still_not_certainty() -> None:
    shares, truth = _overconfident(20, 4, 1.0, seed=2)
    c = fit(shares, truth, class_prior(truth, 4))
    assert c.mix >= 1 / 22 and c.apply(shares).max() < 0.99
    tiny = fit(shares[:3], truth[:3], class_prior(truth[:3], 4))
    assert tiny.mix == 0.5 and tiny.n == 3  # too few to fit: half the prior


def test_temperature_sharpens_shares_that_are_too_modest() -> None:
    rng = np.random.default_rng(3)
    truth = rng.integers(0, 3, 600)
    shares = np.full((600, 3), 0.3)
    shares[np.arange(600), truth] = 0.4  # always right, never says more than 40 %
    c = fit(shares, truth, class_prior(truth, 3))
    assert c.temperature < 1 and c.apply(shares).max(axis=1).mean() > 0.8


def _ece(probs: np.ndarray, truth: np.ndarray) -> float:
    return expected_calibration_error(probs.max(axis=1), probs.argmax(axis=1) == truth)


def test_expected_calibration_error_of_plain_cases() -> None:
    eight_of_ten = np.r_[np.ones(8), np.zeros(2)]
    assert np.isclose(expected_calibration_error(np.full(10, 0.8), eight_of_ten), 0.0)  # says 80 %, right 8 times in 10
    assert np.isclose(expected_calibration_error(np.full(10, 0.8), np.r_[np.ones(6), np.zeros(4)]), 0.2)
    assert np.isclose(expected_calibration_error(np.r_[np.full(5, 1.0), np.full(5, 0.55)], np.r_[np.ones(5), np.zeros(5)]), 0.275)


def test_round_trip_and_sureness() -> None:
    c = Calibration(0.5, 0.1, (0.25, 0.75), 12)
    assert Calibration.from_dict(c.as_dict()).top == c.top
    assert is_sure(0.7, 4, 5) and not is_sure(0.7, 2, 5) and not is_sure(0.4, 5, 5) and is_sure(0.6, 0, 0)


def _bins_from(level: float, conf: np.ndarray, right: np.ndarray) -> list[tuple[float, float]]:
    """(accuracy, mean probability) of each equal-width confidence bin holding predictions at or above `level`."""
    which = np.minimum((conf * ECE_BINS).astype(np.int64), ECE_BINS - 1)
    return [
        (float(right[which == b].mean()), float(conf[which == b].mean()))
        for b in range(ECE_BINS)
        if b / ECE_BINS >= level - 1e-9 and (which == b).any()
    ]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.booleans()), min_size=0, max_size=60))
def test_sure_is_earned_in_every_bin_it_covers(items: list[tuple[float, bool]]) -> None:
    """Every confidence bin from the earned level up kept its promise on the held-out predictions, and the level is
    the least that does: the bin just below it (above SURE) broke it."""
    conf = np.array([c for c, _ in items], np.float64)
    right = np.array([r for _, r in items], np.float64)
    level = earned_sure(conf, right)
    assert level >= SURE
    if len(items) < 5:
        assert level == NEVER_SURE
        return
    if level < 1.0:
        assert all(acc >= mean - SURE_SLACK for acc, mean in _bins_from(level, conf, right))
    if level > SURE:
        below = _bins_from(level - 1.0 / ECE_BINS, conf, right) if level < 1.0 else _bins_from(1.0 - 1.0 / ECE_BINS, conf, right)
        assert below and below[0][0] < below[0][1] - SURE_SLACK


def test_an_overconfident_predictor_earns_no_sure() -> None:
    """One-hot shares right 60 % of the time, left uncalibrated: every bin says 100 %, so nothing is sure; the same
    shares calibrated to say what they mean earn it where they are right often enough."""
    shares, truth = _overconfident(200, 4, 0.6, seed=1)
    raw = with_earned_sure(Calibration(1.0, 0.0, class_prior(truth, 4), 200), shares, truth)
    assert raw.sure_from == NEVER_SURE and not is_sure(0.99, 3, 3, raw.sure_from)
    fitted = with_earned_sure(fit(shares, truth, class_prior(truth, 4)), shares, truth)
    assert fitted.sure_from <= 0.7 and is_sure(0.7, 3, 3, fitted.sure_from)
    assert Calibration.from_dict(fitted.as_dict()).sure_from == fitted.sure_from
    assert Calibration.from_dict({k: v for k, v in fitted.as_dict().items() if k != "sure_from"}).sure_from == SURE  # older checkpoints


def _clusters(n_classes: int, per_class: int, seed: int, spread: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(99).normal(size=(n_classes, 12))
    y = np.repeat(np.arange(n_classes), per_class)
    x = centers[y] + spread * rng.normal(size=(len(y), 12))
    return x / np.linalg.norm(x, axis=1, keepdims=True), y


def test_a_knn_among_few_labels_is_calibrated_from_leave_one_out_votes() -> None:
    """Four labelled per class, queries from the same classes: leave-one-out votes see three of their class and are
    less often right than the served votes over four; the learning-curve level makes up for it."""
    n_classes, eces, accs, confs = 10, [], [], []
    for seed in range(6):
        x, y = _clusters(n_classes, 4, seed)
        q, qy = _clusters(n_classes, 40, 100 + seed)
        for k in (1, 3):
            c = knn_calibration(x @ x.T, y, n_classes, k, class_prior(y, n_classes))
            p = c.apply(knn_vote_shares(q @ x.T, y, n_classes, k))
            right = p.argmax(axis=1) == qy
            eces.append(expected_calibration_error(p.max(axis=1), right))
            accs.append(right.mean())
            confs.append(p.max(axis=1).mean())
            assert p.max() <= 1 - (1 - max(c.prior)) / (len(y) + 2) + 1e-9  # never certain on 40 labelled adapters
    assert np.mean(eces) < 0.1 and abs(np.mean(confs) - np.mean(accs)) < 0.08


def _tight_and_diffuse(per_class: int, seed: int, tight: int = 6, diffuse: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Classes of two kinds, as tasks are in a real-seeds zoo: tight ones, whose neighbours all agree and are right,
    and diffuse ones, whose members lie nearer other classes' than their own."""
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(7).normal(size=(tight + diffuse, 24))
    spread = np.r_[np.full(tight, 0.3), np.full(diffuse, 3.0)]
    y = np.repeat(np.arange(tight + diffuse), per_class)
    x = centers[y] + spread[y, None] * rng.normal(size=(len(y), 24))
    return x / np.linalg.norm(x, axis=1, keepdims=True), y


def test_a_unanimous_vote_and_a_split_one_each_say_how_often_they_are_right() -> None:
    """Where the true class is often none of a few neighbours', a fit of the whole distribution mixes in the prior and
    gives a unanimous vote little more than a split one; the answer's own curve in its share keeps each kind of
    class's mean probability near its accuracy (a (T, ε) fit alone: ECE 0.12-0.15, gaps -0.27 and +0.19)."""
    n_classes = 16
    for k in (3, 5):
        eces, gaps = [], []
        for seed in range(4):
            x, y = _tight_and_diffuse(8, seed)
            q, qy = _tight_and_diffuse(30, 100 + seed)
            c = knn_calibration(x @ x.T, y, n_classes, k, class_prior(y, n_classes))
            p = c.apply(knn_vote_shares(q @ x.T, y, n_classes, k))
            right, confidence, tight = p.argmax(axis=1) == qy, p.max(axis=1), qy < 6
            eces.append(expected_calibration_error(confidence, right))
            gaps += [confidence[tight].mean() - right[tight].mean(), confidence[~tight].mean() - right[~tight].mean()]
        assert np.mean(eces) < 0.08 and np.max(np.abs(gaps)) < 0.15, (eces, gaps)


def test_the_answer_stays_the_top_class_and_its_probability_grows_with_its_share() -> None:
    c = Calibration(0.5, 0.2, class_prior(np.arange(6), 6), 40, top=TopLabel(slope=1.5, intercept=-0.3))
    shares = np.random.default_rng(0).dirichlet(np.full(6, 0.4), 500)
    p = c.apply(shares)
    assert np.allclose(p.sum(axis=1), 1.0) and (p > 0).all()
    assert (p.argmax(axis=1) == Calibration(0.5, 0.2, c.prior, 40).apply(shares).argmax(axis=1)).all()
    assert p.max() <= 1 - (1 - max(c.prior)) / (c.n + 2) + 1e-12
    top = p.max(axis=1)
    order = np.argsort(shares.max(axis=1))
    assert (np.diff(top[order]) >= -1e-12).all()  # a larger share of the vote, never a less sure answer
    assert Calibration.from_dict(c.as_dict()).top == c.top
    assert Calibration.from_dict({k: v for k, v in c.as_dict().items() if k != "top"}).top is None  # older checkpoints
