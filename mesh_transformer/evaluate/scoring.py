"""Scoring prompts: one forward pass gives every position's log p(next token) and its most likely tokens.

    scorer = Scorer.for_generator(gen)            # the weights a Generator (or server) already holds
    scorer = Scorer.for_trainer(trainer, params)  # training's params, as they are (stacked, maybe ZeRO/LoRA);
                                                  # scorer.use(newer_params) later, without recompiling
    [s] = scorer.score([[50256, 464, 3290]], top=1)   # a prompt of L <= seq + 1 tokens
    s.logprobs   # [L-1]: log p(token i+1 | tokens 0..i)
    s.top_ids    # [L-1, top]: the most likely next tokens at each position (s.top_ids[:, 0] is greedy)
    [s] = scorer.score([[50256, 464, 3290]], tail=[1])  # only the last position: s.logprobs is [1]
    [s] = scorer.score([[50256, 464, 3290]], adapter=gen.adapters.adapters[0])  # under a served LoRA adapter

    vectors = scorer.embed([[464, 3290], [50256]], pooling="last")  # [2, D] float32, L2-normalised
    scores = scorer.classify([[464, 3290], [50256]])  # a classifier's: [2, num_labels] float32 logits

The evaluator (`evaluate.lm`) and the server's `echo` (`serve.openai`) both score through here,
the server's `/v1/embeddings` embeds through here (`embed`: see `POOLINGS`) and its `/classify`
classifies (`classify`: a sequence classifier's or reward model's score head at the last token).
Prompts are sorted by length and batched: rows are powers of two (`bucket`, as in generation),
positions four sizes per power of two (`fine_bucket`), so a whole evaluation compiles a
handful of programs and pads little; sequences are right-padded,
and padded positions come after the real ones (causal attention), so padding never changes a
score and is never returned. With `tail` (an evaluator's continuation lengths) the vocabulary
head and the scores run on each prompt's last positions only (a bucketed K of them), not on all
T: for a small model with a 50k vocabulary that head is most of the work.

Vocab-parallel like the loss: each mp shard holds logits for V/mp tokens; the log-normaliser and a
target's logit take [B, T]-sized reductions over 'mp', the top tokens a top-k per shard and one
over the mp x top candidates. Full logits are never gathered.

Shape letters: B rows, T positions, V/mp this shard's vocabulary, K top tokens.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from mesh_transformer import parallel
from mesh_transformer.generate.decode import bucket, fine_bucket, round_up
from mesh_transformer.generate.sampling import TOP_LOGPROBS
from mesh_transformer.models.core import KVCache
from mesh_transformer.train import loss

DEFAULT_BATCH_TOKENS = 8192  # rows x positions of one forward pass (activations scale with it)

# Text embeddings from a language model: its final hidden states (HF's `last_hidden_state`: after
# the final norm) pooled into one vector per text, as embedding models built on decoder LMs are
# read (E5-Mistral, GTE-Qwen2, SFR-Embedding: the last token's state, L2-normalised; vLLM's
# pooling types and defaults).
POOLINGS = {"last": "the last token's state (the one state of a decoder that has seen the whole text)",
            "mean": "the mean of the text's tokens' states (sentence-transformers' default)",
            "cls": "the first token's state (BERT's [CLS]; a decoder's first token has seen only itself)"}


@dataclass
class PromptScores:
    """Scores of one prompt of L tokens (entry i is about token i+1)."""

    logprobs: np.ndarray  # [L-1] float32: log p(token i+1 | tokens 0..i)
    top_ids: np.ndarray  # [L-1, K] int32: the K most likely tokens after token i, most likely first
    top_logprobs: np.ndarray  # [L-1, K] float32: their log p


def token_scores(logits, targets, top: int):
    """Inside shard_map: logits [B, T, V/mp] (this shard's vocabulary), targets [B, T] ->
    (log p(target) [B, T], top ids [B, T, K], their log p [B, T, K]).

    A target that is the most likely token gets exactly the top log p (same logit, same normaliser),
    so callers may compare the two for equality, as OpenAI clients do."""
    log_norm = loss.log_normalizer(logits)
    logprob = loss.target_logits(logits, targets) - log_norm
    local_vocab = logits.shape[-1]
    if top == 1:  # the max, then the first id holding it: two plain reductions (XLA:CPU's argmax and
        values = jnp.max(logits, axis=-1, keepdims=True)  # top_k, variadic reductions, are many times slower)
        ids = jnp.min(jnp.where(logits == values, jnp.arange(local_vocab, dtype=jnp.int32), local_vocab),
                      axis=-1, keepdims=True)
    else:
        values, ids = jax.lax.top_k(logits, top)
    offset = parallel.mp_index() * local_vocab  # (a Python 0 where there are no shards)
    ids = ids.astype(jnp.int32) + jnp.asarray(offset, jnp.int32)
    values, ids = parallel.all_gather_mp(values), parallel.all_gather_mp(ids)  # [B, T, mp*K], shard order
    best, where = jax.lax.top_k(values, top)  # ties: the lower shard, i.e. the lower token id
    return logprob, jnp.take_along_axis(ids, where, axis=-1), best - log_norm[..., None]


def pooled(hidden, weights, normalize: bool):
    """Inside shard_map: hidden [B, K, D] at each row's pooled positions, weights [B, K] (1: the
    prompt's, 0: padding) -> their weighted mean [B, D] float32, L2-normalised with `normalize`
    (x / max(|x|, 1e-12), torch's `F.normalize`). Every mp shard holds all of D."""
    mean = jnp.einsum("bkd,bk->bd", hidden.astype(jnp.float32), weights) / jnp.sum(weights, axis=1, keepdims=True)
    if not normalize:
        return mean
    return mean / jnp.maximum(jnp.linalg.norm(mean, axis=-1, keepdims=True), 1e-12)


class AdapterScoring(NamedTuple):
    """How a Scorer runs its prompts with one served LoRA adapter (`Scorer.for_generator` of a
    generator with a bank): `forward` as the Scorer's, every row under the adapter; `params(adapter)`
    the leaves it adds to the base params, placed; `specs` theirs."""

    forward: Callable
    params: Callable
    specs: Any


ADAPTERS_KEPT = 2  # served adapters whose placed leaves a Scorer keeps between calls (an evaluation's
                   # requests all name one)


class Scorer:
    """A compiled scoring pass over one set of parameters on one mesh.

    `forward(params, tokens [b, T], positions [b, K], hidden=False) -> logits [b, K, V/mp]` at those
    positions (a classifier's, `labels` > 0: its scores [b, K, labels]; with `hidden`, the final
    hidden states [b, K, D]) runs inside shard_map with `rules`; `param_specs` place `params`. Use
    `for_generator` or `for_trainer`."""

    def __init__(self, forward: Callable, params: Any, param_specs: Any, mesh: Mesh, rules, seq: int,
                 layout: parallel.Layout = parallel.Layout(), batch_tokens: int = DEFAULT_BATCH_TOKENS,
                 prepare: Callable = lambda params: params, adapted: Optional[AdapterScoring] = None,
                 hidden_size: Optional[int] = None, labels: int = 0):
        self.mesh, self.seq, self.batch_tokens, self._prepare = mesh, seq, batch_tokens, prepare
        self.hidden_size = hidden_size  # the width of `embed`'s vectors
        self.labels = labels  # a classifier's outputs (`classify`); 0: a language model (`score`)
        self.params = prepare(params)
        self.dp = mesh.shape[parallel.DP]
        row = P(parallel.DP, None)
        top = P(parallel.DP, None, None)
        # scores come back replicated: on many hosts every process reads all rows (they are small)
        everywhere = jax.sharding.NamedSharding(mesh, P())

        def program(forward, specs, k):  # (params, tokens, targets at the scored positions, those positions)
            return jax.jit(parallel.shard_map(lambda p, t, y, w: token_scores(forward(p, t, w), y, k), mesh, rules,
                                              in_specs=(specs, row, row, row), out_specs=(row, top, top),
                                              layout=layout), out_shardings=everywhere)

        def embedding(forward, specs, normalize):  # (params, tokens, pooled positions, their weights)
            return jax.jit(parallel.shard_map(lambda p, t, w, m: pooled(forward(p, t, w, hidden=True), m, normalize),
                                              mesh, rules, in_specs=(specs, row, row, row), out_specs=row,
                                              layout=layout), out_shardings=everywhere)

        def classification(forward, specs):  # (params, tokens, each row's last position)
            return jax.jit(parallel.shard_map(lambda p, t, w: forward(p, t, w)[:, 0], mesh, rules,
                                              in_specs=(specs, row, row), out_specs=row, layout=layout),
                           out_shardings=everywhere)

        def programs(forward, specs, adapted: bool) -> dict:
            made = {("embed", normalize, adapted): embedding(forward, specs, normalize) for normalize in (False, True)}
            if labels:
                made["classify", adapted] = classification(forward, specs)
            else:
                made.update({(k, adapted): program(forward, specs, k) for k in (1, TOP_LOGPROBS)})
            return made
        self._programs = programs(forward, param_specs, False)
        if adapted is not None:
            self._programs.update(programs(adapted.forward, _joined(param_specs, adapted.specs), True))
        self._adapted = adapted
        self._kept: OrderedDict[int, Any] = OrderedDict()  # adapter serial -> its placed leaves, most recent last
        self._forgotten: set[int] = set()  # serials of adapters unloaded or replaced since (never kept again)
        self._kept_lock = threading.Lock()  # `_kept`, `_forgotten` (short: `forget` never waits for a pass)
        # (rows, positions, K (0: embeddings), scored positions) compiled so far
        self.shapes: set[tuple[int, int, int, int]] = set()
        self._lock = threading.Lock()  # one pass at a time (a server's handlers share one scorer)

    @classmethod
    def for_generator(cls, gen, batch_tokens: int = DEFAULT_BATCH_TOKENS) -> "Scorer":
        """Score with the weights a `generate.Generator` holds (per layer, compute dtype, its layout):
        no second copy. Tokens run through the KV-cache path of the model with an empty cache. The
        base's own leaves, and with `score(adapter=...)` a bank of that one adapter beside them
        (`Generator.adapter_params`): never the generator's bank, whose entries a server rewrites
        in place from the engine's thread."""
        config, mp = gen.config, gen.mp

        def forward(params, tokens, positions, hidden=False):
            empty = KVCache.zeros(config, tokens.shape[0], tokens.shape[1], 0, mp, local=True)
            return gen.model.apply(params, tokens, empty, logit_positions=positions, hidden=hidden)[0]

        def adapted(params, tokens, positions, hidden=False):
            with parallel.adapter_bank(gen.solo_bank, jnp.zeros(tokens.shape[:1], jnp.int32)):
                return forward(params, tokens, positions, hidden)
        bank = None
        if gen.bank is not None:
            bank = AdapterScoring(adapted, gen.adapter_params, _bank_only(gen.param_specs))
        return cls(forward, gen.params, _base(gen.param_specs), gen.mesh, gen.rules, config.seq, gen.layout,
                   batch_tokens, prepare=_base, adapted=bank, hidden_size=config.stem().hidden_size(config.d_model),
                   labels=config.num_labels)

    @classmethod
    def for_trainer(cls, trainer, params, batch_tokens: int = DEFAULT_BATCH_TOKENS) -> "Scorer":
        """Score with a training run's current `params` (float32 master weights, stacked layers, sharded
        as training keeps them; with LoRA the adapters, joined to the trainer's frozen base)."""
        model = trainer.config.model

        def forward(p, tokens, positions, hidden=False):
            return trainer.model.apply(p, tokens, logit_positions=positions, hidden=hidden)[0]
        return cls(forward, params, trainer.model.param_specs(trainer.rules),
                   trainer.mesh, trainer.rules, model.seq, batch_tokens=batch_tokens,
                   prepare=lambda p: trainer.policy(p, trainer.base),
                   hidden_size=model.stem().hidden_size(model.d_model), labels=model.num_labels)

    def use(self, params) -> None:
        """Score with `params` from now on (e.g. a training run's newer ones); the programs stay compiled."""
        self.params = self._prepare(params)

    # ---- host API ---------------------------------------------------------------------------

    def score(self, prompts: Seq[Seq[int]], top: int = 1, rows: Optional[int] = None,
              tail: Optional[Seq[int]] = None, adapter=None) -> list[PromptScores]:
        """Scores of each prompt, in the order given. A prompt of L tokens (1 <= L <= seq + 1) runs
        its first L-1 tokens through the model and scores its last L-1 (with `tail`, its last
        tail[i] only: 1 <= tail[i] <= L-1; the returned arrays then have tail[i] entries).

        `top` (1..5): how many most likely tokens to report per position. `rows`: at most this many
        prompts per forward pass (default: as many as `batch_tokens` allows). `adapter` (a
        `lora.ServedAdapter` of the generator's bank; None: the base): the LoRA adapter every
        prompt runs with."""
        self._check_adapter(adapter)
        if self.labels:
            raise ValueError(f"a classifier ({self.labels} labels) has no language-model head to score tokens "
                             f"with: classify its prompts")
        if not 1 <= top <= TOP_LOGPROBS:
            raise ValueError(f"top must be in [1, {TOP_LOGPROBS}], got {top}")
        for p in prompts:
            if not 1 <= len(p) <= self.seq + 1:
                raise ValueError(f"a prompt to score has {len(p)} tokens; it needs 1 to {self.seq + 1} "
                                 f"(the context is {self.seq})")
        if tail is not None:
            if len(tail) != len(prompts):
                raise ValueError(f"tail has {len(tail)} entries for {len(prompts)} prompts")
            for p, n in zip(prompts, tail):
                if not 1 <= n <= len(p) - 1:
                    raise ValueError(f"tail {n} for a prompt of {len(p)} tokens: it must be 1 to {len(p) - 1}")
        k = 1 if top == 1 else TOP_LOGPROBS
        empty = PromptScores(np.zeros(0, np.float32), np.zeros((0, top), np.int32), np.zeros((0, top), np.float32))
        out: list[PromptScores] = [empty] * len(prompts)
        for t, group in self._groups([len(p) - 1 for p in prompts], rows):
            scored = self._pass([prompts[i] for i in group], t, k, [tail[i] for i in group] if tail else None,
                                adapter)
            for i, (logprob, ids, values) in zip(group, scored):
                out[i] = PromptScores(logprob, ids[:, :top], values[:, :top])
        return out

    def embed(self, prompts: Seq[Seq[int]], pooling: str = "last", normalize: bool = True,
              rows: Optional[int] = None, adapter=None) -> np.ndarray:
        """[len(prompts), D] float32: each prompt's (1 to seq tokens) final hidden states pooled as
        `POOLINGS[pooling]` says, L2-normalised with `normalize` (torch's `F.normalize`). `rows` and
        `adapter` as in `score`. Batched as `score` batches (right-padded: causal attention keeps
        padding out of every real position's state)."""
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        self._check_adapter(adapter)
        self._check_lengths(prompts, "embed")
        return self._pooled(prompts, rows, lambda group, t: self._embed_pass(group, t, pooling, normalize, adapter))

    def classify(self, prompts: Seq[Seq[int]], rows: Optional[int] = None, adapter=None) -> np.ndarray:
        """[len(prompts), labels] float32: a classifier's scores (its score head's logits, before any
        softmax; a reward model's one reward) at each prompt's (1 to seq tokens) last token, as
        transformers' ForSequenceClassification reads them. `rows` and `adapter` as in `score`;
        batched as `embed` batches."""
        if not self.labels:
            raise ValueError("a language model has no score head: only a classifier (num_labels > 0) classifies")
        self._check_adapter(adapter)
        self._check_lengths(prompts, "classify")
        return self._pooled(prompts, rows, lambda group, t: self._classify_pass(group, t, adapter))

    def _check_lengths(self, prompts: Seq[Seq[int]], what: str) -> None:
        for p in prompts:
            if not 1 <= len(p) <= self.seq:
                raise ValueError(f"a prompt to {what} has {len(p)} tokens; it needs 1 to {self.seq} "
                                 f"(the context is {self.seq})")

    def _pooled(self, prompts: Seq[Seq[int]], rows: Optional[int], one_pass: Callable) -> np.ndarray:
        """[len(prompts), width]: `one_pass(prompts of a group, T)` -> their rows, over `_groups`, in order."""
        out: list[Optional[np.ndarray]] = [None] * len(prompts)
        for t, group in self._groups([len(p) for p in prompts], rows):
            for i, vector in zip(group, one_pass([prompts[i] for i in group], t)):
                out[i] = vector
        return np.stack(out) if out else np.zeros((0, 0), np.float32)

    def _groups(self, lengths: Seq[int], rows: Optional[int]):
        """(positions T, the prompts of one pass) over the prompts of these lengths (those > 0), the
        longest first: T four sizes per power of two, rows as many as `batch_tokens` (and `rows`)
        allow, a power of two."""
        order = sorted((i for i in range(len(lengths)) if lengths[i] > 0), key=lambda i: -lengths[i])
        start = 0
        while start < len(order):
            t = fine_bucket(lengths[order[start]])
            limit = max(1, min(rows or len(order), self.batch_tokens // t))
            n = min(1 << (limit.bit_length() - 1), len(order) - start)  # full groups: a power of two
            yield t, order[start:start + n]
            start += n

    def _pass(self, prompts: list[Seq[int]], t: int, k: int, tail: Optional[list[int]] = None,
              adapter=None) -> list[tuple]:
        """One forward pass: each prompt's inputs (all but its last token) right-padded to `t`
        positions, its targets (all but its first); rows bucketed. Logits at every position, or with
        `tail` only at each row's last `s` input positions (s: the bucket of the longest tail; a
        shorter row repeats position 0, never returned)."""
        n = round_up(bucket(len(prompts), 1), self.dp)
        tokens = np.zeros((n, t), np.int32)
        targets = np.zeros((n, t), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p) - 1] = p[:-1]
            targets[i, :len(p) - 1] = p[1:]
        if tail is None:
            s = t
            positions = np.broadcast_to(np.arange(t, dtype=np.int32), (n, t))
            keep = [slice(0, len(p) - 1) for p in prompts]
        else:
            s = min(bucket(max(tail), 1), t)
            ends = np.array([len(p) - 1 for p in prompts] + [s] * (n - len(prompts)))
            positions = np.maximum(ends[:, None] - s + np.arange(s), 0).astype(np.int32)  # [n, s]
            keep = [slice(s - m, s) for m in tail]
        self.shapes.add((n, t, k, s))
        logprob, ids, top = self._run((k,), adapter, tokens, np.take_along_axis(targets, positions, axis=1), positions)
        return [(logprob[i, r], ids[i, r], top[i, r]) for i, r in enumerate(keep)]

    def _embed_pass(self, prompts: list[Seq[int]], t: int, pooling: str, normalize: bool, adapter=None) -> np.ndarray:
        """One forward pass of `prompts` right-padded to `t` positions (rows bucketed) -> [len, D]: the
        hidden states at each row's pooled positions (its last, its first, or all T), weighted (1 on
        the prompt's own positions, 0 on padding) and averaged."""
        tokens, lengths = self._right_padded(prompts, t)
        n = len(tokens)
        if pooling == "mean":
            positions = np.broadcast_to(np.arange(t, dtype=np.int32), (n, t))
            weights = (positions < lengths[:, None]).astype(np.float32)
        else:
            positions = (lengths - 1 if pooling == "last" else np.zeros(n, np.int32))[:, None].astype(np.int32)
            weights = np.ones((n, 1), np.float32)
        self.shapes.add((n, t, 0, positions.shape[1]))
        return self._run(("embed", normalize), adapter, tokens, positions, weights)[:len(prompts)]

    def _classify_pass(self, prompts: list[Seq[int]], t: int, adapter=None) -> np.ndarray:
        """One forward pass of `prompts` right-padded to `t` positions (rows bucketed) -> [len, labels]:
        the score head at each row's last token."""
        tokens, lengths = self._right_padded(prompts, t)
        self.shapes.add((len(tokens), t, 0, 1))
        return self._run(("classify",), adapter, tokens, (lengths - 1)[:, None])[:len(prompts)]

    def _run(self, program: tuple, adapter, *arrays):
        """The compiled `program` (its key without the adapter flag) on `arrays`, under `adapter`'s
        leaves joined to the base (None: the base alone), one pass at a time -> host arrays."""
        with self._lock:
            params = self.params if adapter is None else _joined(self.params, self._adapter_leaves(adapter))
            return jax.device_get(self._programs[(*program, adapter is not None)](params, *arrays))

    def _right_padded(self, prompts: list[Seq[int]], t: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [n, t] int32, lengths [n] int32): the prompts right-padded with 0s, in n rows (their
        count bucketed, a multiple of dp; padding rows of one token)."""
        n = round_up(bucket(len(prompts), 1), self.dp)
        tokens = np.zeros((n, t), np.int32)
        lengths = np.ones(n, np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
            lengths[i] = len(p)
        return tokens, lengths

    def _check_adapter(self, adapter) -> None:
        if adapter is not None and self._adapted is None:
            raise ValueError(f"adapter {adapter.name!r}: this scorer has no served adapters (a generator "
                             f"without a bank, or a training run's params)")

    def forget(self, serial: int) -> None:
        """Drop the placed leaves kept for the adapter of this load (it was unloaded or replaced), and
        keep none of it again (a pass already under way still finishes with it). Never waits for a
        scoring pass: the server calls this on its event loop."""
        with self._kept_lock:
            self._kept.pop(serial, None)
            self._forgotten.add(serial)

    def _adapter_leaves(self, adapter) -> dict:
        """`adapter`'s placed leaves: kept for the last `ADAPTERS_KEPT` adapters, by load (serial).
        (Under the pass lock, so placed by one pass at a time.)"""
        with self._kept_lock:
            if adapter.serial in self._kept:
                self._kept.move_to_end(adapter.serial)
                return self._kept[adapter.serial]
        leaves = self._adapted.params(adapter)
        with self._kept_lock:
            if adapter.serial not in self._forgotten:
                self._kept[adapter.serial] = leaves
                while len(self._kept) > ADAPTERS_KEPT:
                    self._kept.popitem(last=False)
        return leaves



def _base(tree) -> dict:
    """A generator's per-layer params (or their specs) without the leaves of an adapter bank."""
    return {m: {n: x for n, x in own.items() if not parallel.is_adapter(n)} for m, own in tree.items()}


def _bank_only(tree) -> dict:
    """A generator's per-layer params (or their specs): the leaves of its adapter bank alone."""
    banks = {m: {n: x for n, x in own.items() if parallel.is_adapter(n)} for m, own in tree.items()}
    return {m: bank for m, bank in banks.items() if bank}


def _joined(base: dict, more: dict) -> dict:
    """{module: {leaf}} trees joined, module by module."""
    return {m: {**base.get(m, {}), **more.get(m, {})} for m in {**base, **more}}


_SCORERS: "weakref.WeakKeyDictionary[Any, Scorer]" = weakref.WeakKeyDictionary()


def forget_adapter(gen, serial: int) -> None:
    """The adapter of this load is gone from `gen`'s server: its scorer, if it has made one, drops
    the device copy it keeps of that adapter's leaves."""
    scorer = _SCORERS.get(gen)
    if scorer is not None:
        scorer.forget(serial)


def scorer_for(gen) -> Scorer:
    """The one Scorer over a Generator's weights (made on first use and shared by every caller, so
    its compiled programs are too)."""
    if gen not in _SCORERS:
        _SCORERS[gen] = Scorer.for_generator(gen)
    return _SCORERS[gen]
