"""Structured outputs: text held to a JSON schema, a regex, a list of choices or a grammar.

The oracle for greedy decoding is transformers' logits with llguidance's own mask applied by hand,
one step at a time (the token the model likes best among those the grammar allows); sampled texts
are checked by `json.loads` and `jsonschema`. Over HTTP, the official openai client sends OpenAI's
`response_format` and vLLM's `structured_outputs` / `guided_*` fields, and the answers equal the
library's.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import threading
import time

import httpx
import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest

from mesh_transformer.generate import SamplingOptions
from mesh_transformer.generate.structured import JSON_DUMPS, Grammar
from mesh_transformer.serve.reasoning import ANY_ANSWER
from tests.helpers import refusal
from tests.serving import KEY, client, engine, url  # noqa: F401 - fixtures

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}
COMPACT = {"whitespace_flexible": False}
CASES = {  # (our grammar, llguidance's grammar built directly for the oracle)
    "json_schema": (Grammar.json_schema(SCHEMA, any_whitespace=False),
                    lambda: llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=COMPACT)),
    "regex": (Grammar.regex(r"[0-9]{3}-[a-z]{2,4}"), lambda: llguidance.LLMatcher.grammar_from_regex(r"[0-9]{3}-[a-z]{2,4}")),
    "choice": (Grammar.choice(["yes", "no way", 'a "q"']),
               lambda: llguidance.LLMatcher.grammar_from_lark('start: "yes" | "no way" | "a \\"q\\""')),
    "gbnf": (Grammar.lark('root ::= "x" [0-9] [0-9]? "!"'),
             lambda: llguidance.LLMatcher.grammar_from_lark('start: "x" /[0-9]/ /[0-9]/? "!"')),
}
PROMPTS = ["The lazy dog", "0123", "Pack my", "How vexingly"]


def masked_greedy(tiny, prompt: list[int], grammar: str, new: int, ends=None, min_new: int = 0,
                  bias: dict = {}) -> list[int]:  # noqa: B006 - read only
    """transformers' greedy choice among the tokens llguidance allows, until the grammar ends; where
    it allows the end, the row's own end ids `ends` (default: the tokenizer's EOS) instead, none of
    them before `min_new` tokens; `bias`: {token: added to its logit}."""
    ends = (tiny.eos,) if ends is None else ends
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tiny.tokenizer), grammar)
    out = []
    while len(out) < new and not matcher.is_stopped():
        allowed = np.frombuffer(matcher.compute_logit_bias(), np.uint8)[: len(tiny.tokenizer)] > 0
        may_end, allowed[tiny.eos] = allowed[tiny.eos], False
        allowed[list(ends)] = may_end and len(out) >= min_new
        logits = tiny.hf_logits(prompt + out)[-1][: len(tiny.tokenizer)]
        for t, b in bias.items():
            logits[t] += b
        token = int(np.argmax(np.where(allowed, logits, -np.inf)))
        out.append(token)
        if token in ends:
            break
        assert matcher.consume_token(token), matcher.get_error()
    return out


@pytest.mark.parametrize("case", CASES)
def test_greedy_under_a_grammar_is_transformers_best_allowed_token(gen, tiny, case):
    ours, oracle = CASES[case]
    ids = [tiny.tokenizer.encode(p) for p in PROMPTS]
    opts = SamplingOptions(max_new_tokens=24, temperature=0.0, eos_token_id=tiny.eos, grammar=ours)
    seqs = gen.generate(ids, opts, tiny.tokenizer)
    for prompt, seq in zip(ids, seqs):
        assert seq.tokens == masked_greedy(tiny, prompt, oracle(), 24)
        assert seq.finish_reason == "stop", (seq.text, seq.finish_reason)
    texts = [s.text for s in seqs]
    if case == "json_schema":
        for text in texts:
            jsonschema.validate(json.loads(text), SCHEMA)
    elif case == "choice":
        assert set(texts) <= {"yes", "no way", 'a "q"'}
    else:
        pattern = {"regex": r"[0-9]{3}-[a-z]{2,4}", "gbnf": r"x[0-9][0-9]?!"}[case]
        assert all(__import__("re").fullmatch(pattern, t) for t in texts), texts


def test_the_rows_own_end_ids_stand_for_the_grammars_end_and_min_tokens_holds_them(gen, tiny):
    """A generation config's end id (here the token of "Z", not the tokenizer's EOS, made likely by a
    logit bias) ends a guided row as soon as the grammar may end, and not before min_tokens."""
    z = tiny.tokenizer.encode("Z")[0]
    regex = r"[0-9]{1,4}"
    ids = [tiny.tokenizer.encode(p) for p in PROMPTS]
    for min_new in (0, 3):
        opts = SamplingOptions(max_new_tokens=12, temperature=0.0, eos_token_id=(z,), min_new_tokens=min_new,
                               logit_bias=((z, 30.0),), grammar=Grammar.regex(regex))
        oracle = llguidance.LLMatcher.grammar_from_regex(regex)
        for prompt, seq in zip(ids, gen.generate(ids, opts, tiny.tokenizer)):
            assert seq.tokens == masked_greedy(tiny, prompt, oracle, 12, ends=(z,), min_new=min_new, bias={z: 30.0})
            assert seq.finish_reason == "stop" and __import__("re").fullmatch(regex, seq.text), seq.text
            if min_new == 0:  # the first digit token makes the text complete: the biased end id comes next
                assert seq.tokens[-1] == z and len(seq.tokens) == 2
            else:  # never among the first 3 tokens (the grammar may end first, at 4 digits)
                assert z not in seq.tokens[:min_new]


def test_a_grammar_that_is_complete_with_no_end_id_finishes_on_the_host(gen, tiny):
    """Without end ids (`ignore_eos`), a finished grammar ends the row where EOS would have; one
    that admits only the empty text ends it before any token."""
    ids = [tiny.tokenizer.encode(p) for p in PROMPTS]
    seqs = gen.generate(ids, [SamplingOptions(max_new_tokens=12, temperature=0.0, grammar=Grammar.regex(r))
                              for r in ("", "ab", "a|b", "")], tiny.tokenizer)
    assert [s.finish_reason for s in seqs] == ["stop"] * 4
    assert [s.text for s in seqs[:2]] == ["", "ab"] and seqs[2].text in ("a", "b") and seqs[0].tokens == []
    # with end ids but min_tokens: the end may not be chosen yet and nothing else may follow
    [held] = gen.generate(ids[:1], SamplingOptions(max_new_tokens=12, temperature=0.0, eos_token_id=tiny.eos,
                                                   min_new_tokens=2, grammar=Grammar.regex("x")), tiny.tokenizer)
    assert (held.text, held.finish_reason) == ("x", "stop") and held.tokens == tiny.tokenizer.encode("x")


def test_a_tokenizer_without_an_eos_ends_its_grammar_at_a_special_token(tiny):
    import copy
    from mesh_transformer.generate import structured
    bare = copy.deepcopy(tiny.tokenizer)
    bare.add_special_tokens({"pad_token": "<pad>"})
    bare.eos_token = None
    pad = bare.pad_token_id
    assert bare.eos_token_id is None and pad not in (None, 0)  # llguidance's own fallback would be 0
    assert structured.Compiler(bare, 384).tokenizer.eos_token in bare.all_special_ids
    c = structured.Constraint(Grammar.regex("ab?"), bare, 384, ())
    words = structured.no_mask(1, 384)
    assert c.fill(words[0]) and not c.done
    c.advance(tiny.tokenizer.encode("a"))
    assert c.fill(words[0]) and not c.done  # "b" may follow; the row has no end id to choose instead
    c.advance(tiny.tokenizer.encode("b"))
    assert c.done


def test_a_grammar_holds_with_rows_over_dp_and_a_vocabulary_padded_for_mp(gen, tiny):
    """The masks travel with their rows over dp = 2 and cover a vocabulary padded for mp = 2."""
    from mesh_transformer.generate import Generator
    from mesh_transformer.io import hf
    from tests.helpers import mesh
    config, params = hf.load_hf(tiny.path, mp=2, compute_dtype="float32")
    sharded = Generator(config, params, mesh(2, 2))
    ids = [tiny.tokenizer.encode(p) for p in PROMPTS]
    opts = [SamplingOptions(max_new_tokens=24, temperature=0.0, eos_token_id=tiny.eos, grammar=CASES[case][0])
            for case in ("json_schema", "regex", "choice", "gbnf")]
    ours = sharded.generate(ids, opts, tiny.tokenizer)
    for prompt, seq, case in zip(ids, ours, CASES):
        assert seq.tokens == masked_greedy(tiny, prompt, CASES[case][1](), 24), case


def test_sampled_json_always_validates_and_free_rows_beside_it_are_unchanged(gen, tiny):
    ids = [tiny.tokenizer.encode(p) for p in PROMPTS]
    free = SamplingOptions(max_new_tokens=20, temperature=1.0, seed=5, eos_token_id=tiny.eos)
    alone = gen.generate(ids, free, tiny.tokenizer)
    texts = []
    for seed in range(3):
        guided = SamplingOptions(max_new_tokens=24, temperature=1.0, seed=seed, eos_token_id=tiny.eos,
                                 grammar=Grammar.json_schema(SCHEMA, any_whitespace=False))
        seqs = gen.generate(ids, [guided, free, guided, free], tiny.tokenizer)
        for s in seqs[::2]:
            assert s.finish_reason == "stop"
            jsonschema.validate(json.loads(s.text), SCHEMA)
            texts.append(s.text)
        assert [s.tokens for s in seqs[1::2]] == [alone[1].tokens, alone[3].tokens]
    assert len(set(texts)) > 1  # samples, not one forced answer


AFTER = [  # (grammar, an answer it takes, one it refuses)
    (Grammar.json_schema(SCHEMA, separators=JSON_DUMPS), '{"ok": true, "n": 2}', '{"ok":true,"n":2}'),
    (Grammar.regex("[0-9]{3}"), "123", "12a"),
    (Grammar.choice(["yes", "no"]), "no", "maybe"),
    (Grammar.lark('root ::= "x" [0-9]'), "x5", "y5"),
]


@pytest.mark.parametrize("markers", ["text", "tokens", "special tokens"])
@pytest.mark.parametrize("grammar,good,bad", AFTER, ids=[g[0].kind for g in AFTER])
def test_a_grammar_after_thinking_holds_the_answer_not_the_thinking(tiny, grammar, good, bad, markers):
    """A reasoning model's reply: free text up to "</think>" (any, the grammar's own syntax too),
    blank space, then the grammar. Without an opener the reply starts inside the block; with one,
    the block is optional and starts with it. The markers are text, or tokens of their own as in
    Qwen 3's and R1's vocabularies (added, special or not: llguidance takes either for special).
    llguidance's own matcher is the judge."""
    from tokenizers import AddedToken
    tok = tiny.tokenizer
    if markers != "text":
        tok = copy.deepcopy(tok)
        special = markers == "special tokens"
        tok.add_tokens([AddedToken(m, special=special, normalized=False) for m in ("<think>", "</think>")],
                       special_tokens=special)
    view = llguidance.hf.from_tokenizer(tok)
    ids = [-1, -1] if markers == "text" else tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert ids == [-1, -1] or (len(tok.encode("<think>")) == 1 and len(tok.encode("</think>")) == 1)

    def takes(g: Grammar, text) -> bool:
        """Whether `g` takes `text` (or these token ids)."""
        matcher = llguidance.LLMatcher(view, g.source())
        assert not matcher.is_error(), matcher.get_error()
        tokens = tok.encode(text) if isinstance(text, str) else text
        return all(matcher.consume_token(t) for t in tokens) and matcher.is_accepting()

    inside = grammar.after_thinking("</think>", closer_id=ids[1])
    optional = grammar.after_thinking("</think>", "<think>", ids[1], ids[0])
    assert takes(inside, f"{bad} {{ not yet\n</think>\n\n{good}") and takes(optional, f"<think>{bad}</think>{good}")
    assert takes(optional, good) and not takes(inside, good)  # the block is optional only with an opener
    assert not takes(inside, f"hmm</think>{bad}") and not takes(optional, f"<think>hmm</think>{bad}")
    assert takes(grammar, good) and not takes(grammar, f"<think>hmm</think>{good}")  # unchanged by itself

    if markers == "text":  # a budget forces the closer: it must be a token
        with pytest.raises(ValueError, match="needs the closer as a token"):
            grammar.after_thinking("</think>", budget=2)
        return
    capped, thought = grammar.after_thinking("</think>", closer_id=ids[1], budget=2), tok.encode("hmm, not yet")
    assert len(thought) > 2
    assert takes(capped, thought[:2] + [ids[1]] + tok.encode(good)) and takes(capped, [ids[1]] + tok.encode(good))
    assert not takes(capped, thought[:3] + [ids[1]] + tok.encode(good))  # a third token of thinking: refused
    free = ANY_ANSWER.after_thinking("</think>", closer_id=ids[1], budget=2)  # a budget alone: any answer after it,
    assert takes(free, thought[:2] + [ids[1], ids[0]] + tok.encode(good))  # special tokens too (a tool-call marker)


def test_a_grammar_without_a_tokenizer_or_with_a_bad_spec_is_a_clear_error(gen, tiny):
    with pytest.raises(ValueError, match="needs the tokenizer"):
        gen.generate([[1, 2]], SamplingOptions(max_new_tokens=4, grammar=Grammar.regex("a+")))
    with pytest.raises(ValueError, match="not valid JSON"):
        Grammar.json_schema("{oops").source()
    with pytest.raises(ValueError, match="non-empty list"):
        Grammar.choice([]).source()


# --------------------------------------------------------------------------------------------
# Over HTTP
# --------------------------------------------------------------------------------------------

def library(gen, tiny, prompt: str, grammar: Grammar, new: int = 24) -> str:
    opts = SamplingOptions(max_new_tokens=new, temperature=0.0, eos_token_id=tiny.eos, grammar=grammar)
    return gen.generate([tiny.tokenizer.encode(prompt)] * 4, opts, tiny.tokenizer)[0].text


@pytest.mark.parametrize("extra,grammar", [
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, Grammar.json_schema(SCHEMA, False)),
    ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,4}"}}, Grammar.regex(r"[0-9]{3}-[a-z]{2,4}")),
    ({"guided_choice": ["yes", "no way"]}, Grammar.choice(["yes", "no way"])),
    ({"guided_regex": "[a-c]{2}!?"}, Grammar.regex("[a-c]{2}!?")),
    ({"guided_grammar": 'root ::= "x" [0-9]'}, Grammar.lark('root ::= "x" [0-9]')),
    ({"guided_json": json.dumps(SCHEMA)}, Grammar.json_schema(SCHEMA)),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True, "disable_fallback": False,
                             "whitespace_pattern": None, "structural_tag": None}}, Grammar.json_object(False)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}},
     Grammar.json_schema(SCHEMA)),
], ids=["structured_outputs.json", "structured_outputs.regex", "guided_choice", "guided_regex", "guided_grammar",
        "guided_json", "structured_outputs.json_object", "response_format"])
def test_completions_follow_the_requested_format_as_the_library_does(client, gen, tiny, extra, grammar):  # noqa: F811
    r = client.completions.create(model="tiny", prompt="The lazy dog", max_tokens=24, temperature=0, extra_body=extra)
    assert r.choices[0].text == library(gen, tiny, "The lazy dog", grammar)
    streamed = client.completions.create(model="tiny", prompt="The lazy dog", max_tokens=24, temperature=0,
                                         stream=True, extra_body=extra)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


ANSWER = {"enum": ["yes", "no", 7]}  # short: the tiny model's context is 32 tokens, the chat prompt 19 of them


def test_chat_response_format_json_schema_gives_json_of_that_schema(client, engine, gen, tiny):  # noqa: F811
    messages = [{"role": "user", "content": "ok"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                       response_format=fmt)
    assert r.choices[0].message.content == library(gen, tiny, "User: ok\n\nAssistant:", Grammar.json_schema(ANSWER),
                                                   new=12)
    assert r.choices[0].finish_reason == "stop" and json.loads(r.choices[0].message.content) in ANSWER["enum"]
    sampled = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=1, n=3,
                                             seed=3, response_format={"type": "json_object"})
    for choice in sampled.choices:  # any JSON object, or cut short by max_tokens
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.message.content.startswith("{")


BAD = [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"json": {"type": "foo"}}}, "structured_outputs.json", "foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "foo"),
    ({"guided_regex": "(("}, "guided_regex", "unclosed group"),
    ({"structured_outputs": {"regex": "a", "disable_fallback": True}}, "structured_outputs.disable_fallback",
     "not supported"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {}}, "structured_outputs", "got none"),
    ({"structured_outputs": {"json_schema": {}}}, "structured_outputs.json_schema", "not supported"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"structured_outputs": {"json": "{oops"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "is required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "got 'yaml'"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "ask for one"),
]


@pytest.mark.parametrize("extra,param,message", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_format_is_a_400_naming_the_field(url, extra, param, message):  # noqa: F811
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, **extra},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


# --------------------------------------------------------------------------------------------
# In the engine, and the compiled grammars it shares
# --------------------------------------------------------------------------------------------

def test_a_free_request_beside_a_guided_one_in_the_engine_is_unchanged(engine, gen, tiny):  # noqa: F811
    """One submission, so both share the engine's batch: the guided row makes it step one token per
    call; the free row still gives the library's text (the engine fixture is batch-invariant)."""
    from tests.serving import library_text, wait_idle
    ids = tiny.tokenizer.encode("The lazy dog")
    guided = SamplingOptions(max_new_tokens=16, temperature=0.0, eos_token_id=tiny.eos,
                             grammar=Grammar.regex("[a-z]{1,20}"))
    seqs = [engine.sequence(ids, guided, 60), engine.sequence(ids, dataclasses.replace(guided, grammar=None), 60)]
    request = engine.submit(seqs)
    deadline = time.monotonic() + 60
    while not request.finished:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert seqs[1].text == library_text(gen, tiny, ["The lazy dog"])[0]
    assert seqs[0].text == library(gen, tiny, "The lazy dog", Grammar.regex("[a-z]{1,20}"), new=16)
    wait_idle(engine)


def test_a_request_its_grammar_ends_at_once_finishes_without_a_row(url, engine):  # noqa: F811
    from tests.serving import wait_idle
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True,
                                                  "guided_regex": ""}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], r.json()["usage"]["completion_tokens"]) == ("", "stop", 0)
    wait_idle(engine)


def test_grammars_compile_once_and_survive_threads_evicting_each_other(tiny, monkeypatch):
    from mesh_transformer.generate import structured
    monkeypatch.setattr(structured, "KEPT_GRAMMARS", 2)
    failures = []

    def work(k):
        try:
            for i in range(30):
                structured.check(Grammar.regex(f"a{{{1 + (i + k) % 7}}}"), tiny.tokenizer, 384)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            failures.append(e)
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    compiled = structured.compiler(tiny.tokenizer, 384)
    assert compiled is structured.compiler(tiny.tokenizer, 384) and len(compiled._parsers) <= 2


# --------------------------------------------------------------------------------------------
# device_sample.py
# --------------------------------------------------------------------------------------------

def test_device_sample_follows_a_choice_and_names_a_bad_flag(gen, tiny, capsys):
    import device_sample
    argv = ["--hf", str(tiny.path), "--dtype", "float32", "--prompt", "The lazy dog", "--temperature", "0",
            "--max-new-tokens", "12"]
    assert device_sample.main(argv + ["--choice", "yes", "--choice", "no way"]) in (None, 0)
    printed = capsys.readouterr().out
    assert printed.startswith(library(gen, tiny, "The lazy dog", Grammar.choice(["yes", "no way"]), new=12) + "\n[")
    assert "finish: stop" in printed
    assert device_sample.main(argv[:-1] + ["32"]) == 2
    assert capsys.readouterr().err == ("error: --max-new-tokens 32: at most 31 for this model (its context is 32 "
                                       "tokens, the prompt's included)\n")
    for flags, message in ((["--max-new-tokens", "0"], "--max-new-tokens must be an integer in [1, 31] (the context is "
                                                       "32 tokens), got 0"),
                           (["--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
                           (["--repetition-penalty", "0"], "--repetition-penalty must be > 0, got 0.0")):
        assert device_sample.main(argv + flags) == 2  # before any prompt is read, not a traceback after it
        assert capsys.readouterr().err == f"error: {message}\n"
    err = refusal(device_sample.main, argv + ["--chunk", "0"], capsys)
    assert "error: --chunk must be at least 1 decode step; got 0\n" in err
    assert device_sample.main(argv + ["--regex", "a(b"]) == 2
    assert "--regex: " in capsys.readouterr().err
    assert device_sample.main(argv + ["--json-schema", "no-such.schema.json"]) == 2
    assert "--json-schema: 'no-such.schema.json' is neither a file nor a JSON object" in capsys.readouterr().err
    # a bad schema is reported before the model loads (here there is none to load)
    assert device_sample.main(["--hf", "/no/such/model", "--prompt", "x", "--json-schema", "{oops"]) == 2
    assert capsys.readouterr().err.startswith("error: --json-schema: ")
