"""vLLM's `POST /classify` (SGLang's `/v1/classify`): a sequence classifier's or reward model's
scores for each text.

Served when the model is a classifier (`ModelConfig.classifier`: a transformers
`*ForSequenceClassification` checkpoint, or a reward model trained here with the "reward"
objective). Each text runs through the model in batched forward passes beside nothing else (a
classifier's engine decodes nothing), and its scores are the score head's logits at its last
token, as transformers reads them (`evaluate.scoring.Scorer.classify`). As vLLM answers:
`probs` are the softmax of the logits (a sigmoid for a classifier of one label: a reward model's
or a binary classifier's), `label` names the most likely class (the checkpoint's `id2label`, else
transformers' LABEL_i), `num_classes` the label count. vLLM's `activation: false` answers the raw
logits in `probs` instead: a reward model's rewards as TRL trained them.

Texts are encoded as /v1/embeddings encodes them (the tokenizer's special tokens unless
`add_special_tokens: false`; `truncate_prompt_tokens: k` keeps the last k tokens) and share
passes the same way (`serve.passes`). A language model's server answers /classify with a 400,
and a classifier's answers its generating routes with a 400 that points here.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Optional, Sequence as Seq, Union

import numpy as np
from fastapi import Request as HttpRequest
from pydantic import Field

from mesh_transformer.evaluate.scoring import scorer_for
from mesh_transformer.serve import embeddings
from mesh_transformer.serve import openai as oa
from mesh_transformer.serve.passes import Passes

GENERATING = ("/complete", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


class ClassifyRequest(oa._Strict):
    model: Optional[str] = None
    input: Union[str, list[str], list[int], list[list[int]]]
    user: Optional[str] = None
    add_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = Field(None, ge=1)  # keep the last k tokens
    activation: bool = True  # probs: softmax (sigmoid for one label); false: the raw logits


def classifier(gen) -> Passes:
    """/classify's passes over a classifier Generator's weights (its `scorer_for`)."""
    def classify(texts, adapter):
        return scorer_for(gen).classify(texts, adapter=adapter)
    return Passes(classify)


def label_names(count: int, names: Optional[Seq[str]] = None) -> tuple[str, ...]:
    """The classes' names: `names` (a checkpoint's id2label, in order), else transformers' LABEL_i."""
    if names is None:
        return tuple(f"LABEL_{i}" for i in range(count))
    if len(names) != count:
        raise ValueError(f"labels: {len(names)} names for a classifier of {count} labels")
    return tuple(names)


def probabilities(logits: np.ndarray) -> np.ndarray:
    """[N, L] logits -> vLLM's classify activation: softmax over the labels, a sigmoid for one label."""
    x = logits.astype(np.float64)
    if x.shape[-1] == 1:
        return 1 / (1 + np.exp(-x))
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


async def create(s: oa.Settings, http: HttpRequest):
    config = s.engine.gen.config
    if not config.classifier:
        raise oa.ApiError(400, "this model is a language model (no score head): /classify needs a sequence "
                               "classifier or reward model (a ForSequenceClassification checkpoint, num_labels > 0)")
    body = oa.parse(await http.body(), ClassifyRequest)
    adapter = await oa.served(s, body.model)
    ids = embeddings.texts(s, body)
    if s.engine.draining:
        raise oa.busy(oa.Draining())
    try:
        logits = await asyncio.wait_for(s.classifier.run(ids, adapter), s.timeout)
    except asyncio.TimeoutError:
        raise oa.ApiError(504, f"request timed out after {s.timeout:g} s", "timeout") from None
    scores = probabilities(logits) if body.activation else logits
    tokens = sum(len(p) for p in ids)
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": body.model or s.model_name,
            "data": [{"index": i, "label": s.labels[int(np.argmax(row))], "probs": [float(v) for v in row],
                      "num_classes": config.num_labels} for i, row in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}


def refuse_generating(path: str, num_labels: int):
    """A classifier server's answer on a route that generates: a 400 pointing to /classify."""
    async def refuse(s: oa.Settings, http: HttpRequest):
        raise oa.ApiError(400, f"this model is a classifier (num_labels {num_labels}: a score head, no "
                               f"language-model head): it does not generate, so {path} is not served; "
                               f"POST /classify scores texts with it")
    return refuse
