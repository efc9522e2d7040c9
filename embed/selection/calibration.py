"""Class probabilities that mean what they say, fit out of fold.

A predictor's raw shares (a kNN's similarity-weighted votes, the heads' softmax, a readout's) are
often too sure: a 3-NN whose neighbours agree says 100 %, and is wrong as often as 3-NNs are.
`fit` takes the chosen predictor's out-of-fold shares and the true classes and finds a temperature
T and a share ε of the class prior such that

    calibrated = (1 − ε) · normalize(shares ** (1 / T)) + ε · prior

has the lowest log loss on them (a grid: two numbers are what a few dozen held-out adapters support).
ε never goes below 1 / (n + 2) for n held-out adapters, so nothing is ever called certain on the
strength of n examples. A k-NN vote among the labelled adapters is calibrated on their leave-one-out
votes instead (`knn_calibration`), and its answer gets its own probability, a logistic curve in its share
of the vote set to their accuracy (`TopLabel`): the (T, ε) family is fit to the whole distribution, and
where the true class is often none of a few neighbours' that fit mixes in much of the prior and sharpens
to make up for it, so a unanimous vote and a split one came out nearly alike.
Pure numpy and scipy: no database, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import minimize

from embed.selection.metrics import knn_vote_shares

TEMPERATURES = tuple(float(t) for t in np.geomspace(1 / 16, 4.0, 19))
MIXES = tuple(float(m) for m in np.linspace(0.0, 0.9, 91))
#: below this many held-out adapters nothing is fit: half the prior is mixed in
MIN_FIT = 5
#: a prediction is "sure" when its calibrated probability is at least this (and at least the level its held-out
#: predictions earned: `earned_sure`) and most labelled neighbours agree
SURE = 0.5
#: how far below its mean probability a confidence bin's held-out accuracy may lie where predictions are called sure
SURE_SLACK = 0.05
#: "sure" from no probability: what a predictor whose held-out predictions earned no level gets
NEVER_SURE = 1.01
#: equal-width confidence bins of the expected calibration error
ECE_BINS = 10
#: the top answer's share of the vote is read on the logit scale clipped to these shares (a unanimous vote is 1)
TOP_SHARE_CLIP = 1e-4
#: the ridge pulling a TopLabel's slope toward 1 (the raw share's own logit): identifies it where every vote has the
#: same share (a 1-NN's are all 1) and keeps a few dozen votes from fitting a cliff
TOP_SLOPE_RIDGE = 1e-3


@dataclass(frozen=True)
class TopLabel:
    """The probability of the answer (the calibrated distribution's top class) as a logistic curve in its raw share s
    of the vote: σ(intercept + slope · logit(s)). Fit on held-out votes by the answer's log loss, right or wrong
    (`fit_top_label`), its intercept then set to a level (`with_top_level`)."""

    slope: float
    intercept: float

    def probability(self, share: np.ndarray) -> np.ndarray:
        s = np.clip(share, TOP_SHARE_CLIP, 1.0 - TOP_SHARE_CLIP)
        return 1.0 / (1.0 + np.exp(-(self.intercept + self.slope * np.log(s / (1.0 - s)))))


@dataclass(frozen=True)
class Calibration:
    """How to turn one predictor's raw class shares into calibrated probabilities."""

    temperature: float = 1.0
    mix: float = 0.0
    prior: tuple[float, ...] = ()
    n: int = 0  # held-out adapters it was fit on
    #: the least calibrated probability called sure: where every confidence bin from it up kept its promise on the
    #: held-out predictions (earned_sure); checkpoints from before it have SURE
    sure_from: float = SURE
    #: in checkpoints from before TopLabel, a k-NN vote's prior share for a labelled adapter voted on by the others (its
    #: own label left out, as it is served for a stored adapter), where `mix` looked one label further; None: `mix` for
    #: every query (a TopLabel's curve reads the vote's share, which is smaller with one label fewer)
    own_mix: float | None = None
    #: the answer's probability by its share of the vote (a kNN's, knn_calibration); None: the (T, ε) distribution's
    top: TopLabel | None = None

    def apply(self, shares: np.ndarray) -> np.ndarray:
        """Calibrated probabilities of rows of raw shares (n × classes, or one row): the (T, ε) distribution, and
        with `top` the answer's probability from its share, the other classes sharing the rest in proportion. The
        answer stays the top class, and is never given more than a mix of 1 / (n + 2) of the prior would allow."""
        p = np.atleast_2d(np.asarray(shares, np.float64))
        sharpened = _sharpen(p, self.temperature)
        prior = np.asarray(self.prior, np.float64) if self.prior else np.full(p.shape[1], 1.0 / p.shape[1])
        out = (1.0 - self.mix) * sharpened + self.mix * prior
        if self.top is not None and out.shape[1] > 1:
            out = self._top_label(self.top, p, out, prior)
        return out if np.ndim(shares) == 2 else out[0]

    def _top_label(self, curve: TopLabel, raw: np.ndarray, q: np.ndarray, prior: np.ndarray) -> np.ndarray:
        """`q` with its top class's probability from the raw share (TopLabel), at most the cap; the rest goes to the
        other classes in proportion to `q`, as little moved toward the prior as keeps each of them below the answer
        (a split vote among many classes can be worth less than its runner-up's share of `q`)."""
        rows = np.arange(len(q))
        top = q.argmax(axis=1)
        flat = np.broadcast_to(prior, q.shape).copy()
        flat[rows, top] = 0.0
        flat /= flat.sum(axis=1, keepdims=True)
        least = flat.max(axis=1) / (1.0 + flat.max(axis=1)) * (1.0 + 1e-9)  # the rest spread as the prior is, just below
        cap = 1.0 - (1.0 - prior.max()) / (self.n + 2)
        answer = np.clip(curve.probability(raw[rows, top]), least, max(cap, 0.0))
        others = q.copy()
        others[rows, top] = 0.0
        others /= np.maximum(others.sum(axis=1, keepdims=True), 1e-300)
        limit = (answer / (1.0 - answer) * (1.0 - 1e-9))[:, None]  # each other class's share of the rest, at most
        # the least weight w of the prior with (1 - w)·others + w·flat ≤ limit in every class: the largest of each
        # class's own, where it is over
        over = others - limit
        with np.errstate(divide="ignore", invalid="ignore"):
            needed = np.where(over > 0, over / (others - flat), 0.0)
        weight = np.clip(needed.max(axis=1), 0.0, 1.0)[:, None]
        out = ((1.0 - weight) * others + weight * flat) * (1.0 - answer)[:, None]
        out[rows, top] = answer
        return out

    def for_labelled(self) -> Calibration:
        """The calibration of a vote on one of the labelled adapters, its own label left out (own_mix)."""
        return self if self.own_mix is None else replace(self, mix=self.own_mix, own_mix=None)

    def as_dict(self) -> dict[str, object]:
        prior = [round(x, 6) for x in self.prior]
        own = None if self.own_mix is None else round(self.own_mix, 4)
        top = None if self.top is None else [self.top.slope, self.top.intercept]
        return {
            "temperature": round(self.temperature, 4),
            "mix": round(self.mix, 4),
            "prior": prior,
            "n": self.n,
            "sure_from": self.sure_from,
            "own_mix": own,
            "top": top,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        prior = tuple(float(x) for x in d["prior"])
        own = d.get("own_mix")
        sure_from = float(d.get("sure_from", SURE))
        top = d.get("top")  # none in checkpoints from before TopLabel
        return cls(
            float(d["temperature"]),
            float(d["mix"]),
            prior,
            int(d["n"]),
            sure_from,
            None if own is None else float(own),
            None if top is None else TopLabel(float(top[0]), float(top[1])),
        )


def _sharpen(p: np.ndarray, temperature: float) -> np.ndarray:
    """Rows of p raised to 1/T and renormalized (zeros stay zero; an all-zero row becomes uniform)."""
    q = np.power(np.clip(p, 0.0, None), 1.0 / temperature)
    total = q.sum(axis=1, keepdims=True)
    return np.where(total > 0, q / np.where(total > 0, total, 1.0), 1.0 / p.shape[1])


def class_prior(truth: np.ndarray, n_classes: int) -> tuple[float, ...]:
    """Class frequencies of the labelled adapters, add-one smoothed (no class has probability 0)."""
    counts = np.bincount(np.asarray(truth, np.int64), minlength=n_classes).astype(np.float64) + 1.0
    return tuple((counts / counts.sum()).tolist())


def fit(shares: np.ndarray, truth: np.ndarray, prior: tuple[float, ...]) -> Calibration:
    """The temperature and prior share with the lowest log loss of out-of-fold `shares` (n × classes) against
    the true class indices `truth`; ε ≥ 1 / (n + 2). Fewer than MIN_FIT items: T = 1, ε = 0.5."""
    n = len(truth)
    if n < MIN_FIT:
        return Calibration(1.0, 0.5, prior, n)
    shares = np.asarray(shares, np.float64)
    truth = np.asarray(truth, np.int64)
    floor = 1.0 / (n + 2)
    mixes = np.array([floor, *(m for m in MIXES if m > floor)])
    prior_true = np.asarray(prior)[truth]
    best = (np.inf, 1.0, floor)
    for t in TEMPERATURES:
        p_true = _sharpen(shares, t)[np.arange(n), truth]
        # log loss of every mix at once: rows are mixes, columns items
        loss = -np.log((1.0 - mixes[:, None]) * p_true[None, :] + mixes[:, None] * prior_true[None, :]).mean(axis=1)
        i = int(np.argmin(loss))
        if loss[i] < best[0] - 1e-12:
            best = (float(loss[i]), t, float(mixes[i]))
    return Calibration(best[1], best[2], prior, n)


def knn_calibration(
    sim: np.ndarray, classes: np.ndarray, n_classes: int, k: int, prior: tuple[float, ...], rows: np.ndarray | None = None
) -> Calibration:
    """The calibration of a k-NN vote among labelled adapters, from their leave-one-out votes (`sim`: n × n among
    them, `classes` their class indices): each is voted on by all the others, n − 1 labelled where what is served
    has n, closer than the held-out folds' share. The (T, ε) distribution is fit to them, and the answer's probability
    is a logistic curve in its share of the vote (TopLabel), fit to whether each vote's answer was right and set so
    that the mean matches their accuracy. A served vote, with one label more of the query's class among its
    neighbours, gives its answer a larger share, and the curve a larger probability. `rows`: the adapters that vote
    (default: all), where only their rows of `sim` are honest about them: a similarity the labels shaped (a channel
    metric, a W2T mix) is honest about an adapter in the row of the fold that held it out, its other rows may be
    anything."""
    voters = np.arange(len(classes)) if rows is None else np.asarray(rows, np.int64)
    n = len(voters)
    if n < MIN_FIT:
        return Calibration(1.0, 0.5, prior, n)
    truth = classes[voters]
    shares = leave_one_out_shares(sim, classes, n_classes, k, rows=voters)
    accuracy = min(float((shares.argmax(axis=1) == truth).mean()), 1.0 - 1.0 / (n + 2))
    fitted = fit(shares, truth, prior)
    return with_top_level(fitted, fit_top_label(fitted.apply(shares), shares, truth), shares, accuracy)


def fit_top_label(calibrated: np.ndarray, shares: np.ndarray, truth: np.ndarray) -> TopLabel:
    """The TopLabel with the lowest log loss of the answers (the top classes of `calibrated`, right or not against
    `truth`) by their raw `shares`, its slope held near 1 (TOP_SLOPE_RIDGE) and never below 0 (a larger share is
    never less sure: where the fit says so, the share says nothing and every answer gets one probability)."""
    answer = calibrated.argmax(axis=1)
    right = (answer == np.asarray(truth)).astype(np.float64)
    s = np.clip(shares[np.arange(len(answer)), answer], TOP_SHARE_CLIP, 1.0 - TOP_SHARE_CLIP)
    x = np.log(s / (1.0 - s))

    def loss(w: np.ndarray) -> float:
        z = w[0] + w[1] * x
        return float(np.mean(right * np.logaddexp(0.0, -z) + (1.0 - right) * np.logaddexp(0.0, z)) + TOP_SLOPE_RIDGE * (w[1] - 1.0) ** 2)

    intercept, slope = minimize(loss, np.array([0.0, 1.0]), method="BFGS").x
    return TopLabel(max(float(slope), 0.0), float(intercept))


def with_top_level(c: Calibration, curve: TopLabel, shares: np.ndarray, target: float) -> Calibration:
    """`c` with `curve`, its intercept set so that the mean top probability of `shares` is `target` (bisection)."""

    def mean_top(intercept: float) -> float:
        return float(replace(c, top=replace(curve, intercept=intercept)).apply(shares).max(axis=1).mean())

    low, high = -30.0, 30.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if mean_top(mid) < target else (low, mid)
    return replace(c, top=replace(curve, intercept=(low + high) / 2))


def leave_one_out_shares(sim: np.ndarray, classes: np.ndarray, n_classes: int, k: int, rows: np.ndarray | None = None) -> np.ndarray:
    """The k-NN vote shares of each of `rows` (default: every labelled adapter) by all the others (`sim` n × n)."""
    voters = np.arange(len(classes)) if rows is None else np.asarray(rows, np.int64)
    others = np.array(sim, np.float64)[voters]
    others[np.arange(len(voters)), voters] = -np.inf
    return knn_vote_shares(others, classes, n_classes, k)


def expected_calibration_error(confidence: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS) -> float:
    """Top-label ECE of answers given with probability `confidence` and right where `correct`: over equal-width
    bins of the confidence, the count-weighted mean gap between the bin's accuracy and its mean confidence."""
    conf, right = np.asarray(confidence, np.float64), np.asarray(correct, np.float64)
    if not len(conf):
        return float("nan")
    which = np.minimum((conf * bins).astype(np.int64), bins - 1)
    gap = 0.0
    for b in range(bins):
        in_bin = which == b
        if in_bin.any():
            gap += in_bin.sum() * abs(right[in_bin].mean() - conf[in_bin].mean())
    return float(gap / len(conf))


def is_sure(probability: float, agreeing: int, neighbours: int, sure_from: float = SURE) -> bool:
    """A prediction worth stating: calibrated probability ≥ SURE and ≥ the level its predictor earned on held-out
    adapters (`sure_from`: Calibration.sure_from), and more than half its labelled neighbours agree (no neighbours:
    the probability alone)."""
    return probability >= max(SURE, sure_from) and (neighbours == 0 or 2 * agreeing > neighbours)


def earned_sure(confidence: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS, slack: float = SURE_SLACK) -> float:
    """The least probability, SURE or an equal-width bin's lower edge above it, from which every confidence bin holding
    held-out predictions was right at least as often as its mean probability less `slack`: what "sure" can promise.
    NEVER_SURE where no level earns it, or where fewer than MIN_FIT predictions were held out."""
    conf, right = np.asarray(confidence, np.float64), np.asarray(correct, np.float64)
    if len(conf) < MIN_FIT:
        return NEVER_SURE
    which = np.minimum((conf * bins).astype(np.int64), bins - 1)
    shown = [b for b in range(bins) if (b + 1) / bins > SURE and (which == b).any()]  # bins a sure prediction can fall in
    broken = [b for b in shown if right[which == b].mean() < conf[which == b].mean() - slack]
    lowest = max(SURE, (max(broken) + 1) / bins) if broken else SURE
    return lowest if lowest < 1.0 else NEVER_SURE


def with_earned_sure(c: Calibration, shares: np.ndarray, truth: np.ndarray) -> Calibration:
    """`c` with the level its held-out predictions earn (earned_sure of `shares`, raw class shares of held-out
    adapters whose true class indices are `truth`, once calibrated as held-out predictions are: c.for_labelled())."""
    if not len(truth):
        return replace(c, sure_from=NEVER_SURE)
    p = np.atleast_2d(c.for_labelled().apply(np.asarray(shares, np.float64)))
    return replace(c, sure_from=earned_sure(p.max(axis=1), p.argmax(axis=1) == np.asarray(truth)))
