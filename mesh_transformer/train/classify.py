"""Sequence classification on labelled texts: a classifier (`ModelConfig.num_labels` outputs, a
score head in place of the language-model head) fine-tuned on `{"text", "label"}` records, as
transformers' `*ForSequenceClassification(labels=...)` computes its loss (what its `Trainer` and
`run_glue.py` fine-tune with). The config key `"classify"` turns it on; its `problem_type` takes
transformers' names:

- `"single_label_classification"` (the default for 2 labels or more): the label is a class number,
  the loss the cross-entropy of the softmax over the labels, averaged over the texts; logged with
  the accuracy of the most likely class;
- `"regression"` (the default for 1 label): the label is a number, the loss the squared error of
  the one output, averaged over the texts (transformers' MSELoss).

A text's scores are the score head's outputs at its last token, where transformers pools them (the
last token that is not padding) and where /classify reads them. Its row (`data`, a labelled text)
holds the text's tokens, its mask 1 on the positions the model reads (every token of the text), so
the last of them is the mask's last 1 (`last_positions`); a padding row (mask all 0) counts for
nothing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from mesh_transformer.config import ConfigError, check_object

KEYS = ("problem_type",)
SINGLE_LABEL, REGRESSION = "single_label_classification", "regression"
PROBLEM_TYPES = (SINGLE_LABEL, REGRESSION)


@dataclass(frozen=True)
class ClassifyConfig:
    problem_type: str

    @classmethod
    def from_dict(cls, raw: Any, num_labels: int) -> "ClassifyConfig":
        """The config's "classify" object for a classifier of `num_labels` outputs; ConfigError
        naming the key at fault."""
        check_object(raw, "classify", KEYS, '{"problem_type": "single_label_classification" or "regression"}')
        if num_labels < 1:
            raise ConfigError("config key 'num_labels': 'classify' trains a classifier: set num_labels to the number "
                              "of classes (1 for a regression), got 0")
        problem = raw.get("problem_type", REGRESSION if num_labels == 1 else SINGLE_LABEL)
        if problem == "multi_label_classification":
            raise ConfigError("config key 'classify.problem_type': 'multi_label_classification' is not supported "
                              "(a text has one label here)")
        if problem not in PROBLEM_TYPES:
            raise ConfigError(f"config key 'classify.problem_type' must be one of {', '.join(PROBLEM_TYPES)}, "
                              f"got {json.dumps(problem)}")
        if problem == SINGLE_LABEL and num_labels < 2:
            raise ConfigError("config key 'num_labels': a single-label classification needs 2 classes at least, "
                              "got 1 (one output is a regression: 'problem_type' \"regression\")")
        if problem == REGRESSION and num_labels != 1:
            raise ConfigError(f"config key 'num_labels': a regression has one output, got {num_labels}")
        return cls(problem)

    @property
    def metrics(self) -> tuple[str, ...]:
        return ("loss", "accuracy") if self.problem_type == SINGLE_LABEL else ("loss",)

    sums = metrics  # each a sum over texts: `Trainer.means` divides them by the count

    def text_sums(self, scores, labels, counted, reduce=lambda x: x):
        """Scores [b, L] float32 at each text's last token, labels [b] (class numbers, or targets of
        a regression), counted [b] (0 for padding rows) -> (loss sum, {metric: sum}, texts), `reduce`d."""
        if self.problem_type == SINGLE_LABEL:
            classes = labels.astype(jnp.int32)
            log_probs = jax.nn.log_softmax(scores, axis=-1)
            losses = -jnp.take_along_axis(log_probs, classes[:, None], axis=-1)[:, 0]
            right = (jnp.argmax(scores, axis=-1) == classes).astype(jnp.float32)
            extra = {"accuracy": reduce(jnp.sum(right * counted))}
        else:
            losses, extra = jnp.square(scores[:, 0] - labels), {}
        total = reduce(jnp.sum(losses * counted))
        return total, {"loss": jax.lax.stop_gradient(total), **extra}, reduce(jnp.sum(counted))


def last_positions(mask):
    """Each row's last position the mask marks [b] (a labelled text's last token; T - 1 for a padding row)."""
    t = mask.shape[-1]
    return t - 1 - jnp.argmax(mask[:, ::-1] > 0, axis=-1)


def counted(mask):
    """1 for each row that holds a text [b], 0 for padding."""
    return (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)


def objective(train, num_labels: int):
    """The config's `ClassifyConfig`, or None when it trains no classifier on labelled texts."""
    return None if train.classify is None else ClassifyConfig.from_dict(train.classify, num_labels)
