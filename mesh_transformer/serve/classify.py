"""vLLM's `POST /classify` (SGLang's `/v1/classify`): a sequence classifier's or reward model's
scores for each text; and for a classifier of one label (a reward model, a reranker) vLLM's
`POST /score` (pairs of texts) and `POST /rerank` (documents ranked for a query; Jina's and
Cohere's shape, also at `/v1/rerank` and `/v2/rerank`).

Served when the model is a classifier (`ModelConfig.classifier`: a transformers
`*ForSequenceClassification` checkpoint, or a reward model trained here with the "reward"
objective). Each text runs through the model in batched forward passes beside nothing else (a
classifier's engine decodes nothing), and its scores are the score head's logits at its last
token, as transformers reads them (`evaluate.scoring.Scorer.classify`). As vLLM answers:
`probs` are the softmax of the logits (a sigmoid for a classifier of one label: a reward model's
or a binary classifier's; each class's own sigmoid for a multi-label classifier; the raw output of
a regression: what the model config's `problem_type`, transformers', says), `label` names the most
likely class (the checkpoint's `id2label`, else
transformers' LABEL_i), `num_classes` the label count. vLLM's `use_activation: false` (its older
name: `activation`) answers the raw logits in `probs` instead: a reward model's rewards as TRL
trained them.

/score and /rerank read a pair (`text_1` and `text_2`; a `query` and each document) as one text,
the second string after the first, as vLLM reads pairs for a decoder ("LLM as reranker": no
separator; a model that wants a prompt template around them gets it from the client). `text_1`
may be one string for many `text_2`s (a prompt and its candidate responses: best-of-n with a
reward model) or as many. Scores are the sigmoid of the one logit (raw with `use_activation:
false`); /rerank sorts the documents by it, best first, and keeps `top_n` (0: all).

Texts are encoded as /v1/embeddings encodes them (the tokenizer's special tokens unless
`add_special_tokens: false`; `truncate_prompt_tokens: k` keeps the last k tokens) and share
passes the same way (`serve.passes`). A language model's server answers /classify with a 400,
and a classifier's answers its generating routes with a 400 that points here.
"""
from __future__ import annotations

import time
import uuid
from typing import Optional, Sequence as Seq, Union

import numpy as np
from fastapi import Request as HttpRequest
from pydantic import Field

from mesh_transformer.evaluate.scoring import scorer_for
from mesh_transformer.serve import embeddings
from mesh_transformer.serve import openai as oa
from mesh_transformer.serve import passes
from mesh_transformer.serve.passes import Passes

GENERATING = ("/complete", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


class _Scoring(oa._Strict):
    model: Optional[str] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = Field(None, ge=1)  # keep the last k tokens
    use_activation: Optional[bool] = None  # `probabilities` (default true); false: the raw logits
    activation: Optional[bool] = None  # vLLM's older name for it

    @property
    def activated(self) -> bool:
        return next((x for x in (self.use_activation, self.activation) if x is not None), True)


class ClassifyRequest(_Scoring):
    input: Union[str, list[str], list[int], list[list[int]]]
    add_special_tokens: bool = True


class ScoreRequest(_Scoring):
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]


class RerankRequest(_Scoring):
    query: str
    documents: list[str]
    top_n: int = Field(0, ge=0)  # the best n (0: all)


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


def probabilities(logits: np.ndarray, problem_type: Optional[str] = None) -> np.ndarray:
    """[N, L] logits -> vLLM's classify activation for a classifier's `problem_type`: softmax over the
    labels (a sigmoid for one label); a multi-label classifier's sigmoid of each; a regression's as they are."""
    x = logits.astype(np.float64)
    if problem_type == "regression":
        return x
    if x.shape[-1] == 1 or problem_type == "multi_label_classification":
        return 1 / (1 + np.exp(-x))
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


async def create(s: oa.Settings, http: HttpRequest):
    config = served_classifier(s, "/classify")
    body = oa.parse(await http.body(), ClassifyRequest)
    ids = embeddings.texts(s, body.input, body.add_special_tokens, body.truncate_prompt_tokens)
    scores = await classified(s, body, ids, config.problem_type)
    tokens = sum(len(p) for p in ids)
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": body.model or s.model_name,
            "data": [{"index": i, "label": s.labels[int(np.argmax(row))], "probs": [float(v) for v in row],
                      "num_classes": config.num_labels} for i, row in enumerate(scores)],
            "usage": usage(tokens)}


async def score(s: oa.Settings, http: HttpRequest):
    one_label(s, "/score")
    body = oa.parse(await http.body(), ScoreRequest)
    firsts, seconds = _listed(body.text_1, "text_1"), _listed(body.text_2, "text_2")
    if len(firsts) not in (1, len(seconds)):
        raise oa.ApiError(400, f"text_1: one text, or one for each of text_2's {len(seconds)}; got {len(firsts)}",
                          param="text_1")
    firsts = firsts * len(seconds) if len(firsts) == 1 else firsts
    ids = pairs(s, body, firsts, seconds, "text_2")
    scores = await classified(s, body, ids)
    tokens = sum(len(p) for p in ids)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": body.model or s.model_name,
            "data": [{"index": i, "object": "score", "score": float(row[0])} for i, row in enumerate(scores)],
            "usage": usage(tokens)}


async def rerank(s: oa.Settings, http: HttpRequest):
    one_label(s, http.url.path)
    body = oa.parse(await http.body(), RerankRequest)
    if not body.documents:
        raise oa.ApiError(400, "documents: must not be empty", param="documents")
    ids = pairs(s, body, [body.query] * len(body.documents), body.documents, "documents")
    scores = (await classified(s, body, ids))[:, 0]
    best = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or None]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": body.model or s.model_name,
            "usage": {"total_tokens": sum(len(p) for p in ids)},
            "results": [{"index": i, "document": {"text": body.documents[i]}, "relevance_score": float(scores[i])}
                        for i in best]}


def served_classifier(s: oa.Settings, path: str):
    """The served model's config; a 400 unless it is a classifier."""
    config = s.engine.gen.config
    if not config.classifier:
        raise oa.ApiError(400, f"this model is a language model (no score head): {path} needs a sequence "
                               f"classifier or reward model (a ForSequenceClassification checkpoint, num_labels > 0)")
    return config


def one_label(s: oa.Settings, path: str) -> None:
    """A 400 unless the served model is a classifier of one label (what scores a pair)."""
    config = served_classifier(s, path)
    if config.num_labels != 1:
        raise oa.ApiError(400, f"{path} scores pairs with a classifier of one label (a reward model or reranker); "
                               f"this one has {config.num_labels}: use /classify")


async def classified(s: oa.Settings, body: _Scoring, ids: list[list[int]],
                     problem_type: Optional[str] = None) -> np.ndarray:
    """[len(ids), labels]: the texts' probabilities (`probabilities` for a classifier's `problem_type`;
    logits where `use_activation` is false), from the classifier's shared passes under the adapter
    the request's `model` names."""
    logits = await passes.answer(s, s.classifier, ids, await oa.served(s, body.model))
    return probabilities(logits, problem_type) if body.activated else logits


def pairs(s: oa.Settings, body: _Scoring, firsts: list[str], seconds: list[str], field: str) -> list[list[int]]:
    """Each pair's token ids: the second string after the first, encoded as one text (checked as
    /classify checks its inputs; a 400 names `field`'s entry)."""
    # (a 400 names the pair's second text: the one a client sends many of)
    return embeddings.texts(s, [a + b for a, b in zip(firsts, seconds)], truncate=body.truncate_prompt_tokens,
                            name=field)


def _listed(texts: Union[str, list[str]], field: str) -> list[str]:
    texts = [texts] if isinstance(texts, str) else texts
    if not texts:
        raise oa.ApiError(400, f"{field}: must not be empty", param=field)
    return texts


def usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}


def refuse_generating(path: str, num_labels: int):
    """A classifier server's answer on a route that generates: a 400 pointing to /classify."""
    async def refuse(s: oa.Settings, http: HttpRequest):
        raise oa.ApiError(400, f"this model is a classifier (num_labels {num_labels}: a score head, no "
                               f"language-model head): it does not generate, so {path} is not served; "
                               f"POST /classify scores texts with it")
    return refuse
