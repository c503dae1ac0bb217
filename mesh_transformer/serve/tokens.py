"""vLLM's `POST /tokenize` and `POST /detokenize`: the served model's tokenizer over HTTP.

Clients count a prompt's tokens before they send it (against `max_model_len`), or build prompts of
an exact length. `/tokenize` takes a `prompt` (special tokens added, as /v1/completions encodes
it) or chat `messages` with any `tools` (rendered and encoded exactly as /v1/chat/completions does, so
`count` is that request's `usage.prompt_tokens`); `/detokenize` turns `tokens` back into text.
"""
from __future__ import annotations

from typing import Optional

from fastapi import Request as HttpRequest

from mesh_transformer.serve import chat
from mesh_transformer.serve import openai as oa
from mesh_transformer.serve import tools


class TokenizeRequest(chat.TemplateFields):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[chat.ChatMessage]] = None
    tools: Optional[list] = None  # with messages: shown to the template, as /v1/chat/completions does
    add_special_tokens: Optional[bool] = None  # default: true for a prompt, false for messages (the template's own)
    return_token_strs: bool = False


class DetokenizeRequest(oa._Strict):
    model: Optional[str] = None
    tokens: list[int]


async def tokenize(s: oa.Settings, http: HttpRequest):
    body = oa.parse(await http.body(), TokenizeRequest)
    oa.adapter(s, body.model)  # a model the server does not serve is a 404, as for generation
    if (body.prompt is None) == (body.messages is None):
        raise oa.ApiError(400, "give exactly one of prompt or messages", param="prompt")
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = oa.encode(s.engine, body.prompt, "prompt", add_special_tokens=special)
    else:
        if not body.messages:
            raise oa.ApiError(400, "messages must not be empty", param="messages")
        specs = [t.spec() for t in tools.read_tools(body.tools)] or None
        ids = chat.encoded_messages(s, body.messages, chat.rendering(body), bool(body.add_special_tokens), specs)
    strs = s.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": s.engine.context, "tokens": ids, "token_strs": strs}


async def detokenize(s: oa.Settings, http: HttpRequest):
    body = oa.parse(await http.body(), DetokenizeRequest)
    oa.adapter(s, body.model)
    oa.check_token_ids(s.engine, body.tokens, "tokens")
    try:
        return {"prompt": s.engine.tokenizer.decode(body.tokens)}
    except Exception as e:  # noqa: BLE001 - ids of the model's padded vocabulary the tokenizer lacks
        raise oa.ApiError(400, f"tokens: the tokenizer cannot decode them ({type(e).__name__}: {e})",
                          param="tokens") from None
