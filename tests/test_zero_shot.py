"""Zero-shot from the base model (embed/serving/zero_shot.py): an update that reads the directions a description's hidden states
take scores above one that reads those of generic text, with the real all-MiniLM-L6-v2; image bases are refused."""

from __future__ import annotations

import numpy as np
import pytest

from embed.serving import zero_shot
from zoo.domain.similarity import ModuleStack

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DESCRIPTION = "classify documentation about network sockets and HTTP requests"
MODULE = "bert.encoder.layer.2.attention.self.query"  # as a PEFT adapter of the classifier names it


def top_direction(rows: np.ndarray, against: np.ndarray) -> np.ndarray:
    """The unit direction along which `rows` have the most energy beyond `against`'s."""
    gap = rows.T @ rows / len(rows) - against.T @ against / len(against)
    values, vectors = np.linalg.eigh(gap)
    return vectors[:, int(np.argmax(values))].astype(np.float32)


def test_an_update_reading_the_description_scores_above_one_reading_generic_text() -> None:
    desc = zero_shot.base_inputs([DESCRIPTION], [MODULE, "not.a.module"])
    generic = zero_shot.base_inputs(zero_shot.GENERIC, [MODULE])
    assert set(desc) == {MODULE} and desc[MODULE].shape[1] == 384  # the layer's 384 hidden dimensions, a row per token
    reads_desc, reads_generic = top_direction(desc[MODULE], generic[MODULE]), top_direction(generic[MODULE], desc[MODULE])
    v = np.stack([reads_desc, reads_generic])[:, None, :]  # (2 adapters, rank 1, 384)
    u = np.zeros((2, 1, 8), np.float32)
    u[:, 0, 0] = 1
    stack = ModuleStack(2, {MODULE: np.ones(2, np.float32)}, {}, {MODULE: (u, v, np.ones((2, 1), np.float32))})
    s = zero_shot.scores(stack, DESCRIPTION)
    assert s[0] > 0 > s[1], s
    # the scale of dW cancels: the same update ten times larger scores the same
    big = ModuleStack(2, {MODULE: np.ones(2, np.float32)}, {}, {MODULE: (u, v * 10, np.ones((2, 1), np.float32))})
    assert zero_shot.scores(big, DESCRIPTION) == pytest.approx(s, rel=1e-4)


def test_only_bases_the_service_runs() -> None:
    assert zero_shot.not_runnable("sentence-transformers/all-MiniLM-L6-v2") is None
    assert "reads images" in str(zero_shot.not_runnable("zoo/digits-vit"))
    assert "not a base model the service can run" in str(zero_shot.not_runnable("meta-llama/Meta-Llama-3-8B"))
