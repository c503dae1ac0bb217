"""Batching on the host: which request is in which row of a decode batch, its text and stop strings.

`Sequence` is one request as it arrives (prompt, options, output so far, text that is final);
`Batch` fills and empties the rows of one `DecodeState` as sequences come and go, so a server can
add requests while others decode.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from typing import TYPE_CHECKING, Optional, Sequence as Seq

import jax
import numpy as np

from mesh_transformer import lora
from mesh_transformer.generate import structured
from mesh_transformer.generate.decode import Emitted, bucket, prefill_width, round_up, shared_layout, span_bucket
from mesh_transformer.generate.sampling import FINISH_REASONS, SamplingOptions

if TYPE_CHECKING:
    from mesh_transformer.generate.decode import Generator
    from mesh_transformer.generate.prefix import PrefixCache

log = logging.getLogger("mesh_transformer.generate")

# --------------------------------------------------------------------------------------------
# One request on the host: prompt, output so far, text and stop strings
# --------------------------------------------------------------------------------------------

class Sequence:
    """A prompt and its continuation as it arrives.

    The prompt is cut from the left to fit `context - max_new_tokens` (`truncated` says how many
    tokens went). With a tokenizer, stop strings end the sequence and `pop_text` gives the text
    that is final so far (never a partial stop string or a partial UTF-8 character). `lora`: the
    LoRA adapter it runs with (a `lora.ServedAdapter`; None: the base alone), `adapter` the entry of
    the generator's bank holding it (a server assigns it when it admits the sequence). With
    `options.grammar`, `constraint` keeps its tokens inside the grammar (made here given `vocab`,
    the model's padded vocabulary, so a request's thread compiles it; else when a batch admits
    it); the text ends when the grammar admits nothing more.
    """

    def __init__(self, prompt: Seq[int], options: SamplingOptions, context: int, tokenizer=None,
                 deadline: Optional[float] = None, adapter: int = 0, lora=None, vocab: Optional[int] = None):
        options.validate(context)
        if len(prompt) == 0:
            raise ValueError("the prompt is empty (it needs at least one token)")
        if options.grammar is not None and tokenizer is None:
            raise ValueError("a grammar (structured output) needs the tokenizer")
        keep = context - options.max_new_tokens
        self.truncated = max(0, len(prompt) - keep)
        self.prompt = [int(t) for t in prompt[self.truncated:]]
        self.tokenizer = tokenizer
        if tokenizer is not None and options.stop:
            extra = tuple(tuple(tokenizer.encode(s)) for s in options.stop)
            options = dataclasses.replace(options, stop_token_ids=options.stop_token_ids + extra)
        self.options = options
        self.seed = options.seed % 2**32 if options.seed is not None else secrets.randbits(32)
        self.deadline = deadline
        self.adapter, self.lora = adapter, lora
        self.constraint: Optional[structured.Constraint] = None
        if vocab is not None:
            self.constrain(vocab)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []  # with options.logprobs set: log p of each token
        self.top_logprobs: list[list[tuple[int, float]]] = []  # and the options.logprobs most likely (id, log p)
        self.finish_reason: Optional[str] = None
        self.cached_tokens = 0  # of the prompt, read from the prefix cache rather than computed (set when admitted)
        self.cancelled = False
        self._text_end: Optional[int] = None  # where a stop string cut the text
        self._stop: Optional[str] = None  # and which one
        self._min_text: Optional[int] = None  # characters of the first min_new_tokens tokens (`_stops_from`)
        self._sent = 0

    def constrain(self, vocab: int) -> None:
        """Make the parser of `options.grammar` (if any, once) for a model of `vocab` (padded) ids;
        ValueError if it cannot be."""
        if self.options.grammar is not None and self.constraint is None:
            self.constraint = structured.Constraint(self.options.grammar, self.tokenizer, vocab, self.options.eos_ids)

    def end_by_grammar(self) -> None:
        """Finish: the grammar leaves no token to choose ("stop" where the text is complete)."""
        reason = self.constraint.end_reason()
        if reason == "error":
            log.error("a guided row cannot go on: %s",
                      self.constraint.error or "its grammar allows only ids past the model's vocabulary")
        self.finish(reason)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def extend(self, tokens, logprobs, top_ids, top_logprobs) -> None:
        """Append emitted tokens (already filtered to real ones), and their log-probabilities if the
        options asked for them; check stop strings."""
        self.tokens.extend(int(t) for t in tokens)
        if self.options.logprobs is not None:
            n_top = self.options.logprobs
            self.logprobs.extend(float(lp) for lp in logprobs)
            self.top_logprobs.extend([(int(i), float(p)) for i, p in zip(ids[:n_top], lps[:n_top])]
                                     for ids, lps in zip(top_ids, top_logprobs))
        if self.constraint is not None and len(tokens):
            self.constraint.advance(tokens)
            if self.constraint.error:  # a token outside the grammar: a bug, not the request's fault
                log.error("a guided row left its grammar: %s", self.constraint.error)
                self.finish("error")
            elif self.constraint.done:
                self.finish("stop")
        if self.tokenizer is not None and self.options.stop and tokens is not None and len(tokens) and \
                len(self.tokens) >= self.options.min_new_tokens:
            found = _find_stop(self._decoded(), self.options.stop, self._stops_from())
            if found is not None:
                self._text_end, self._stop = found
                self.finish_reason = "stop"

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason

    def _text_tokens(self) -> list[int]:
        eos = self.options.eos_ids  # EOS ends a row, so it can only be the last token
        return self.tokens[:-1] if self.tokens and self.tokens[-1] in eos else self.tokens

    def _decoded(self) -> str:
        return self.tokenizer.decode(self._text_tokens())

    def _stops_from(self) -> int:
        """Where in the text a stop string may end at the earliest: after the text of the first
        min_new_tokens tokens (vLLM's min_tokens holds stop strings back too)."""
        if self.options.min_new_tokens == 0:
            return 0
        if self._min_text is None:
            self._min_text = len(self.tokenizer.decode(self.tokens[:self.options.min_new_tokens]))
        return self._min_text

    def _cut(self, decoded: str) -> Optional[int]:
        """Where a stop string cut the `decoded` text: found as tokens arrived, or, once finished,
        where a stop the device saw starts."""
        if self._text_end is None and self.finished and self.options.stop:
            self._text_end, self._stop = _find_stop(decoded, self.options.stop, self._stops_from()) or (None, None)
        return self._text_end

    @property
    def text(self) -> str:
        """The completion text (without EOS or the stop string); needs a tokenizer."""
        text = self._decoded()
        end = self._cut(text)
        return text if end is None else text[:end]

    @property
    def stop_string(self) -> Optional[str]:
        """The stop string that ended the text (None: it ended otherwise, or has not; `_find_stop`)."""
        self._cut(self._decoded())
        return self._stop

    @property
    def adapter_key(self) -> int:
        """What a prefix cache keys its prompt by (`lora.prefix_key`)."""
        return lora.prefix_key(self.lora)

    def pop_text(self) -> str:
        """Text that became final since the last call (for streaming)."""
        text = self.text
        end = len(text)
        if not self.finished:
            end = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character may still complete
            for s in self.options.stop:  # hold back what could be the start of a stop string
                for k in range(min(len(s) - 1, end), 0, -1):
                    if text[:end].endswith(s[:k]):
                        end -= k
                        break
        delta = text[self._sent:max(end, self._sent)]
        self._sent = max(end, self._sent)
        return delta

    def kept_tokens(self) -> int:
        """How many output tokens make up `text` (tokens after a stop string's start are dropped)."""
        if self._text_end is None or self.tokenizer is None:
            return len(self._text_tokens())
        for i in range(len(self.tokens)):
            if len(self.tokenizer.decode(self.tokens[: i + 1])) > self._text_end:
                return i + (len(self.tokenizer.decode(self.tokens[:i])) < self._text_end)
        return len(self.tokens)


def _find_stop(text: str, stops: Seq[str], ends_after: int = 0) -> Optional[tuple[int, str]]:
    """(where it starts in `text`, which) of the stop string that ends the text (None: none does): of
    those ending after character `ends_after`, the one complete first as the text grows (the earliest
    end; of two ending together, the earlier start). So where a long stop string holds a short one,
    the cut does not depend on how many tokens arrive at once: stops "ab c" and "b" cut "ab cd" after "a"."""
    hits = [(i + len(s), i, s) for s, i in ((s, text.find(s, max(0, ends_after - len(s) + 1))) for s in stops)
            if i >= 0]
    return min(hits)[1:] if hits else None


# --------------------------------------------------------------------------------------------
# Batch: the host side of one DecodeState (which sequence is in which row)
# --------------------------------------------------------------------------------------------

class Batch:
    """Rows of one DecodeState, filled and emptied as sequences come and go.

    All rows share the cache's write index. A group of prompts can join when, after moving the
    batch to a new index I (`Generator.move`), every prompt fits in slots [I - length, I) and every
    row still running has room for its remaining tokens in [I, S). With a `prefix` cache, prompts
    reuse the keys and values of blocks earlier prompts stored there (see `prefix`), and with
    `share_prefix` their rows go on reading those blocks from the pool as they decode: every decode
    call reads the union of the running rows' blocks once for all of them (at most S slots; an
    admission that would pass that copies its blocks into its rows' own slots instead).

    A decode call computes rows 0 .. the last running one, bucketed (the lowest free rows fill
    first), so 3 requests in a 64-row batch cost 4 rows, not 64. The matmuls' float rounding then
    depends on that count (XLA:CPU picks kernels by shape), so a greedy answer can differ from the
    same request's answer alone where two tokens are within rounding of each other, as in vLLM.
    `batch_invariant`: every call computes all rows, so a request's tokens are bit-identical
    whatever else runs (slower when few rows run; not with a speculating generator).
    """

    def __init__(self, generator: Generator, rows: int, slots: int, chunk: Optional[int] = 16,
                 prefix: Optional[PrefixCache] = None, batch_invariant: bool = False, share_prefix: bool = True):
        if batch_invariant and generator.speculate:
            raise ValueError("batch_invariant with a speculating generator: a request's passes, and so its "
                             "rounding, would depend on whether it ran alone (speculate_rows) and on its drafts")
        self.gen = generator
        self.size, self.slots = round_up(max(rows, generator.min_rows), generator.dp), slots
        self.chunk = chunk
        self.prefix = prefix
        self.batch_invariant = batch_invariant
        self.share_prefix = share_prefix
        self.state = generator.new_state(self.size, slots)
        self.rows: list[Optional[Sequence]] = [None] * self.size
        self.start = [0] * self.size  # first valid slot of each row (host copy)
        self.reads = [np.zeros(0, np.int32)] * self.size  # pool slots each row reads (its first positions)
        self.index = 0
        self._retire: set[int] = set()

    @classmethod
    def for_sequences(cls, gen: Generator, seqs: Seq[Sequence], chunk: Optional[int]) -> "Batch":
        """A batch just big enough for `seqs` all at once (bucketed shapes)."""
        longest = max(len(s.prompt) for s in seqs)
        new = bucket(max(s.options.max_new_tokens for s in seqs))
        slots = max(bucket(longest + new), longest + new + gen.speculate)  # (drafts' slots past the last token)
        return cls(gen, bucket(len(seqs), 1), slots, chunk or new)

    def active(self) -> list[int]:
        return [r for r, s in enumerate(self.rows) if s is not None]

    def free(self) -> list[int]:
        return [r for r, s in enumerate(self.rows) if s is None]

    def plan(self, seqs: Seq[Sequence]) -> Optional[int]:
        """The write index after admitting `seqs`, or None if they do not fit now."""
        if not seqs or len(seqs) > len(self.free()):
            return None
        active = self.active()
        longest = max(len(s.prompt) for s in seqs)
        need = max([s.options.max_new_tokens - 1 for s in seqs] +
                   [self.rows[r].options.max_new_tokens - len(self.rows[r].tokens) for r in active])
        need += self.gen.speculate  # a pass writes the draft's slots past the tokens it keeps
        if active and self.index >= longest and self.index + need <= self.slots:
            return self.index  # no move needed
        in_use = self.index - self._first_slot(active) if active else 0
        # a bucketed index: later prompts a little longer join without a move, and a move's span
        # (bucketed the same way) lands at slot 0 or after
        for index in (max(span_bucket(longest), span_bucket(in_use)), max(longest, in_use)):
            if index + need <= self.slots:
                return index
        return None

    def uncached(self, seq: Sequence) -> int:
        """The tokens of `seq`'s prompt an admission now would compute (not in the prefix cache)."""
        return len(seq.prompt) - (self.prefix.cached_tokens(seq.prompt, seq.adapter_key) if self.prefix is not None else 0)

    def prefill_tokens(self, n: int, uncached: int) -> int:
        """Token positions the prefill of `n` prompts computes when the longest part not in the
        prefix cache is `uncached` tokens (both bucketed, as `Generator.admit` pads them)."""
        return self.gen.prefill_rows(n) * prefill_width(uncached)

    def admit(self, seqs: Seq[Sequence]) -> list[Sequence]:
        """Prefill `seqs` into free rows if they fit now (see `plan`); returns those already finished
        (a grammar that admits no first token finishes its sequence here, unadmitted).

        Raises ValueError if they do not fit, or if a sequence's grammar does not compile.
        """
        for s in seqs:
            s.constrain(self.gen.vocab)
        masks, startable = structured.first_masks([s.constraint for s in seqs], len(seqs), self.gen.vocab)
        ended = [s for s, ok in zip(seqs, startable) if not ok]
        for s in ended:
            s.end_by_grammar()
        seqs, masks = [s for s, ok in zip(seqs, startable) if ok], masks[np.array(startable, bool)]
        if not seqs:
            return ended
        index = self.plan(seqs)
        if index is None:
            raise ValueError("these sequences do not fit in the batch now (check `plan` first)")
        active = self.active()
        if active and index != self.index:
            self.state = self.gen.move(self.state, self._first_slot(active), self.index, index)
        self.start = [s + index - self.index for s in self.start]
        rows = self.free()[: len(seqs)]
        share = self.slots if self.share_prefix and self.prefix is not None else 0
        self.state, first, done, reason, reads, reused = self.gen.admit(
            self.state, [s.prompt for s in seqs], [s.options for s in seqs], [s.seed for s in seqs], rows, index,
            self.prefix, share, self._shared_slots(), [s.adapter for s in seqs], masks)
        self.index = index
        for r, s, read, cached in zip(rows, seqs, reads, reused):
            self.rows[r] = s
            s.cached_tokens = cached
            self.start[r] = index - len(s.prompt) + len(read)
            self.reads[r] = read
            if len(read):
                self.prefix.pin(read)
        return ended + self._absorb(jax.tree.map(lambda x: x[:, None], first), done, reason)

    def step(self, limit: Optional[int] = None) -> list[Sequence]:
        """Retire cancelled or timed-out rows, then one decode call of `chunk` steps (at most `limit`:
        the same compiled program stops early); returns the sequences that finished. While a row
        follows a grammar, each call is one step: its parser gives the next token's mask from the last."""
        now = time.monotonic()
        for r in self.active():
            s = self.rows[r]
            if s.cancelled or (s.deadline is not None and now > s.deadline):
                s.finish("cancelled" if s.cancelled else "timeout")
        finished = self._absorb(None, None, None)
        masks = self._next_masks()
        if masks is not None:
            finished += self._absorb(None, None, None)  # rows their grammar left no token
        if not self.active():
            return finished
        if any(self.rows[r].constraint is not None for r in self.active()):
            self.state = self.gen.constrain(self.state, masks)
            limit = 1
        self.state, out, done, reason, self.index = self.gen.decode(self.state, self.chunk, *self._window(), limit,
                                                                    shared=self._shared(), running=len(self.active()))
        return finished + self._absorb(out, done, reason)

    def _next_masks(self) -> Optional[np.ndarray]:
        """Each guided running row's mask for its next token ([B, W]; None: no row is guided); a row
        its grammar leaves no token finishes."""
        guided = [r for r in self.active() if self.rows[r].constraint is not None]
        if not guided:
            return None
        masks = structured.no_mask(self.size, self.gen.vocab)
        for r in guided:
            s = self.rows[r]
            if not s.constraint.fill(masks[r]):
                s.end_by_grammar()
        return masks

    def _shared_slots(self) -> np.ndarray:
        """The pool slots the running rows read (sorted, each once)."""
        return np.unique(np.concatenate([self.reads[r] for r in self.active()] + [np.zeros(0, np.int32)]))

    def _shared(self):
        """`Generator.decode`'s `shared` for the running rows (None: no row reads the pool)."""
        if not any(len(self.reads[r]) for r in self.active()):
            return None
        return (self.prefix.pool, *shared_layout(self.reads, self.prefix.tokens))

    def _window(self) -> tuple[int, int, int]:
        """(first slot, size, rows): the bucketed span of slots the running rows use in the next
        decode call (at least `Generator.min_window`), and the bucketed number of rows from row 0
        that holds them all."""
        active = self.active()
        first = self._first_slot(active)
        need = max(self.rows[r].options.max_new_tokens - len(self.rows[r].tokens) for r in active)
        rows = self.row_bucket(max(active) + 1)
        drafts = self.gen.speculate if self.gen.speculates(len(active), rows) else 0  # slots past the last token
        size = min(max(bucket(self.index + min(self.chunk, need) + drafts - first), self.gen.min_window(rows)),
                   self.slots)
        return min(first, self.slots - size), size, rows

    def _first_slot(self, active: list[int]) -> int:
        """The first cache slot any of the `active` rows uses."""
        return min(self.start[r] for r in active)

    def row_bucket(self, rows: int) -> int:
        """The rows a decode call computes when rows 0 .. rows-1 may be running."""
        return self.size if self.batch_invariant else min(bucket(rows, 1), self.size)

    def _absorb(self, out: Optional[Emitted], done, reason) -> list[Sequence]:
        """Hand emitted tokens [B, K] to their sequences; free the rows of finished ones."""
        finished, stopped_here = [], []
        for r in self.active():
            s = self.rows[r]
            if out is not None:
                keep = out.token[r] >= 0
                if keep.any():
                    s.extend(out.token[r][keep], out.logprob[r][keep], out.top_ids[r][keep], out.top_logprobs[r][keep])
            if done is not None and done[r]:
                s.finish(FINISH_REASONS[int(reason[r])])
            elif s.finished:  # a stop string, a timeout or a cancel: the device does not know yet
                stopped_here.append(r)
            else:
                continue
            finished.append(s)
            self.rows[r] = None
            if len(self.reads[r]):
                self.prefix.unpin(self.reads[r])
                self.reads[r] = np.zeros(0, np.int32)
        if stopped_here:
            self.state = self.gen.retire(self.state, stopped_here)
        return finished
