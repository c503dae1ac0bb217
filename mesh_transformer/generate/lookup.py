"""Prompt lookup: draft a row's next tokens from its own text, for speculative decoding.

A decode step reads every weight once, whatever the rows it computes, so on a machine whose step
is bound by memory (one row, a few) the model checks several positions for the price of about
one. `Generator(speculate=k)` feeds each row its last token and the k tokens drafted here, keeps
the tokens its sampling chooses up to the first one that differs from the draft (that one it keeps
too), and moves on by that many: every token kept is the token decoding one at a time would have
chosen, greedy or sampled (a token's random draw depends on the row's seed and the token's index
only, see `sampling.row_keys`). Drafts cost nothing to make and pay where text repeats itself:
code being edited, a document being summarised or quoted, answers that copy their question, and
the loops a small model falls into.

The draft: the longest of the row's last `max_ngram` .. 1 tokens that occurred earlier in its
prompt or output, and the k tokens that followed its latest earlier occurrence (transformers'
`prompt_lookup_num_tokens` and vLLM's n-gram speculator take the earliest: the latest follows the
text's most recent turn, which in a loop or a revised passage is what comes next). Each row keeps
its tokens by position, prompt first (`history` [B, C], C its batch's slots; `length` [B] valid).
"""
from __future__ import annotations

import jax.numpy as jnp

NO_DRAFT = -1


def _at(history, positions):
    """history [B, C] at positions [B, n] (clipped into the row; the caller masks what it must)."""
    return jnp.take_along_axis(history, jnp.clip(positions, 0, history.shape[1] - 1), axis=1)


def propose(history, length, k: int, max_ngram: int):
    """[B, k] draft tokens for each row (`NO_DRAFT` where none: no earlier occurrence of its last
    token, or fewer than k tokens after the one found)."""
    rows, context = history.shape
    pos = jnp.arange(context)[None, :]
    follows = jnp.full((rows,), -1, jnp.int32)  # where each row's draft starts (-1: none yet)
    for n in range(max_ngram, 0, -1):
        tail = _at(history, length[:, None] - n + jnp.arange(n))  # [B, n]: the last n tokens
        # ends at j: history[j-n+1 .. j] == tail, for j before the last token (so a token follows j)
        ends = (pos >= n - 1) & (pos < length[:, None] - 1) & (length[:, None] > n)
        for i in range(n):
            ends &= jnp.roll(history, n - 1 - i, axis=1) == tail[:, i:i + 1]
        latest = jnp.max(jnp.where(ends, pos, -1), axis=1)
        follows = jnp.where((follows < 0) & (latest >= 0), latest + 1, follows)
    at = follows[:, None] + jnp.arange(k)
    return jnp.where((follows[:, None] >= 0) & (at < length[:, None]), _at(history, at), NO_DRAFT)


def record(history, length, tokens):
    """(history, length) with each row's new tokens [B, n] appended (a row's tokens come first,
    `NO_DRAFT` after them: rows keep different numbers)."""
    rows, context = history.shape
    kept = jnp.sum(tokens >= 0, axis=1).astype(length.dtype)
    at = jnp.where(tokens >= 0, length[:, None] + jnp.arange(tokens.shape[1]), context)  # context: dropped
    return history.at[jnp.arange(rows)[:, None], at].set(tokens, mode="drop"), length + kept


def prompts(tokens, lengths, context: int):
    """history [n, context] of left-padded prompts tokens [n, W] (lengths [n] of them real)."""
    width = tokens.shape[1]
    at = (width - lengths)[:, None] + jnp.arange(context)
    return jnp.where(jnp.arange(context) < lengths[:, None], _at(tokens, at), 0)
