"""OpenAI's `POST /v1/embeddings`: a vector for each text, from the served language model.

The vector is the model's final hidden states (HF's `last_hidden_state`) pooled as the server was
started (`--embedding-pooling`: the last token's by default, as E5-Mistral, GTE-Qwen2 and vLLM read
decoder embedding models) and L2-normalised (unless `--no-embedding-normalize`). Texts are encoded
as /v1/completions encodes a prompt (the tokenizer's special tokens added unless
`add_special_tokens: false`) and embedded in batched forward passes beside the generation engine
(`evaluate.scoring.Scorer.embed`, the pass `echo` scores with). Requests share passes (`Embedder`):
the texts of every request that arrives while a pass runs go into the next one, as vLLM batches
its pooling requests, so many clients sending a text each are served a batch at a time. `model`
may name a served LoRA adapter: its texts run with it (in passes of their own).

`encoding_format: "base64"` sends each vector as its float32 bytes (little-endian) in base64, which
the official client asks for by default and decodes. `dimensions` must be the model's width (this
server does not shorten vectors: only models trained for it, Matryoshka-style, keep their meaning
when cut). vLLM's `truncate_prompt_tokens: k` keeps each text's last k tokens.
"""
from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Literal, Optional, Union

import numpy as np
from fastapi import Request as HttpRequest
from pydantic import Field

from mesh_transformer.serve import openai as oa

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
    ids = texts(s, body)
    width = s.embedder.scorer.hidden_size
    if body.dimensions is not None and body.dimensions != width:
        raise oa.ApiError(400, f"dimensions: this model's embeddings have {width} dimensions, got {body.dimensions} "
                               f"(shortened vectors keep their meaning only for models trained for it)", param="dimensions")
    if s.engine.draining:
        raise oa.busy(oa.Draining())
    try:
        vectors = await asyncio.wait_for(s.embedder.embed(ids, adapter), s.timeout)
    except asyncio.TimeoutError:
        raise oa.ApiError(504, f"request timed out after {s.timeout:g} s", "timeout") from None
    tokens = sum(len(p) for p in ids)
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": body.model or s.model_name,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


class Embedder:
    """The server's embedding passes over a Generator's weights (its `scorer_for`), pooled by
    `pooling` (`evaluate.scoring.POOLINGS`), L2-normalised with `normalize`. One pass runs at a
    time, off the event loop; the requests that wait meanwhile go into the next pass together (up
    to `MAX_INPUTS` texts; those under one adapter: a pass runs under one), each answered its own
    rows. `passes` counts the passes run."""

    def __init__(self, gen, pooling: str, normalize: bool):
        self.gen, self.pooling, self.normalize = gen, pooling, normalize
        self.passes = 0
        self._waiting: list[tuple[list[list[int]], Any, asyncio.Future]] = []
        self._runner: Optional[asyncio.Task] = None

    @property
    def scorer(self):
        from mesh_transformer.evaluate.scoring import scorer_for
        return scorer_for(self.gen)

    async def embed(self, ids: list[list[int]], adapter=None) -> np.ndarray:
        """[len(ids), D]: these texts' vectors, under `adapter` (a `lora.ServedAdapter`; None: the base)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((ids, adapter, future))
        if self._runner is None:
            self._runner = asyncio.create_task(self._run())
        return await future

    async def _run(self) -> None:
        try:
            while self._waiting:
                group = self._next_group()
                if not group:
                    continue
                adapter = group[0][1]
                texts = [p for ids, _, _ in group for p in ids]
                try:
                    vectors = await asyncio.to_thread(self.scorer.embed, texts, self.pooling, self.normalize,
                                                      adapter=adapter)
                except Exception as e:  # noqa: BLE001 - each request's handler raises it
                    for _, _, future in group:
                        if not future.done():
                            future.set_exception(e)
                    continue
                self.passes += 1
                start = 0
                for ids, _, future in group:
                    if not future.done():  # not timed out, client still there
                        future.set_result(vectors[start:start + len(ids)])
                    start += len(ids)
        finally:
            self._runner = None

    def _next_group(self) -> list:
        """The waiting requests of the next pass (taken off the queue): in order, those under the
        first one's adapter, up to `MAX_INPUTS` texts; ones already timed out are dropped."""
        key = lambda adapter: None if adapter is None else adapter.serial  # noqa: E731 - a load of an adapter
        first, group, rest, size = key(self._waiting[0][1]), [], [], 0
        for waiting in self._waiting:
            ids, adapter, future = waiting
            if future.done():
                continue
            if key(adapter) == first and (not group or size + len(ids) <= MAX_INPUTS):
                group.append(waiting)
                size += len(ids)
            else:
                rest.append(waiting)
        self._waiting = rest
        return group


def texts(s: oa.Settings, body: EmbeddingRequest) -> list[list[int]]:
    """The request's inputs as token-id lists, each checked against the vocabulary and the context
    (after `truncate_prompt_tokens`); a 400 names the input at fault."""
    given = body.input
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        given = [given]
    if not given:
        raise oa.ApiError(400, "input: must not be empty", param="input")
    if len(given) > MAX_INPUTS:
        raise oa.ApiError(400, f"input: at most {MAX_INPUTS} inputs per request, got {len(given)}", param="input")
    field = (lambda i: "input") if len(given) == 1 else (lambda i: f"input[{i}]")
    context, ids = s.engine.gen.config.seq, []  # a pass of its own: not bounded by the decode rows' slots
    for i, text in enumerate(given):
        p = (oa.encode(s.engine, text, field(i), add_special_tokens=body.add_special_tokens)
             if isinstance(text, str) else list(text))
        if not p:
            raise oa.ApiError(400, f"{field(i)}: must not be empty (it has no tokens)", param=field(i))
        oa.check_token_ids(s.engine, p, field(i))
        if body.truncate_prompt_tokens is not None:
            p = p[-body.truncate_prompt_tokens:]
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
