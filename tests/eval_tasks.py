"""Local lm-eval tasks over the files in tests/data/eval (no hub): `write_tasks(dir)` renders their
YAMLs with absolute data paths into `dir`, ready for `--include-path dir`."""
from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).parent / "data" / "eval"
TASKS = ("tiny_lambada", "tiny_piqa", "tiny_qa", "tiny_wiki")


def write_tasks(directory) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for template in DATA.glob("*.yaml.in"):
        (directory / template.name[: -len(".in")]).write_text(template.read_text().replace("{DATA}", str(DATA)))
    return directory


def train_tokenizer(path, vocab_size: int = 300):
    """A byte-level BPE tokenizer (EOS "<|endoftext|>", no BOS) trained on the task texts, saved to `path`."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [" ".join(str(v) for v in json.loads(line).values())
             for f in sorted(DATA.glob("*.jsonl")) for line in f.read_text().splitlines()]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(path)
    return tokenizer
