"""Structured outputs over HTTP: the request fields that ask for text of a given form, as one
`structured.Grammar` (or None), on /v1/completions and /v1/chat/completions alike.

- OpenAI's `response_format`: `{"type": "text"}`, `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name": .., "schema": {..}, "strict": ..}}`;
- vLLM's `structured_outputs`: exactly one of `json` (a schema), `regex`, `choice` (strings),
  `grammar` (Lark or GBNF), `json_object: true`; with `disable_any_whitespace`;
- vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

A request may use one of the three. Anything wrong, the grammar included (llguidance compiles it
here, before the request queues), is a 400 naming the field.
"""
from __future__ import annotations

import json
from typing import Optional

from mesh_transformer.generate.structured import Grammar, check
from mesh_transformer.serve import openai as oa

KINDS = ("json", "regex", "choice", "grammar", "json_object")  # structured_outputs' keys, one of them
UNSET_ONLY = ("disable_fallback", "disable_additional_properties", "whitespace_pattern", "structural_tag",
              "backend")  # vLLM's other keys: taken when null or false (as its clients send them), else a 400
GUIDED = {f"guided_{k}": k for k in ("json", "regex", "choice", "grammar")}  # vLLM's older fields


def asked(body) -> bool:
    """Whether the body names any structured-output field (else `grammar` is None at once); a body
    may have some of `oa.StructuredFields` (/v1/responses takes `structured_outputs` alone)."""
    return asked_field(body) is not None


def asked_field(body) -> Optional[str]:
    """The first structured-output field the body names, or None."""
    return next((name for name in oa.StructuredFields.model_fields if getattr(body, name, None) is not None), None)


def grammar(engine, body) -> Optional[Grammar]:
    """The grammar the request asks for (None: free text), compiled once to check it (llguidance
    keeps it: the request's rows copy the compiled parser)."""
    asked = [found for found in (_response_format(getattr(body, "response_format", None)),
                                 _structured(getattr(body, "structured_outputs", None)), *_guided(body))
             if found is not None]
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(field.split(".")[0] for field, _ in asked)
        second = asked[1][0].split(".")[0]
        raise oa.ApiError(400, f"{second}: ask for one structured output, got {names}", param=second)
    return _checked(engine, *asked[0])


def text_format(engine, given: Optional[dict], field: str = "text") -> Optional[Grammar]:
    """The Responses API's `text` (`field`; Anthropic's `output_config` has the same shape):
    `{"format": {"type": "text"}}`, `{"type": "json_object"}` or `{"type": "json_schema", "name":
    .., "schema": {..}, "strict": ..}`, as a grammar (None: free text), compiled once to check it;
    a 400 naming the field at fault."""
    if given is None:
        return None
    fmt = given.get("format")
    if fmt is None:
        return None
    where = f"{field}.format"
    if not isinstance(fmt, dict):
        raise oa.ApiError(400, f"{where}: an object, got {type(fmt).__name__}", param=where)
    found = _format(fmt.get("type"), fmt.get("schema"), where, f"{where}.schema")
    return _checked(engine, *found) if found else None


def _checked(engine, field: str, result: Grammar) -> Grammar:
    """`result`, compiled once to check it; a 400 naming `field` if llguidance cannot."""
    try:
        check(result, engine.tokenizer, engine.gen.vocab)
    except ValueError as e:
        raise oa.ApiError(400, f"{field}: {e}", param=field) from None
    return result


def _response_format(given: Optional[dict]) -> Optional[tuple[str, Grammar]]:
    """(the field a compile error names, the grammar), or None."""
    if given is None:
        return None
    spec = given.get("json_schema")
    return _format(given.get("type"), spec.get("schema") if isinstance(spec, dict) else None, "response_format",
                   "response_format.json_schema.schema")


def _format(kind, schema, field: str, schema_field: str) -> Optional[tuple[str, Grammar]]:
    """OpenAI's text formats (`type` text, json_object, json_schema with `schema`) -> (the field a
    compile error names, the grammar), or None for text."""
    if kind == "text":
        return None
    if kind == "json_object":
        return field, Grammar.json_object()
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise oa.ApiError(400, f"{schema_field}: a JSON schema (an object) is required", param=schema_field)
        return schema_field, Grammar.json_schema(schema)
    raise oa.ApiError(400, f"{field}.type: must be text, json_object or json_schema, got {kind!r}",
                      param=f"{field}.type")


def _structured(given: Optional[dict]) -> Optional[tuple[str, Grammar]]:
    if given is None:
        return None
    unknown = sorted(k for k in set(given) - {*KINDS, "disable_any_whitespace"}
                     if k not in UNSET_ONLY or not (given[k] is None or given[k] is False))
    if unknown:
        raise oa.ApiError(400, f"structured_outputs.{unknown[0]}: not supported (one of {', '.join(KINDS)}, "
                               f"and disable_any_whitespace)", param=f"structured_outputs.{unknown[0]}")
    kinds = [k for k in KINDS if given.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise oa.ApiError(400, f"structured_outputs: give exactly one of {', '.join(KINDS)}, got "
                               f"{', '.join(kinds) or 'none'}", param="structured_outputs")
    field = f"structured_outputs.{kinds[0]}"
    compact = given.get("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise oa.ApiError(400, f"structured_outputs.disable_any_whitespace: must be true or false, got "
                               f"{type(compact).__name__}", param="structured_outputs.disable_any_whitespace")
    return field, _of_kind(kinds[0], given[kinds[0]], field, not compact)


def _guided(body: oa.StructuredFields) -> list[tuple[str, Grammar]]:
    return [(name, _of_kind(kind, getattr(body, name), name)) for name, kind in GUIDED.items()
            if getattr(body, name, None) is not None]


def _of_kind(kind: str, value, field: str, any_whitespace: bool = True) -> Grammar:
    """One kind's value as a Grammar; a value of the wrong type is a 400 naming `field`."""
    def need(ok: bool, what: str):
        if not ok:
            got = "an empty string" if value == "" else type(value).__name__
            raise oa.ApiError(400, f"{field}: must be {what}, got {got}", param=field)
    if kind == "json_object":
        need(value is True, "true")
        return Grammar.json_object(any_whitespace)
    if kind == "json":
        need(isinstance(value, (dict, str)), "a JSON schema (an object, or its JSON text)")
        if isinstance(value, str):
            try:
                json.loads(value)
            except json.JSONDecodeError as e:
                raise oa.ApiError(400, f"{field}: the schema is not valid JSON ({e})", param=field) from None
        return Grammar.json_schema(value, any_whitespace)
    if kind == "choice":
        need(isinstance(value, list) and value and all(isinstance(c, str) and c for c in value),
             "a non-empty list of non-empty strings")
        for i, c in enumerate(value):
            oa.check_text(c, f"{field}[{i}]")
        return Grammar.choice(value)
    need(isinstance(value, str) and (bool(value) or kind == "regex"), "a string" if kind == "regex" else
         "a non-empty string")
    oa.check_text(value, field)
    return Grammar.regex(value) if kind == "regex" else Grammar.lark(value)
