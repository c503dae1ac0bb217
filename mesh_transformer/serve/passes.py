"""Forward passes that many requests share: /v1/embeddings' and /classify's.

A pass reads whole texts and answers a row per text (a vector, a classifier's scores); it needs no
KV cache and no decode loop, so it runs beside the generation engine, one at a time, off the event
loop. The texts of every request that arrives while a pass runs go into the next one, as vLLM
batches its pooling requests: many clients sending a text each are served a batch at a time.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional

import numpy as np

from mesh_transformer.serve import openai as oa

PASS_TEXTS = 2048  # texts per pass at most (OpenAI's limit of inputs per embeddings request)


class Passes:
    """`work(texts: list of token-id lists, adapter) -> [len(texts), ...] array` run over the
    texts of the requests that wait together: those under the first one's adapter (a
    `lora.ServedAdapter`; None: the base), up to `PASS_TEXTS` texts, each request answered its own
    rows. `passes` counts the passes run."""

    def __init__(self, work: Callable[[list[list[int]], Any], np.ndarray]):
        self.work = work
        self.passes = 0
        self._waiting: list[tuple[list[list[int]], Any, asyncio.Future]] = []
        self._runner: Optional[asyncio.Task] = None

    async def run(self, ids: list[list[int]], adapter=None) -> np.ndarray:
        """These texts' rows, under `adapter`, from the next pass that has room for them."""
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
                    rows = await asyncio.to_thread(self.work, texts, adapter)
                except Exception as e:  # noqa: BLE001 - each request's handler raises it
                    for _, _, future in group:
                        if not future.done():
                            future.set_exception(e)
                    continue
                self.passes += 1
                start = 0
                for ids, _, future in group:
                    if not future.done():  # not timed out, client still there
                        future.set_result(rows[start:start + len(ids)])
                    start += len(ids)
        finally:
            self._runner = None

    def _next_group(self) -> list:
        """The waiting requests of the next pass (taken off the queue): in order, those under the
        first one's adapter, up to `PASS_TEXTS` texts; ones already timed out are dropped."""
        key = lambda adapter: None if adapter is None else adapter.serial  # noqa: E731 - a load of an adapter
        first, group, rest, size = key(self._waiting[0][1]), [], [], 0
        for waiting in self._waiting:
            ids, adapter, future = waiting
            if future.done():
                continue
            if key(adapter) == first and (not group or size + len(ids) <= PASS_TEXTS):
                group.append(waiting)
                size += len(ids)
            else:
                rest.append(waiting)
        self._waiting = rest
        return group


async def answer(s: oa.Settings, passes: Passes, ids: list[list[int]], adapter) -> np.ndarray:
    """`passes.run(ids, adapter)` for one request: a 503 while the server drains, a 504 past its timeout."""
    if s.engine.draining:
        raise oa.busy(oa.Draining())
    try:
        return await asyncio.wait_for(passes.run(ids, adapter), s.timeout)
    except asyncio.TimeoutError:
        raise oa.ApiError(504, f"request timed out after {s.timeout:g} s", "timeout") from None
