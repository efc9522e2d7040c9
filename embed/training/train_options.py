"""The options of a W2T training (embed.training.train), and how they tokenize a space's adapters."""

from __future__ import annotations

from dataclasses import dataclass

from embed.data.tokens import MAX_MODULE_TOKENS, TOKEN_WIDTH, TokenSpec
from embed.data.types import SpaceSchema

#: an adapter's tokens at full width (float32 u and v) may take this much before its sides are projected (unless a
#: training names its width): the reference zoos' adapters (all-MiniLM-L6 at r16: 2.7 MB) keep every width, on
#: which their results were measured; one layer of Llama-3-8B at r16 (5.2 MB) is projected, all 32 take 168 MB
FULL_WIDTH_TOKEN_BYTES = 4 << 20
#: rank tokens an adapter brings to a training step (TrainOptions.step_rank_tokens): Llama-3-8B r16, 64 of its 224 modules
STEP_RANK_TOKENS = 1024


@dataclass
class TrainOptions:
    objective: str = "supervised"  # supervised | contrastive | both
    epochs: int = 80
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.05
    #: each member's held-out share (embed.training.train's folds), on which it early-stops and the choices are scored; each adapter is held
    #: out by about members × val_fraction members (0.75 by default: a quarter by none, the rest by one)
    val_fraction: float = 0.15
    patience: int = 15
    seed: int = 0
    dim: int = 32
    temperature: float = 0.1
    augment_sign_flips: bool = False  # harmless by construction: for measuring that
    augment_rank_permutations: bool = False
    augment_truncation: bool = True  # supervised views drop weak components and add small noise, as contrastive views do
    #: views rescale each adapter's update by e^c, c ~ U(-x, x) (its σ; the sketches are normalized and keep theirs): the
    #: update's scale (learning rate × alpha) says nothing of what the adapter does. 0: off
    augment_rescale: float = 0.0
    #: views drop up to this share of each adapter's modules (the share drawn per view, at least one module kept; the
    #: readout of the rest scaled up to match, as _module_view does). On shapes-cnn with 8 labels per task the chosen
    #: search gained 0.017 hit@1 and 0.029 nDCG@10 by it; with 4 it lost 0.003-0.007 (docs/history/results-2026.md,
    #: "Training views that drop modules"). Contrastive views drop modules too. 0: off
    augment_module_dropout: float = 0.5
    #: supervised steps replace this share of their labelled adapters by a mix λ dW + (1 − λ) dW′ with another training
    #: adapter of the same task (λ ~ U(0.25, 0.75)), canonicalized again and cut to the padded rank: a new adapter of
    #: that task, where labels are few. Its measured metrics are unknown. 0: off
    augment_mixup: float = 0.0
    #: `both` only: an epoch's contrastive rows are its labelled training adapters and a fresh draw of at most this many
    #: unlabelled ones per labelled one (validation: one fixed draw of the same share), so that the training's cost
    #: follows the labels, not the zoo. None: every adapter, every epoch
    unlabelled_per_labelled: float | None = None
    device: str | None = None
    metrics: tuple[str, ...] = ("test_accuracy",)
    #: attributes that get a classification head; None: every categorical attribute. Heads for the
    #: generating hyperparameters made the task embedding much worse on the reference zoo (docs/history/results-2026.md).
    attributes: tuple[str, ...] | None = ("task",)
    dropout: float = 0.2
    #: models in the ensemble, trained from seeds seed, seed + 1, ... Ten with val_fraction 0.2 hold each adapter out
    #: of two, whose mean the choices score: better with scarce labels, worse with full ones, at twice the training
    #: (docs/history/results-2026.md, "Each adapter held out by two members")
    members: int = 5
    #: u and v wider than this are projected to it (embed.data.tokens.TokenSpec, seeded by `seed`); 0: full width; None:
    #: full width while an adapter's tokens at full width take at most FULL_WIDTH_TOKEN_BYTES, else TOKEN_WIDTH
    token_width: int | None = None
    #: module tokens per adapter, at most (modules grouped by type and layer beyond it); 0: one per module
    max_module_tokens: int = MAX_MODULE_TOKENS
    #: rank tokens an adapter brings to a training step, at most: beyond it a step sees a random subset of the modules
    #: (embed.training.views.module_view; validation and embedding see them all); 0: every module
    step_rank_tokens: int = STEP_RANK_TOKENS
    #: second-order input and output Gram sketches per module beside the first-order one, into the module tokens and
    #: the readout (embed.w2t.model, W2TConfig.gram_sketches): a rotation of dW's output side leaves the input one unmoved
    gram_sketches: bool = False
    #: self-supervised epochs before the supervised ones, on every adapter, labelled or not (at most pretrain_adapters):
    #: the W2T cosine is taught to rank the adapters of a batch as an exact score does (embed.training.distill); the members
    #: then start from these weights. 0: none
    pretrain_epochs: int = 0
    #: the exact score pretraining distills: "dw", "module", "input_gram", or "auto": of those the one that retrieves
    #: the labelled adapters' tasks best (leave-one-out MRR + nDCG@10 among them; training-free, so no fold is needed)
    pretrain_score: str = "auto"
    #: pretraining views carry what a run's own seeds and settings change but its task does not: weak components cut,
    #: modules dropped (augment_module_dropout), dW rescaled by e^c, c ~ U(-1, 1), and, where the distilled score
    #: ignores the output side (the input Gram), the output side turned by a random orthogonal Q (a re-seeded head)
    pretrain_augment: bool = True
    #: the most adapters pretraining uses, drawn with the seed (its target kernel is their n × n exact scores)
    pretrain_adapters: int = 4096
    #: torch threads while training (None: torch's default). One: on a shared 2-core machine two threads wait on each
    #: other at every small op (a Llama-3-8B step was 2.6 times slower in wall time, docs/history/results-2026.md)
    threads: int | None = 1
    #: the few-label channel metrics (embed/selection/fitted.py) are candidates of the out-of-fold choices, where the space has
    #: their atoms; off: the training-free exact scores and W2T only (what `zoo eval` compares the default with)
    channel_metric: bool = True


def token_spec(options: TrainOptions, schema: SpaceSchema, rank: int) -> TokenSpec:
    """How the adapters of a training with these options are tokenized, in a space of this schema and padded rank."""
    width = options.token_width
    if width is None:
        full_bytes = 4 * rank * sum(o + i for _, o, i in schema.modules)  # float32 u and v of every component
        width = TOKEN_WIDTH if full_bytes > FULL_WIDTH_TOKEN_BYTES else 0
    return TokenSpec(width, options.seed, options.max_module_tokens)
