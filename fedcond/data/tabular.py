"""The paper's appendix A tasks: synthetic tabular data whose clusters differ in their concept.

The paper does not give its generator; this one is calibrated to land its reference columns on
Table VI's scale (docs/tabular.md shows the calibration). Every sample is drawn as

    x ~ N(0, I_10),    eps ~ N(0, 0.1^2),    z = x^T w_k + eps,
    w_k ~ U[-10, 10]^10 for concept k = 0..7 (drawn once, from a fixed seed),
    synthetic-linear:   y = z               (regression: the metric is RMSE)
    synthetic-logistic: y = 1[z > 0]        (classification: accuracy)

- the noise's 0.1 is Table VI's Cluster RMSE (a model per concept can do no better than the noise);
- U[-10, 10] puts one model for all concepts at RMSE sqrt((K-1)/K x 10 x 100/3) = 14.9 for K = 3
  (Table VI's Global: 14.901), and its pooled logistic accuracy at 0.71-0.74 (0.700);
- 100 training samples per client, as Table VI's Client column implies: least squares on n samples
  and 11 parameters has test RMSE 0.1 x sqrt(1 + 11 / (n - 12)) = 0.106 at n = 100 (Table VI: 0.106).

The data is fixed like MNIST's (the run's seed splits it over clients and seeds the models, it never
changes a concept's weights), so that two runs of one task see the same concepts. Each concept
holds 100 clients' worth of samples, 100 training and 100 test each: ``clients-per-cluster=100``
is the paper's federation, fewer clients each hold more.
"""

from __future__ import annotations

import numpy as np

FEATURES = 10
CONCEPTS = 8  # Table VII's clusters, the most the tasks have
CLIENTS_PER_CONCEPT = 100
SAMPLES_PER_CLIENT = 100  # training samples, and as many test samples
WEIGHT_RANGE = 10.0
NOISE_STD = 0.1
#: The generator's own seed: a fixed benchmark, never the run's seed.
GENERATOR_SEED = 20_210_601
TASKS = ("linear", "logistic")


def concept_weights() -> np.ndarray:
    """The concepts' weight vectors w_k, shaped (CONCEPTS, FEATURES)."""
    return np.random.default_rng([GENERATOR_SEED, 0]).uniform(-WEIGHT_RANGE, WEIGHT_RANGE, (CONCEPTS, FEATURES))


def generate(task: str) -> dict[str, np.ndarray]:
    """Train and test features, labels and concepts of ``task``, concept by concept.

    ``train_x`` (CONCEPTS x CLIENTS_PER_CONCEPT x SAMPLES_PER_CLIENT, FEATURES) float32, ``train_y``
    the targets (linear: float32 z; logistic: int64 labels), ``train_concepts`` the concept of each
    sample; the same for ``test_``. Both tasks draw the same x and noise: logistic is linear's latent
    thresholded.
    """
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}")
    weights = concept_weights()
    per_concept = CLIENTS_PER_CONCEPT * SAMPLES_PER_CLIENT
    arrays: dict[str, np.ndarray] = {}
    for split_index, split in enumerate(("train", "test")):
        features, labels = [], []
        for concept, weight in enumerate(weights):
            rng = np.random.default_rng([GENERATOR_SEED, 1, split_index, concept])
            x = rng.standard_normal((per_concept, FEATURES))
            latent = x @ weight + NOISE_STD * rng.standard_normal(per_concept)
            features.append(x.astype(np.float32))
            labels.append(latent.astype(np.float32) if task == "linear" else (latent > 0).astype(np.int64))
        arrays[f"{split}_x"] = np.concatenate(features)
        arrays[f"{split}_y"] = np.concatenate(labels)
        arrays[f"{split}_concepts"] = np.repeat(np.arange(CONCEPTS), per_concept)
    return arrays
