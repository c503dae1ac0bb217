"""Structured outputs: text that must match a JSON schema, a regular expression, one of a list of
strings or a Lark/GBNF grammar (OpenAI's `response_format`, vLLM's `structured_outputs`).

llguidance (the grammar engine behind vLLM's `guidance` backend and llama.cpp's) keeps one parser
per row on the host; before each step it writes the tokens that keep the text inside the grammar as
a bitmask (bit t of word t // 32 for token t), and the decode step sets every other logit to -inf
(`sampling.constrain`), so the sampler, greedy or not, picks among the allowed tokens only.

    Grammar.json_schema({"type": "object", ...})   Grammar.regex(r"\\d{3}")   Grammar.choice(["yes", "no"])
"""
from __future__ import annotations

import dataclasses
import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence as Seq

import numpy as np

KINDS = ("json", "json_object", "regex", "choice", "grammar")
ANY_JSON = {"type": ["object", "array", "string", "number", "integer", "boolean", "null"]}
JSON_OBJECT = {"type": "object"}
JSON_DUMPS = (", ", ": ")  # Python's json.dumps separators (item, key), as transformers' `tojson` writes JSON


@dataclass(frozen=True)
class Grammar:
    """What a row's text must match. `spec`: the JSON schema (as JSON text), the regex, the choices
    (a JSON list of strings) or the Lark/GBNF grammar text. `any_whitespace`: JSON may put any
    whitespace between its tokens (vLLM's default); False: none (`{"a":1,"b":[2,3]}`), which also
    keeps a small model from spending its tokens on blank space, or exactly `separators` (item, key)
    where given: `JSON_DUMPS`'s `{"a": 1, "b": [2, 3]}` is the layout chat templates write calls in."""

    kind: str
    spec: str
    any_whitespace: bool = True
    separators: Optional[tuple[str, str]] = None
    thinking: tuple = ()  # (opener, closer, their tokens, a budget): free text first (`after_thinking`)

    @classmethod
    def json_schema(cls, schema: dict | str, any_whitespace: bool = True,
                    separators: Optional[tuple[str, str]] = None) -> "Grammar":
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema), any_whitespace and not separators,
                   separators)

    @classmethod
    def json_object(cls, any_whitespace: bool = True) -> "Grammar":
        """Any JSON object (OpenAI's `{"type": "json_object"}`)."""
        return cls("json_object", json.dumps(JSON_OBJECT), any_whitespace)

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Seq[str]) -> "Grammar":
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def lark(cls, grammar: str) -> "Grammar":
        """A Lark grammar (llguidance's dialect), or a GBNF one (llama.cpp's `root ::= ...`), converted."""
        return cls("grammar", grammar)

    def after_thinking(self, closer: str, opener: str = "", closer_id: int = -1, opener_id: int = -1,
                       budget: int = 0) -> "Grammar":
        """This grammar after a reasoning model's thinking: free text up to the first `closer` (e.g.
        "</think>") and any blank space, then this grammar. With `opener`, the thinking is optional
        and, when there, starts with it (a reply that may open its own block); without, the reply
        starts inside the block (its template opened it in the prompt). `closer_id` / `opener_id`:
        the marker's own token where the tokenizer has one (llguidance takes an added `<..>` token
        for a special one, which its text alone does not match); else the marker is text. `budget`
        (with a `closer_id`): the thinking's tokens at most, the closer forced after them."""
        if budget and closer_id < 0:
            raise ValueError("a thinking budget needs the closer as a token of its own (its text may be split)")
        return dataclasses.replace(self, thinking=(opener, closer, opener_id, closer_id, budget))

    def source(self) -> str:
        """The grammar as llguidance takes it; ValueError naming what is wrong with the spec itself."""
        if not self.thinking:
            return self._source()
        inner = self._source()  # llguidance's grammar list (the first is the start), or Lark text
        top = json.loads(inner) if inner.lstrip().startswith("{") else {"grammars": [{"lark_grammar": inner}]}
        top["grammars"][0]["name"] = "answer"
        opener, closer, opener_id, closer_id, budget = self.thinking
        marker = lambda text, token: f"<[{token}]>" if token >= 0 else json.dumps(text)  # noqa: E731
        lazy = "" if closer_id >= 0 else "[lazy]"  # text: up to the first closer; a token ends TEXT itself
        opening = f"{marker(opener, opener_id)} " if opener else ""
        # a budget caps the thought's tokens (llguidance's max_tokens on a lexeme's rule): the closer must follow
        thought = ("thought", f"thought[max_tokens={budget}]: /(.|\\n)*/") if budget else ("TEXT", "")
        lark = "\n".join(("%llguidance {}", f"start: {'(think GAP)?' if opener else 'think GAP'} @answer",
                          f"think{lazy}: {opening}{thought[0]} {marker(closer, closer_id)}", thought[1],
                          "TEXT: /(.|\\n)*/", "GAP: /[ \\t\\r\\n]*/", ""))
        return json.dumps({**top, "grammars": [{"name": "thinking", "lark_grammar": lark}, *top["grammars"]]})

    def _source(self) -> str:
        import llguidance
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind in ("json", "json_object"):
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
            layout = {} if self.any_whitespace else {"whitespace_flexible": False}
            if self.separators:
                layout.update(item_separator=self.separators[0], key_separator=self.separators[1])
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=layout or None)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choices must be a non-empty list of non-empty strings")
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(self.spec))
        except Exception as e:  # noqa: BLE001 - the GBNF converter's own complaint
            raise ValueError(f"the grammar cannot be read ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------------------------
# The host side: one parser per row
# --------------------------------------------------------------------------------------------

_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # HF tokenizer -> {vocab: Compiler}
KEPT_GRAMMARS = 64  # compiled grammars kept per tokenizer (a request's n choices, repeated schemas)
_LOCK = threading.Lock()  # request threads, the engine's and its start-up thread share the caches


class Compiler:
    """llguidance's view of one Hugging Face fast tokenizer with `vocab` ids (the model's padded
    vocabulary; ids past the tokenizer's are never allowed), and the grammars compiled for it:
    each once, every row getting a copy of the fresh parser. Building the view takes about a
    second for a 128k vocabulary: `compiler` keeps one per tokenizer and vocabulary."""

    def __init__(self, tokenizer, vocab: int):
        import llguidance.hf
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"structured outputs need a fast (Rust) Hugging Face tokenizer; this one is "
                             f"{type(tokenizer).__name__}")
        size = max(vocab, backend.get_vocab_size(with_added_tokens=True))
        # The grammar's end needs an id of the tokenizer's own (rows end at their own ids, which take
        # its place in the mask): its EOS, else a special token (else llguidance takes id 0, which
        # then never appears in a guided text).
        specials = list(getattr(tokenizer, "all_special_ids", None) or [])
        end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else (specials or [None])[0]
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=size, eos_token=end)
        self.vocab = vocab
        self._parsers: OrderedDict = OrderedDict()

    def parser(self, grammar: Grammar):
        """A fresh parser of `grammar`; ValueError with llguidance's message if it does not compile."""
        import llguidance
        with _LOCK:
            fresh = self._parsers.get(grammar)
            if fresh is not None:
                self._parsers.move_to_end(grammar)
        if fresh is None:  # compiled outside the lock (llguidance lets other threads run meanwhile)
            fresh = llguidance.LLMatcher(self.tokenizer, grammar.source(), log_level=0)
            if fresh.is_error():
                raise ValueError(fresh.get_error().strip())
            with _LOCK:
                self._parsers[grammar] = fresh
                while len(self._parsers) > KEPT_GRAMMARS:
                    self._parsers.popitem(last=False)
        return fresh.deep_copy()


def compiler(tokenizer, vocab: int) -> Compiler:
    """The Compiler of `tokenizer` for `vocab` ids, built on first use (one at a time)."""
    if tokenizer is None:
        raise ValueError("structured outputs need the model's tokenizer")
    with _LOCK:
        kept = _COMPILED.setdefault(tokenizer, {})
        if vocab not in kept:
            kept[vocab] = Compiler(tokenizer, vocab)
        return kept[vocab]


def check(grammar: Grammar, tokenizer, vocab: int) -> None:
    """ValueError naming what is wrong when `grammar` cannot be compiled for this tokenizer. Its
    first mask is computed too: llguidance builds the lexer for it then (once for all copies, up to
    tenths of a second for a big grammar), here rather than in the decode loop."""
    Constraint(grammar, tokenizer, vocab, ()).fill(no_mask(1, vocab)[0])


def mask_words(vocab: int) -> int:
    """32-bit words of one row's bitmask."""
    return (vocab + 31) // 32


class Constraint:
    """One row's parser: the tokens allowed next (`fill`), advanced by the tokens sampled (`advance`).

    The grammar's own end is the tokenizer's EOS; the row's end-of-text ids (`eos_ids`: a generation
    config's several, or none under `ignore_eos`) stand in for it in the mask, so the row ends as any
    row does. A grammar that admits nothing more ends the row on the host (`done`), as does one
    that leaves a row no token (`fill` says so: the grammar is complete and the row has no end id,
    or it allows only ids past the model's vocabulary)."""

    def __init__(self, grammar: Grammar, tokenizer, vocab: int, eos_ids: Seq[int]):
        found = compiler(tokenizer, vocab)
        self.tokenizer, self.matcher = found.tokenizer, found.parser(grammar)
        self.vocab, self.eos_ids = vocab, tuple(eos_ids)

    @property
    def done(self) -> bool:
        """Nothing but the end may follow (or the parser failed: see `error`)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the parser failed (a token it did not allow was fed to it), or ""."""
        return self.matcher.get_error() if self.matcher.is_error() else ""

    def end_reason(self) -> str:
        """The finish reason of a row its grammar leaves no token: "stop" where the text is complete."""
        return "stop" if self.matcher.is_accepting() and not self.matcher.is_error() else "error"

    def advance(self, tokens: Seq[int]) -> None:
        """Feed the row's new tokens (an end-of-text id, which ends the row, is not fed)."""
        self.matcher.consume_tokens([int(t) for t in tokens if int(t) not in self.eos_ids])

    def fill(self, out: np.ndarray) -> bool:
        """Write the allowed next tokens into `out` [mask_words(vocab)] int32; False if the row cannot
        go on: nothing but the end may follow (the row ends on the host, as at `done`), the grammar
        allows only ids past the model's vocabulary, or llguidance failed (`error`)."""
        import llguidance.numpy as lgnp
        words = lgnp.allocate_token_bitmask(1, self.tokenizer.vocab_size)
        lgnp.fill_next_token_bitmask(self.matcher, words, 0)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab]
        ends = [t for t in self.tokenizer.eos_tokens if t < self.vocab]
        may_end = any(bits[t] for t in ends) or self.matcher.is_accepting()
        bits[ends] = 0
        if not bits.any() or self.matcher.is_error():
            return False
        if may_end:
            bits[[t for t in self.eos_ids if t < self.vocab]] = 1
        out[:] = 0
        out.view(np.uint8)[: (len(bits) + 7) // 8] = np.packbits(bits, bitorder="little")
        return True


def allowed(words, vocab: int):
    """[B, W] int32 bitmasks -> [B, vocab] bool (device side)."""
    import jax
    import jax.numpy as jnp
    bytes_ = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(words.shape[0], -1)  # little-endian words
    return jnp.unpackbits(bytes_, axis=-1, bitorder="little")[:, :vocab].astype(bool)


def no_mask(rows: int, vocab: int) -> np.ndarray:
    return np.zeros((rows, mask_words(vocab)), np.int32)


def first_masks(constraints: Seq[Optional[Constraint]], rows: int, vocab: int) -> tuple[np.ndarray, list[bool]]:
    """[rows, W]: each constrained row's mask for its first token (zeros elsewhere: not read), and
    whether each row has a token to choose (`Constraint.fill`)."""
    masks = no_mask(rows, vocab)
    return masks, [c is None or c.fill(masks[i]) for i, c in enumerate(constraints)]
