"""Sequence classification on labelled texts: a classifier (`ModelConfig.num_labels` outputs, a
score head in place of the language-model head) fine-tuned on `{"text", "label"}` records, as
transformers' `*ForSequenceClassification(labels=...)` computes its loss (what its `Trainer` and
`run_glue.py` fine-tune with). The config key `"classify"` turns it on; its `problem_type` takes
transformers' names:

- `"single_label_classification"` (the default for 2 labels or more): the label is a class number,
  the loss the cross-entropy of the softmax over the labels, averaged over the texts; logged with
  the accuracy of the most likely class;
- `"multi_label_classification"`: a text has any number of the classes (its labels a 0/1 vector,
  `num_labels` long), the loss the binary cross-entropy of each output's sigmoid, averaged over the
  texts and labels (transformers' BCEWithLogitsLoss); logged with the accuracy of the labels' yes/no
  decisions (an output above 0: yes) and the share of texts with every decision right (`exact_match`);
- `"regression"` (the default for 1 label): the label is a number, the loss the squared error of
  the one output, averaged over the texts (transformers' MSELoss).

The model config's `problem_type` (transformers' key, what its export and /classify read) says the
same; set in one, the other takes it.

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
SINGLE_LABEL, MULTI_LABEL, REGRESSION = "single_label_classification", "multi_label_classification", "regression"
PROBLEM_TYPES = (SINGLE_LABEL, MULTI_LABEL, REGRESSION)


def check_problem_type(problem: Any, num_labels: int, key: str, trains: bool = True) -> None:
    """ConfigError naming `key` unless `problem` is a problem type a classifier of `num_labels` outputs
    has (a regression of several outputs too, as transformers has one, unless it `trains` here)."""
    if problem not in PROBLEM_TYPES:
        raise ConfigError(f"config key '{key}' must be one of {', '.join(PROBLEM_TYPES)}, got {json.dumps(problem)}")
    if problem == SINGLE_LABEL and num_labels < 2:
        raise ConfigError(f"config key 'num_labels': a single-label classification needs 2 classes at least, "
                          f"got {num_labels} (one output is a regression: '{key}' \"regression\")")
    if problem == REGRESSION and num_labels != 1 and trains:
        raise ConfigError(f"config key 'num_labels': a regression trains one output here, got {num_labels}")


@dataclass(frozen=True)
class ClassifyConfig:
    problem_type: str
    num_labels: int

    @classmethod
    def from_dict(cls, raw: Any, model) -> "ClassifyConfig":
        """The config's "classify" object for the classifier `model` (its ModelConfig); ConfigError
        naming the key at fault. Its problem_type defaults to the model's."""
        check_object(raw, "classify", KEYS, '{"problem_type": "single_label_classification", '
                                            '"multi_label_classification" or "regression"}')
        if model.num_labels < 1:
            raise ConfigError("config key 'num_labels': 'classify' trains a classifier: set num_labels to the number "
                              "of classes (1 for a regression), got 0")
        problem = raw.get("problem_type", model.classifier_problem)
        check_problem_type(problem, model.num_labels, "classify.problem_type")
        if model.problem_type not in (None, problem):
            raise ConfigError(f"config key 'classify.problem_type': {json.dumps(problem)}, but the model's "
                              f"problem_type is {json.dumps(model.problem_type)}; set one, or both alike")
        return cls(problem, model.num_labels)

    @property
    def metrics(self) -> tuple[str, ...]:
        return {SINGLE_LABEL: ("loss", "accuracy"), MULTI_LABEL: ("loss", "accuracy", "exact_match"),
                REGRESSION: ("loss",)}[self.problem_type]

    @property
    def label_width(self) -> int:
        """Numbers a text's label is: 1 (a class number, or a regression's target), or a multi-label
        text's one per class."""
        return self.num_labels if self.problem_type == MULTI_LABEL else 1

    sums = metrics  # each a sum over texts: `Trainer.means` divides them by the count

    def text_sums(self, scores, labels, counted, reduce=lambda x: x):
        """Scores [b, L] float32 at each text's last token, labels [b, label_width] (class numbers,
        a regression's targets, or multi-label texts' 0/1 per class), counted [b] (0 for padding
        rows) -> (loss sum, {metric: sum}, texts), `reduce`d."""
        if self.problem_type == SINGLE_LABEL:
            classes = labels[:, 0].astype(jnp.int32)
            log_probs = jax.nn.log_softmax(scores, axis=-1)
            losses = -jnp.take_along_axis(log_probs, classes[:, None], axis=-1)[:, 0]
            right = (jnp.argmax(scores, axis=-1) == classes).astype(jnp.float32)
            extra = {"accuracy": reduce(jnp.sum(right * counted))}
        elif self.problem_type == MULTI_LABEL:  # -log sigmoid(s) for a yes, -log sigmoid(-s) for a no
            losses = jnp.mean(labels * -jax.nn.log_sigmoid(scores) + (1 - labels) * -jax.nn.log_sigmoid(-scores), -1)
            right = ((scores > 0) == (labels > 0.5)).astype(jnp.float32)
            extra = {"accuracy": reduce(jnp.sum(jnp.mean(right, -1) * counted)),
                     "exact_match": reduce(jnp.sum(jnp.min(right, -1) * counted))}
        else:
            losses, extra = jnp.square(scores[:, 0] - labels[:, 0]), {}
        total = reduce(jnp.sum(losses * counted))
        return total, {"loss": jax.lax.stop_gradient(total), **extra}, reduce(jnp.sum(counted))


def last_positions(mask):
    """Each row's last position the mask marks [b] (a labelled text's last token; T - 1 for a padding row)."""
    t = mask.shape[-1]
    return t - 1 - jnp.argmax(mask[:, ::-1] > 0, axis=-1)


def counted(mask):
    """1 for each row that holds a text [b], 0 for padding."""
    return (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)


def objective(config):
    """The `Config`'s `ClassifyConfig`, or None when it trains no classifier on labelled texts."""
    return None if config.train.classify is None else ClassifyConfig.from_dict(config.train.classify, config.model)
