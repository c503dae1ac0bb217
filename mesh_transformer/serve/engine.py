"""The engine: one thread that batches requests onto the device.

The engine keeps one `generate.Batch` of `max_batch` rows. Between decode calls of `chunk` tokens
it admits waiting requests into free rows (they join requests already decoding) and hands new
tokens to their handlers. Requests come in bursts (clients answer each other, a finished request's
client sends its next one), so the call right after requests joined or finished runs only
`join_chunk` steps: the rest of a burst waits one short call, not a whole chunk, to be admitted.
An admission's first tokens go to their handlers as soon as its prefill ends, before that call.
An admission computes at most `admit_tokens` prompt positions (as vLLM bounds a step's batched
tokens): a burst of 64 prompts joins 16 at a time, each group decoding while the next is prefilled,
so its first requests see their first tokens after a quarter of the burst's prefill, and the
prefill runs at the speed of 16 rows (a 64-row prefill behind a cached 1,000-token prefix ran 43%
slower per row on a CPU).
When nothing is running, a request that arrives waits up to `gather` seconds for the rest of its
burst: clients finishing together send their next requests within milliseconds of each other, and
admitted as they came (1, then 15) the later ones waited for the first group's prefill and paid for
two padded prefills (10 rows run as 16). The engine waits while fewer requests are queued than the
last decode call finished (their clients are the ones likely to come back), and after that only
while they keep arriving within `GATHER_QUIET` of each other. Measured through HTTP, 16 clients
behind a 1,000-token prompt prefix came back over 30-65 ms (the server parses and tokenizes each
request in turn, about 2 ms each, while streaming the others' last tokens), so a quiet-time rule
alone split most bursts in two.
A request names its LoRA adapter, if any; the engine places it in an entry of the generator's bank
as it admits the request (`serve.adapters`), so a server may know more adapters than the bank holds.
A bounded queue refuses work when full (`QueueFull`), every request has a deadline, and `drain`
stops admitting new work for a graceful shutdown.
An engine over a classifier (a sequence classifier or reward model: `ModelConfig.classifier`)
decodes nothing: it holds no batch and no KV cache and runs no thread; its requests are the
server's scoring passes (`serve.classify`), and `sequence` raises ConfigError.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Iterable, Optional, Sequence as Seq

import numpy as np

from mesh_transformer import host_memory
from mesh_transformer.generate import Batch, Generator, SamplingOptions, Sequence, bucket, structured
from mesh_transformer.generate.decode import computed_and_read
from mesh_transformer.generate.prefix import DEFAULT_BLOCK, PrefixCache, default_tokens
from mesh_transformer.lora import ServedAdapter
from mesh_transformer.serve.adapters import AdapterSlots
from mesh_transformer.serve.metrics import Metrics

log = logging.getLogger("mesh_transformer.serve")
WARM_KEEPS_FREE = 0.25  # of the process's memory maps (vm.max_map_count): warm-up leaves it to traffic's shapes

DEFAULT_GATHER = 0.08  # seconds an idle engine waits for the rest of a burst, at most ...
GATHER_QUIET = 0.003  # ... once as many requests wait as the last call finished, while they keep arriving this close


class QueueFull(Exception):
    pass


class Draining(Exception):
    """The server is shutting down and admits no new requests."""


class Request:
    """Sequences submitted together (one API call), and how to wake the handler waiting on them."""

    def __init__(self, seqs: list[Sequence], loop: Optional[asyncio.AbstractEventLoop]):
        self.seqs = seqs
        self.loop = loop
        self.updated = asyncio.Event() if loop else threading.Event()
        self.submitted = time.monotonic()

    def notify(self) -> None:
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self.updated.set)
            except RuntimeError:  # the handler's loop is gone (server stopped)
                pass
        else:
            self.updated.set()

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def cancel(self) -> None:
        for s in self.seqs:
            s.cancelled = True


class _Timing:
    """When a sequence was submitted and last got tokens (for the TTFT and inter-token histograms)."""

    __slots__ = ("submitted", "last", "seen")

    def __init__(self, submitted: float):
        self.submitted, self.last, self.seen = submitted, submitted, 0


class Engine:
    """Runs a `Batch` in a background thread; `submit` from any thread.

    max_batch: device rows; slots: cache slots per row (default: the model's context);
    chunk: decode steps per device call (new requests join between calls); join_chunk: the steps
    of a call right after requests joined or finished; admit_tokens: prompt positions one admission
    computes at most (rows x the prompt part not in the prefix cache, both bucketed; a prompt longer
    than that is admitted alone); see the module's docstring. max_queue: waiting
    sequences before `submit` raises QueueFull; prefix_cache_tokens: token slots of the prefix
    cache (None: `prefix.default_tokens`; 0: no prefix cache), in blocks of `prefix_block` tokens;
    batch_invariant: decode every row at every step, so answers do not depend on the load
    (`generate.Batch`); gather: seconds an idle engine waits for the rest of a burst (0: none);
    share_prefix: rows read their prompts' cached blocks from the prefix cache's pool while they
    decode, once per step for all of them, instead of holding copies (`generate.Batch`).
    host_adapters: served LoRA adapters whose leaves stay in host memory (None: all; vLLM's
    --max-cpu-loras), the others read from their directories again when named (`serve.adapters`).
    eos_token_ids: what ends a request's generation unless it asks `ignore_eos` (default: the
    tokenizer's EOS; `loading.LoadedModel.eos_token_ids` adds a generation config's).
    """

    def __init__(self, generator: Generator, tokenizer, max_batch: int = 16, slots: Optional[int] = None,
                 chunk: int = 8, max_queue: int = 100, metrics: Optional[Metrics] = None,
                 prefix_cache_tokens: Optional[int] = None, prefix_block: int = DEFAULT_BLOCK,
                 batch_invariant: bool = False, join_chunk: int = 1, admit_tokens: int = 4096,
                 gather: float = DEFAULT_GATHER, share_prefix: bool = True, host_adapters: Optional[int] = None,
                 eos_token_ids: Optional[Seq[int]] = None):
        self.gen, self.tokenizer = generator, tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else () if eos is None else (eos,)
        self.adapters = AdapterSlots(generator, host_adapters) if generator.adapters is not None else None
        self.generates = not generator.config.classifier
        self.max_batch = max_batch
        slots = slots or generator.config.seq
        if prefix_cache_tokens is None:
            prefix_cache_tokens = default_tokens(generator.config, slots, prefix_block) if self.generates else 0
        self._prefix = (prefix_cache_tokens, prefix_block)
        # (speculative decoding writes its drafts' slots past a row's last token: room for them)
        self.batch = (Batch(generator, max_batch, slots + generator.speculate, chunk, self._new_prefix_cache(),
                            batch_invariant, share_prefix) if self.generates else None)
        self._warm_full = False  # warm-up stopped at the process's limit of memory maps
        # prompt + output must fit a row (a classifier's pass reads the model's whole context)
        self.context = min(generator.config.seq, slots) if self.generates else generator.config.seq
        self.max_new_tokens = self.context - 1
        self.max_queue = max_queue
        self.join_chunk = join_chunk
        self.admit_tokens = admit_tokens
        self.gather = gather
        self._left, self._left_at = 0, 0.0  # requests the last call finished, when (their clients may come back)
        self.metrics = metrics or Metrics()
        self.metrics.watch(queued=lambda: len(self._pending), running=lambda: len(self._active()))
        self.draining = False
        self._pending: collections.deque[tuple[Sequence, Request]] = collections.deque()
        self._owner: dict[int, Request] = {}  # id(seq) -> request, for sequences in the batch
        self._timing: dict[int, _Timing] = {}  # id(seq) -> timing, for sequences in the batch
        self._cv = threading.Condition()
        self._stop = False
        self._abort: Optional[str] = None  # a finish reason for every request (set by `abort`)
        self._parked = False  # the engine thread waits for work (no step's arrays held but the batch's)
        self._thread = threading.Thread(target=self._run, name="mesh-transformer-engine", daemon=True)
        self.completed = 0
        self.admissions = 0  # prefill calls (each admits a group of waiting sequences)

    def _new_prefix_cache(self) -> Optional[PrefixCache]:
        tokens, block = self._prefix
        return PrefixCache(self.gen, tokens, block) if tokens else None

    def start(self) -> "Engine":
        if not self.generates:
            return self
        self._thread.start()
        threading.Thread(target=self._prepare_grammars, name="grammar-tokenizer", daemon=True).start()
        return self

    def _prepare_grammars(self) -> None:
        """Build llguidance's view of the tokenizer (0.36 s for GPT-2's 50k vocabulary, longer for
        128k) at start-up rather than in the first structured-output request. Requests compile their
        grammars in worker threads, which wait for it; the build holds the GIL, so other threads
        (the event loop too) pause while it runs, once."""
        try:
            structured.compiler(self.tokenizer, self.gen.vocab)
        except Exception as e:  # noqa: BLE001 - such requests will get the error themselves
            log.info("structured outputs unavailable: %s", e)

    def warmup(self, prompt_tokens: Iterable[int] = (16,), shared_prefix: int = 0) -> None:
        """Compile prefill for every group size (1, 2, 4, .. rows, up to what `admit_tokens` admits)
        at these prompt lengths, and decode.

        With `shared_prefix` P (and the prefix cache on), also the prefill of prompts made of P tokens
        already in the cache followed by each length's own tokens: the shape prompts behind a common
        system prompt or few-shot examples take (a multiple of the cache's block matches them best).
        Call before `start`; otherwise the first requests of each shape wait for the compiler
        (prefill compiles once per group-size bucket and prompt-length bucket).
        A classifier's engine compiles its classification passes instead: 1, 2, 4, .. `max_batch`
        prompts of each length. Logs what it compiled and how long it took.
        """
        started, before = time.monotonic(), collections.Counter(self.gen.compiled)
        self._warm_up(prompt_tokens, shared_prefix)
        programs = self.gen.compiled - before
        log.info("warm-up took %.1f s%s", time.monotonic() - started,
                 f": {', '.join(f'{n} {kind}' for kind, n in programs.items())} programs compiled" if programs else "")

    def _warm_up(self, prompt_tokens: Iterable[int], shared_prefix: int) -> None:
        if not self.generates:
            from mesh_transformer.evaluate.scoring import scorer_for
            for length in prompt_tokens:
                n = 1
                while n <= self.max_batch:
                    scorer_for(self.gen).classify([[0] * min(length, self.context)] * n)
                    n *= 2
            return
        self._warm_full = False
        options = SamplingOptions(max_new_tokens=min(self.batch.chunk + 1, self.max_new_tokens), temperature=0.0)
        longest = self.context - options.max_new_tokens
        rng = np.random.RandomState(0)
        own = lambda length: rng.randint(self.gen.config.n_vocab, size=length).tolist()  # noqa: E731
        for length in prompt_tokens:
            n = 1
            while n <= self.batch.size and (n == 1 or self.batch.prefill_tokens(n, length) <= self.admit_tokens):
                if self.batch.prefix is not None:
                    self.batch.prefix.clear()  # compile the prefill of prompts not in the cache
                self._warm([[0] * min(length, longest)] * n, options)
                if shared_prefix and self.batch.prefix is not None:
                    shared = own(min(shared_prefix, longest - 1))
                    mine = max(1, min(length, longest - len(shared)))
                    self._warm([shared + own(mine)], options)  # stores the shared blocks
                    self._warm([shared + own(mine) for _ in range(n)], options)  # reads them
                n *= 2
        # Decode attends to a window of the cache bucketed to powers of two (Generator.min_window ..
        # slots) and computes the rows up to the last running one, bucketed (1 .. max_batch); a
        # long request would otherwise compile each size on its way (seconds each, mid-request).
        # Rows behind the shared prefix also read its pool slots (bucketed): those programs too.
        # What does not fit under the process's limit of memory maps is left out (see `_room`), so
        # the windows the warmed prompts decode over come first, smallest first, and the smaller
        # ones (shorter prompts) after them: at Debian's limit a float32 server warmed `--warmup
        # 128 160` used to fill it with windows of 16-64 slots and compiled its 64-row, 256-slot
        # decode mid-traffic.
        readings = [None] + self._warm_readings(prompt_tokens, shared_prefix, longest)
        rows = sorted({self.batch.row_bucket(r) for r in range(1, self.batch.size + 1)})
        slots = self.batch.slots
        held = min(bucket(min(min(prompt_tokens), longest) + self.batch.chunk), slots)
        calls = sorted({(min(max(bucket(1) << i, self.gen.min_window(r)), slots), r)
                        for i in range(slots.bit_length()) for r in rows},
                       key=lambda call: (call[0] < held, call))
        for window, r in calls:
            # a speculating generator's call of r rows may draft while few of them run (Generator.speculates)
            for running in sorted({1, r}) if self.gen.speculate else (r,):
                for reading in readings:
                    if not self._room(f"decode over {window} slots"):
                        break
                    self.batch.state, *_ = self.gen.decode(self.batch.state, self.batch.chunk, 0, window, r,
                                                           shared=reading, running=running)  # none runs
        if self._room("cache moves"):
            self.batch.state = self.gen.warm_moves(self.batch.state)  # admission moves the running rows' slots
        if self.batch.prefix is not None:
            self.batch.prefix.clear()  # the warm-up prompts are no one's prefix

    def _warm_readings(self, prompt_tokens: Iterable[int], shared_prefix: int, longest: int) -> list:
        """`Generator.decode`'s `shared` for rows behind a `shared_prefix`-token cached prefix with
        prompts of these lengths (one per pool-slot bucket they read; none when not sharing)."""
        if not (shared_prefix and self.batch.prefix is not None and self.batch.share_prefix):
            return []
        block, common = self.batch.prefix.block, min(shared_prefix, longest - 1)
        reads = set()
        for length in prompt_tokens:
            total = common + max(1, min(length, longest - common))
            cached = min(common // block, (total - 1) // block) * block  # what `PrefixCache.plan` finds
            reads.add(bucket(computed_and_read([total], [cached])[1][0]))
        return [(self.batch.prefix.pool, np.full(u, self.batch.prefix.tokens, np.int32),
                 np.full((self.batch.size, u), -1, np.int32)) for u in sorted(reads)]

    def _room(self, what: str) -> bool:
        """Whether one more program fits under the process's limit of memory maps, a quarter of it
        left for the shapes traffic brings (else warm-up stops: compiling past the limit would make
        the generator drop every program, see `Generator._note`)."""
        if host_memory.room_for_programs(1, keep_free=WARM_KEEPS_FREE):
            return True
        if not self._warm_full:
            log.warning("warm-up stopped before %s: the process is near its limit of memory maps "
                        "(vm.max_map_count; raise it to warm more shapes)", what)
        self._warm_full = True
        return False

    def _warm(self, prompts: list[list[int]], options: SamplingOptions) -> None:
        if not self._room(f"the prefill of {len(prompts)} x {len(prompts[0])} tokens"):
            return
        self.batch.admit([Sequence(p, options, self.context) for p in prompts])
        while self.batch.active():
            self.batch.step()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def drain(self) -> None:
        """Admit no new requests (`submit` raises Draining); queued and running ones go on."""
        with self._cv:
            self.draining = True

    def abort(self, reason: str = "shutdown") -> None:
        """Finish every queued and running sequence now with `reason` (their handlers answer at once)."""
        with self._cv:
            self._abort = reason
            self._cv.notify()

    @property
    def idle(self) -> bool:
        with self._cv:
            return not self._pending and not self._owner

    @property
    def parked(self) -> bool:
        """Idle, and the engine thread is waiting for work: the last step's results are released
        (what a test of live device buffers needs; `idle` turns true a little earlier)."""
        with self._cv:
            return self._parked and not self._pending

    # ---- called from request handlers ---------------------------------------------------------

    def sequence(self, prompt_ids: list[int], options: SamplingOptions, timeout: Optional[float],
                 adapter=None) -> Sequence:
        """Build (and validate) a Sequence, under the LoRA adapter called `adapter` (or that
        `lora.ServedAdapter`, as `adapter(name)` gave it; None: the base); ValueError names what is wrong."""
        self.gen.check_generates()
        lora = adapter if isinstance(adapter, ServedAdapter) else self.adapter(adapter)
        if options.max_new_tokens > self.max_new_tokens:
            raise ValueError(f"max_tokens must be at most {self.max_new_tokens} for this model "
                             f"(context {self.context} tokens), got {options.max_new_tokens}")
        deadline = time.monotonic() + timeout if timeout else None
        return Sequence(prompt_ids, options, self.context, self.tokenizer, deadline=deadline, lora=lora,
                        vocab=self.gen.vocab)

    def adapter(self, name: Optional[str]):
        """The known adapter called `name` (a `lora.ServedAdapter`; None for None); ValueError if none is."""
        if name is None:
            return None
        found = self.adapters.get(name) if self.adapters is not None else None
        if found is None:
            names = self.adapters.names() if self.adapters is not None else []
            raise ValueError(f"adapter {name!r} is not loaded (this server's adapters: {', '.join(names) or 'none'})")
        return found

    def submit(self, seqs: list[Sequence], loop: Optional[asyncio.AbstractEventLoop] = None) -> Request:
        for s in seqs:  # a grammar compiles on the caller's thread (ValueError here), not the engine's
            s.constrain(self.gen.vocab)
        request = Request(seqs, loop)
        with self._cv:
            if self.draining:
                raise Draining()
            if len(self._pending) + len(seqs) > self.max_queue:
                raise QueueFull()
            self._pending.extend((s, request) for s in seqs)
            self._cv.notify()
        return request

    def stats(self) -> dict:
        with self._cv:
            prefix = self.batch.prefix if self.generates else None
            return {"active": len(self._active()), "queued": len(self._pending), "completed": self.completed,
                    "admissions": self.admissions, "compiled_shapes": len(self.gen.shapes),
                    "draining": self.draining, "dtype": str(self.gen.config.compute_dtype),
                    "prefix_cache": prefix.stats() if prefix is not None else None,
                    "adapters": self.adapters.stats() if self.adapters is not None else None,
                    "speculate": self._speculation()}

    def _speculation(self) -> Optional[dict]:
        """Speculative decoding's settings and the passes it has made (None: off)."""
        g = self.gen
        return {"draft_tokens": g.speculate, "lookup_ngram": g.lookup_ngram, "max_rows": g.speculate_rows,
                "row_passes": g.row_passes} if g.speculate else None

    def _active(self) -> list[int]:
        return self.batch.active() if self.generates else []

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._pending and not self.batch.active() and not self._abort:
                    self._parked = True
                    self._cv.wait()
                self._parked = False
                if self._stop:
                    break
                if self._abort:
                    self._finish_everything(self._abort)
                elif self._pending and not self.batch.active():
                    self._gather_burst()
                group = self._take_admissible()
                for seq, request in group:
                    self._owner[id(seq)] = request
            try:
                self._advance(group)
            except Exception:  # noqa: BLE001 - fail the affected requests, keep serving
                log.exception("generation failed; failing the affected requests")
                self._fail_all(group)

    def _gather_burst(self) -> None:
        """(Under the lock.) Wait for the rest of a burst: while fewer requests wait than the last
        decode call finished, up to `gather` seconds after it; then while they keep arriving (each
        within `GATHER_QUIET` of the last), up to `gather` seconds after this call."""
        now = time.monotonic()
        deadline, expecting = now + self.gather, self._left_at + self.gather
        while not self._stop and self._abort is None and len(self._pending) < self.batch.size:
            seen, now = len(self._pending), time.monotonic()
            if seen < self._left and now < expecting:
                self._cv.wait(expecting - now)
                continue
            if now >= deadline:
                return
            self._cv.wait(min(GATHER_QUIET, deadline - now))
            if len(self._pending) == seen:
                return

    def _finish_everything(self, reason: str) -> None:
        """(Under the lock.) Queued sequences end now; running ones are retired by the next step."""
        self._abort = None
        while self._pending:
            seq, request = self._pending.popleft()
            seq.finish(reason)
            request.notify()
        for r in self.batch.active():
            self.batch.rows[r].finish(reason)

    def _take_admissible(self) -> list[tuple[Sequence, Request]]:
        """Waiting sequences (in order) that fit in the batch now, each given its adapter's bank
        entry; drops cancelled/expired ones. A sequence whose adapter finds no entry waits (see
        `serve.adapters`) while later ones under other entries go on."""
        group: list[tuple[Sequence, Request]] = []
        now = time.monotonic()
        longest = 0  # the longest prompt part of the group not in the prefix cache
        kept: set[int] = set()  # bank entries drained for adapters that found none ...
        wanted: set[int] = set()  # ... (their serials: one entry drained for each)
        waiting: list[tuple[Sequence, Request]] = []  # passed over: their adapter found no entry
        while self._pending:
            seq, request = self._pending[0]
            if seq.cancelled or (seq.deadline is not None and now > seq.deadline):
                self._pending.popleft()
                seq.finish("cancelled" if seq.cancelled else "timeout")
                request.notify()
                continue
            if self.batch.plan([s for s, _ in group] + [seq]) is None:
                break  # first come, first served: later requests wait behind this one
            uncached = max(longest, self.batch.uncached(seq))
            if group and self.batch.prefill_tokens(len(group) + 1, uncached) > self.admit_tokens:
                break
            entry = self.adapters.entry_for(seq.lora, kept) if self.adapters is not None else 0
            if entry is None:  # its entry is drained for another adapter, or it has none: drain one for it
                needs = seq.lora.serial not in wanted and self.adapters.entry_of(seq.lora) is None
                drained = self.adapters.drained(kept) if needs else None
                if drained is not None:
                    kept.add(drained)
                    wanted.add(seq.lora.serial)
                waiting.append(self._pending.popleft())
                continue
            if self.adapters is not None:
                self.adapters.pin(entry)
            seq.adapter, longest = entry, uncached
            group.append(self._pending.popleft())
        self._pending.extendleft(reversed(waiting))
        return group

    def _advance(self, group: list[tuple[Sequence, Request]]) -> None:
        finished: list[Sequence] = []
        if group and self.adapters is not None:
            group = self._place_adapters(group)
        if group:
            for seq, request in group:
                self._timing[id(seq)] = _Timing(request.submitted)
            prefix = self.batch.prefix
            hits = prefix.hits if prefix is not None else 0
            finished += self.batch.admit([s for s, _ in group])
            self.admissions += 1
            self.metrics.admitted([len(s.prompt) for s, _ in group],
                                  (prefix.hits - hits) if prefix is not None else None)
            self._observe([s for s, _ in group])
            for request in {id(r): r for _, r in group}.values():
                request.notify()  # first tokens go out now, not after the decode call that follows
        if self.batch.active():
            in_batch, passes = [self.batch.rows[r] for r in self.batch.active()], self.gen.row_passes
            finished += self.batch.step(self.join_chunk if group or self._left else None)
            self.metrics.decode_row_passes.inc(self.gen.row_passes - passes)
            self._observe(in_batch)
        touched = {id(r): r for r in self._owner.values()}
        self._left, self._left_at = sum(r.finished for r in touched.values()), time.monotonic()
        for seq in finished:
            with self._cv:
                self._owner.pop(id(seq), None)
                if self.adapters is not None:
                    self.adapters.release(seq.adapter)
            self._timing.pop(id(seq), None)
            self.completed += 1
        for request in touched.values():
            request.notify()

    def _place_adapters(self, group: list[tuple[Sequence, Request]]) -> list[tuple[Sequence, Request]]:
        """Write the adapters `group` runs with into their entries; the sequences under an entry that
        could not be written finish with "error" (the rest of the group, and the batch, go on)."""
        failed = self.adapters.place()
        for seq, request in [(s, r) for s, r in group if s.adapter in failed]:
            seq.finish("error")
            self.adapters.release(seq.adapter)
            with self._cv:
                self._owner.pop(id(seq), None)
            request.notify()
        return [(s, r) for s, r in group if s.adapter not in failed]

    def _observe(self, seqs: list[Sequence]) -> None:
        """Record new tokens of `seqs`: the first one's latency from submission, the others' spacing."""
        now = time.monotonic()
        for seq in seqs:
            t = self._timing.get(id(seq))
            new = len(seq.tokens) - t.seen if t else 0
            if new <= 0:
                continue
            spaced = new - 1 if t.seen == 0 else new  # tokens after the first, each `spacing` apart
            self.metrics.generated(new, first=now - t.submitted if t.seen == 0 else None,
                                   spacing=(now - t.last) / spaced if spaced else 0.0, spaced=spaced)
            t.last, t.seen = now, len(seq.tokens)

    def _fail_all(self, group) -> None:
        for seq, request in group:
            seq.finish("error")
            request.notify()
        with self._cv:
            owners = list(self._owner.values())
            self._owner.clear()
        for request in owners:
            for s in request.seqs:
                s.finish("error")
            request.notify()
        self._timing.clear()
        if self.adapters is not None:
            self.adapters.release_all()
        # a failed admission may have consumed the pool (donated) or left blocks unfilled: start afresh
        self.batch = Batch(self.gen, self.batch.size, self.batch.slots, self.batch.chunk, self._new_prefix_cache(),
                           self.batch.batch_invariant, self.batch.share_prefix)

    def generate(self, prompt_ids: list[int], options: SamplingOptions, timeout: Optional[float] = None) -> Sequence:
        """Blocking helper (tests, scripts): one sequence through the queue."""
        seq = self.sequence(prompt_ids, options, timeout)
        request = self.submit([seq])
        while not request.finished:
            request.updated.wait()
            request.updated.clear()
        return seq
