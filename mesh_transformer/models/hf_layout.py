"""How a family's parameters are named and laid out in Hugging Face checkpoints: one table per family.

Each `HFParam` says which HF tensor holds which of our leaves and how to convert, in both
directions, declared once: `to_ours(hf_array, config) -> tuple of our arrays` and its exact inverse
`to_hf(tuple of our arrays, config) -> hf_array`. One HF tensor may hold several of ours (GPT-2's
fused `c_attn`, GPT-NeoX's per-head interleaved `query_key_value`, Phi-3's `qkv_proj` and
`gate_up_proj`). Names with `{i}` are per layer
and map to our stacked modules (`layers/...`, leading [L] axis); names with `{e}` too are per
expert (one HF tensor per expert, our leaf's next axis [E]: the transform converts one expert's). Vocabulary padding is not the
table's business: `io/hf.py` pads and crops every axis declared "vocab".

Our layouts: q/k/v [D, N, H], out_proj [N, H, D], other weights [in, out], q/k/v biases [N, H].
torch's nn.Linear stores [out, in]; GPT-2's Conv1D stores [in, out].
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np


class Transform(NamedTuple):
    to_ours: Callable  # (hf array, config) -> tuple of arrays
    to_hf: Callable  # (tuple of arrays, config) -> hf array


class HFParam(NamedTuple):
    hf: str  # e.g. "transformer.h.{i}.attn.q_proj.weight"
    ours: tuple[tuple[str, str], ...]  # ((module under the family root, leaf), ...), e.g. (("layers/attn", "q_proj"),)
    transform: Transform

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.hf


class HFExperts(NamedTuple):
    """A mixture's stacked expert weights as transformers holds them in memory (what PEFT's
    `target_parameters` adapt, not the per-expert tensors of the files): one tensor per layer
    ([E, out, in], or GPT-OSS's [E, in, out]: PEFT reads either as in -> out) whose outputs are our
    `ours` leaves' outputs in turn (gate_up_proj: gate, then up), or interleaved one by one (GPT-OSS's:
    gate, up, gate, up, ...)."""

    hf: str  # e.g. "model.layers.{i}.mlp.experts.gate_up_proj"
    ours: tuple[tuple[str, str], ...]  # our [E, in, out] leaves, e.g. (("layers/moe", "experts_gate"), ...)
    interleaved: bool = False

    def outputs(self, part: int, width: int) -> slice:
        """Which of the HF tensor's outputs are part `part`'s (each part `width` wide)."""
        parts = len(self.ours)
        return slice(part, None, parts) if self.interleaved else slice(part * width, (part + 1) * width)

    @property
    def target(self) -> str:
        """What a LoRA config names it by: "experts.gate_up_proj" (PEFT matches a suffix of the path)."""
        return ".".join(self.hf.split(".")[-2:])


def as_transformers_reads_it(hf: dict) -> dict:
    """A config.json dict as transformers' config class reads it: the keys the file leaves out at
    their defaults, older keys in today's form (e.g. Gemma's `rope_local_base_freq` and
    `sliding_window_pattern` as per-layer-kind `rope_parameters` and `layer_types`)."""
    import copy

    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    from mesh_transformer.config import ConfigError
    try:
        return AutoConfig.for_model(**copy.deepcopy(hf)).to_dict()  # (transformers fills nested dicts in place)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as e:
        raise ConfigError(f"config.json: transformers does not read it ({type(e).__name__}: {e})") from None


def one(fn_ours, fn_hf) -> Transform:
    """A transform between one HF tensor and one of ours."""
    return Transform(lambda x, c: (fn_ours(x, c),), lambda xs, c: fn_hf(xs[0], c))


SAME = one(lambda x, c: x, lambda x, c: x)
LINEAR = one(lambda x, c: x.T, lambda x, c: x.T)  # torch [out, in] <-> [in, out]
SCORE = HFParam("score.weight", (("score", "score"),), LINEAR)  # a classifier's head: [labels, D] <-> [D, labels]
LM_HEAD = HFParam("lm_head.weight", (("head", "lm_head"),), LINEAR)  # an untied language-model head


def untied_head(tied: bool) -> list[HFParam]:
    """The language-model head's entry, where the family's config does not tie it to the embedding."""
    return [] if tied else [LM_HEAD]


def for_config(family_table: Callable) -> Callable:
    """A family's table for any config of it: a classifier's (`ModelConfig.classifier`) has HF's
    `score` in place of the language-model head (ForSequenceClassification keeps the causal LM's
    names for the rest)."""
    def table(config) -> list[HFParam]:
        entries = family_table(config)
        if not config.classifier:
            return entries
        return [e for e in entries if e.ours[0][0] != "head"] + [SCORE]
    return table


def heads_out(kv: bool = False, transposed: bool = True) -> Transform:
    """q/k/v: torch [N*H, D] (or Conv1D [D, N*H] with transposed=False) <-> [D, N, H]."""
    def to_ours(x, c):
        x = x.T if transposed else x
        return x.reshape(c.d_model, _heads(c, kv), c.head_dim)

    def to_hf(x, c):
        x = x.reshape(c.d_model, -1)
        return x.T if transposed else x
    return one(to_ours, to_hf)


def heads_in(transposed: bool = True) -> Transform:
    """out_proj: torch [D, N*H] (or Conv1D [N*H, D] with transposed=False) <-> [N, H, D]."""
    def to_ours(x, c):
        x = x.T if transposed else x
        return x.reshape(c.n_heads, c.head_dim, c.d_model)

    def to_hf(x, c):
        x = x.reshape(-1, c.d_model)
        return x.T if transposed else x
    return one(to_ours, to_hf)


def head_bias(kv: bool = False) -> Transform:
    """q/k/v bias: [N*H] <-> [N, H]."""
    return one(lambda x, c: x.reshape(_heads(c, kv), c.head_dim), lambda x, c: x.reshape(-1))


def fused_qkv(per_head: bool, transposed: bool) -> Transform:
    """One HF q|k|v tensor <-> our q, k, v (weights [D, N, H] or, 1-d, biases [N, H]).

    per_head=False: [q; k; v] blocks of N*H outputs each (GPT-2's Conv1D c_attn, [D, 3*N*H]).
    per_head=True: outputs ordered (head, q|k|v, H) (GPT-NeoX's query_key_value, [3*N*H, D]).
    """
    def to_ours(x, c):
        n, h = c.n_heads, c.head_dim
        x = x.T if transposed and x.ndim == 2 else x  # [D, 3NH] or [3NH]
        lead = x.shape[:-1]
        parts = x.reshape(*lead, n, 3, h) if per_head else x.reshape(*lead, 3, n, h)
        return tuple(parts[..., :, j, :] if per_head else parts[..., j, :, :] for j in range(3))

    def to_hf(xs, c):
        stacked = np.stack(xs, axis=-2 if per_head else -3)  # [..., N, 3, H] or [..., 3, N, H]
        flat = stacked.reshape(*stacked.shape[:-3], -1)
        return flat.T if transposed and flat.ndim == 2 else flat
    return Transform(to_ours, to_hf)


def stacked_qkv() -> Transform:
    """One torch [(N + 2K) * H, D] tensor, q's heads then k's then v's (Phi-3's qkv_proj) <-> our
    q [D, N, H], k and v [D, K, H]."""
    def to_ours(x, c):  # also a LoRA B [(N + 2K) * H, r] -> [r, N, H], ...
        n, kv, h = c.n_heads, c.kv_heads, c.head_dim
        q, k, v = np.split(x.T, [n * h, (n + kv) * h], axis=1)
        return q.reshape(-1, n, h), k.reshape(-1, kv, h), v.reshape(-1, kv, h)

    def to_hf(xs, c):
        return np.concatenate([x.reshape(x.shape[0], -1) for x in xs], axis=1).T
    return Transform(to_ours, to_hf)


def stacked_linear(parts: int) -> Transform:
    """One torch [parts * F, D] tensor, equal blocks of outputs one after another (Phi-3's
    gate_up_proj: gate, then up) <-> `parts` of our [D, F]."""
    return Transform(lambda x, c: tuple(np.split(x.T, parts, axis=1)),
                     lambda xs, c: np.concatenate(xs, axis=1).T)


def _heads(c, kv: bool) -> int:
    return c.kv_heads if kv else c.n_heads
