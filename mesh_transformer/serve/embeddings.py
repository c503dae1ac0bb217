"""OpenAI's `POST /v1/embeddings`: a vector for each text, from the served language model.

The vector is the model's final hidden states (HF's `last_hidden_state`) pooled as the server was
started (`--embedding-pooling`: the last token's by default, as E5-Mistral, GTE-Qwen2 and vLLM read
decoder embedding models) and L2-normalised (unless `--no-embedding-normalize`). Texts are encoded
as /v1/completions encodes a prompt (the tokenizer's special tokens added unless
`add_special_tokens: false`) and embedded in batched forward passes beside the generation engine
(`evaluate.scoring.Scorer.embed`, the pass `echo` scores with). Requests share passes (`Passes`):
the texts of every request that arrives while a pass runs go into the next one, as vLLM batches
its pooling requests, so many clients sending a text each are served a batch at a time. `model`
may name a served LoRA adapter: its texts run with it (in passes of their own).

`encoding_format: "base64"` sends each vector as its float32 bytes (little-endian) in base64, which
the official client asks for by default and decodes. `dimensions` must be the model's width (this
server does not shorten vectors: only models trained for it, Matryoshka-style, keep their meaning
when cut). vLLM's `truncate_prompt_tokens: k` keeps each text's last k tokens.
"""
from __future__ import annotations

import base64
import time
import uuid
from typing import Literal, Optional, Union

import numpy as np
from fastapi import Request as HttpRequest
from pydantic import Field

from mesh_transformer.evaluate.scoring import scorer_for
from mesh_transformer.serve import openai as oa
from mesh_transformer.serve import passes
from mesh_transformer.serve.passes import Passes

MAX_INPUTS = 2048  # texts per request (OpenAI's limit)


class EmbeddingRequest(oa._Strict):
    model: Optional[str] = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    add_special_tokens: bool = True  # extension (vLLM's)
    truncate_prompt_tokens: Optional[int] = Field(None, ge=1)  # extension (vLLM's): keep the last k tokens


async def create(s: oa.Settings, http: HttpRequest):
    body = oa.parse(await http.body(), EmbeddingRequest)
    adapter = await oa.served(s, body.model)
    ids = texts(s, body.input, body.add_special_tokens, body.truncate_prompt_tokens)
    width = scorer_for(s.engine.gen).hidden_size
    if body.dimensions is not None and body.dimensions != width:
        raise oa.ApiError(400, f"dimensions: this model's embeddings have {width} dimensions, got {body.dimensions} "
                               f"(shortened vectors keep their meaning only for models trained for it)", param="dimensions")
    vectors = await passes.answer(s, s.embedder, ids, adapter)
    tokens = sum(len(p) for p in ids)
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": body.model or s.model_name,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def embedder(gen, pooling: str, normalize: bool) -> Passes:
    """/v1/embeddings' passes over a Generator's weights (its `scorer_for`): its texts' final hidden
    states pooled by `pooling` (`evaluate.scoring.POOLINGS`), L2-normalised with `normalize`."""
    def embed(texts, adapter):
        return scorer_for(gen).embed(texts, pooling, normalize, adapter=adapter)
    return Passes(embed)


def texts(s: oa.Settings, given, add_special_tokens: bool = True, truncate: Optional[int] = None,
          name: str = "input") -> list[list[int]]:
    """A request's inputs (`given`: a string, strings, token ids or lists of them; the field `name`)
    as token-id lists, each checked against the vocabulary and the context (after keeping its last
    `truncate` tokens: vLLM's `truncate_prompt_tokens`); a 400 names the input at fault."""
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        given = [given]
    if not given:
        raise oa.ApiError(400, f"{name}: must not be empty", param=name)
    if len(given) > MAX_INPUTS:
        raise oa.ApiError(400, f"{name}: at most {MAX_INPUTS} inputs per request, got {len(given)}", param=name)
    field = (lambda i: name) if len(given) == 1 else (lambda i: f"{name}[{i}]")
    context, ids = s.engine.gen.config.seq, []  # a pass of its own: not bounded by the decode rows' slots
    for i, text in enumerate(given):
        p = (oa.encode(s.engine, text, field(i), add_special_tokens=add_special_tokens)
             if isinstance(text, str) else list(text))
        if not p:
            raise oa.ApiError(400, f"{field(i)}: must not be empty (it has no tokens)", param=field(i))
        oa.check_token_ids(s.engine, p, field(i))
        if truncate is not None:
            p = p[-truncate:]
        if len(p) > context:
            raise oa.ApiError(400, f"{field(i)}: {len(p)} tokens, more than the model's context of {context} "
                                   f"(truncate_prompt_tokens keeps the last ones)", param=field(i))
        ids.append(p)
    return ids


def encoded(vector: np.ndarray, encoding_format: str):
    """A vector as a JSON list of floats, or its float32 little-endian bytes in base64."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector.tolist()
