"""The per-query fusion of the whole update's dW cosine with a channel metric (`fused:search`, zoo.domain.methods).

Neither score wins everywhere: on a zoo where each run draws its own seeds, dW finds the adapters of some tasks at
once (a query whose dW row has one clear outlier) and the metric those of the others. Each query's row of each score
is put on one scale, its own: standardized over a reference set (the labelled adapters, the query itself left out),
and a gallery adapter gets the larger of the two. So a query takes dW's neighbour where it stands further out of
dW's crowd than the metric's stands out of its own, and the metric's otherwise.

The fused value is written in dW's units, `max(dW, μ_dW + σ_dW · (metric − μ_metric) / σ_metric)`, clipped to
[-1, 1]: it orders a row exactly as the larger of the two standardized scores does, and it mixes with the W2T
cosine and re-orders a second stage as a cosine does."""

from __future__ import annotations

import numpy as np

#: a spread below this is no spread: the score says nothing of the row's candidates apart
MIN_SPREAD = 1e-12


def fused(dw: np.ndarray, metric: np.ndarray, dw_reference: np.ndarray, metric_reference: np.ndarray) -> np.ndarray:
    """Rows of the fused score of queries (rows) against candidates (columns), from their dW cosine `dw` and channel
    metric `metric`, each row put on its own scale by that query's scores against the reference set
    (`*_reference`: rows × reference adapters; NaN: not counted, e.g. the query itself). A row without two
    finite reference values of either score is NaN."""
    dw, metric = np.atleast_2d(np.asarray(dw, np.float64)), np.atleast_2d(np.asarray(metric, np.float64))
    refs = [np.atleast_2d(np.asarray(r, np.float64)) for r in (dw_reference, metric_reference)]
    out = np.full(dw.shape, np.nan)
    counted = np.minimum(*(np.isfinite(r).sum(axis=1) for r in refs)) >= 2
    if not counted.any():
        return out
    (d_mean, d_std), (m_mean, m_std) = ((np.nanmean(r[counted], axis=1)[:, None], np.nanstd(r[counted], axis=1)[:, None]) for r in refs)
    lifted = d_mean + d_std * (metric[counted] - m_mean) / np.maximum(m_std, MIN_SPREAD)
    out[counted] = np.clip(np.maximum(dw[counted], lifted), -1.0, 1.0)
    return out


def fused_among(dw: np.ndarray, metric: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """The fused score among adapters (`dw`, `metric`: n × n, rows and columns the same adapters), each row on the
    scale of its scores against the `reference` adapters (positions), itself left out."""
    reference = np.asarray(reference, np.int64)
    own = reference[None, :] == np.arange(len(dw))[:, None]
    return fused(dw, metric, *(np.where(own, np.nan, np.asarray(s, np.float64)[:, reference]) for s in (dw, metric)))
