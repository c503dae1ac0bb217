"""Token datasets: building them from text (``create_finetune_dataset.py``) and loading batches.

A dataset is a directory (local or gs://) holding

    <name>.index.json          written last: a dataset without its index does not exist
    <name>-00000.tokens.npy    uint16 (vocab <= 65536) or uint32, [n, seq+1]
    <name>-00000.mask.npy      uint8 [n, seq], only when prompt/completion examples or conversations were given
    <name>-00000.segments.npy  uint16 [n, seq+1], with the mask (version 2): which document or
                               example of its row each token belongs to (0, 1, ... per row)
    <name>-00000.labels.npy    uint8 [n], unpaired preferences (version 4): 1 where the row's
                               example is desirable; float32 [n], labelled texts (version 5): the
                               row's label (a class number, or a regression's target);
                               [n, classes] uint8, multi-label texts (version 6): 1 for each class of the row's
    ...

Row ``r`` of a tokens shard is one training sequence; ``mask[r, t]`` weights the loss of
predicting ``tokens[r, t+1]`` (1 = train on it). The index lists every shard with its sequence
count and sha256, plus seq, dtype, tokenizer and build statistics.

Packing (as the original ``create_finetune_tfrecords.py``): documents are split on
``<|endoftext|>``, tokenized, given an EOS each, concatenated and cut into seq+1-token rows; the
remainder is carried into the next repack epoch and dropped at the end. A prompt/completion
example (``{"in_text", "out_text"}``) is never split: it goes whole into the current row, or the
row is closed with EOS padding (mask 0) and the example starts the next one. Its loss mask is 1 on
the completion and its EOS only.

A conversation (``{"messages": [{"role", "content"}, ..], "tools": [..]}``, OpenAI's fine-tuning
format) is rendered by the chat template the server uses (the tokenizer's, ``--chat-template``, or
the plain one; ``data.conversations``), packed whole as an example is, and trained on its
assistant turns only (each with what the template writes after it, e.g. its end-of-turn token).

Preference pairs (``{"prompt", "chosen", "rejected"}``, text or conversational; ``data.preferences``),
the data of DPO, make a dataset of their own (version 3, ``"pairs": true`` in the index): each pair
is two rows, chosen then rejected, each padded to the row and masked to its completion; shuffling
(here and in the ``Loader``) moves whole pairs.

Unpaired preferences (``{"prompt", "completion", "label"}``, the data of KTO; ``data.preferences``)
make a dataset of their own too (version 4, ``"pairs": true`` and ``"labels": true``): each example
is two rows, its own and its KL row (its prompt with the next example's completion, cut to the
row if longer), moved together as a pair's are, and labelled.

Labelled texts (``{"text", "label"}`` with ``--label-key label``: the text field, ``--json-key``,
beside the label's; the data of a sequence classifier, ``train/classify.py``) make a dataset of
their own too (version 5, ``"classes": true``): each text is one row, tokenized as /classify
tokenizes it (with the tokenizer's special tokens), cut to ``seq`` tokens as transformers'
``truncation=True`` cuts it (the text's end, the special tokens kept), masked 1 on its tokens (the positions
the model reads; its scores are read at the last) and labelled: a class number (0, 1, ...), a
class name (numbered by ``--label-names``' order, else the names sorted) or, for a regression, any
number. The index records the labels' range, whether they are all class numbers, and the names.
A label that is a list of class numbers or names (a multi-label text: any number of classes,
none included) makes a multi-label dataset (version 6, ``"multi_label": true``): each row's label
is a 0/1 vector, one per class (``"label_width"``: as many as ``--label-names`` names, else the
classes named, else the highest class number + 1).

Segments: version 2 stores each token's segment with prompt/completion data, so packed examples
stay apart even where a prompt itself contains the EOS id. Datasets without stored segments (plain
text, where every document ends at its only EOS, and version-1 datasets) get them from the EOS rule
when read (`segment_ids`).
"""
from __future__ import annotations

import bz2
import contextlib
import dataclasses
import gzip
import hashlib
import io
import json
import lzma
import os
import queue
import re
import shutil
import tempfile
import threading
from typing import Iterator, NamedTuple

import numpy as np
import zstandard

from mesh_transformer.data import conversations, preferences
from mesh_transformer.errors import UserError
from mesh_transformer.io import storage
from mesh_transformer.io.chat_template import ChatTemplate

FORMAT = "mesh-transformer-dataset"
VERSION = 2  # 2: segments stored with prompt/completion data
PAIRS_VERSION = 3  # preference pairs; older readers, which would take the rows one by one, refuse them
LABELS_VERSION = 4  # unpaired preferences: pairs of rows with labels, which version-3 readers would ignore
CLASSES_VERSION = 5  # labelled texts: a row each, float32 labels, which version-4 readers would take for KTO's
MULTI_LABEL_VERSION = 6  # multi-label texts: a 0/1 vector a row, which version-5 readers cannot read
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
EOT = "<|endoftext|>"
SHARD_ARRAYS = ("tokens", "mask", "segments", "labels")  # a shard's files (those it has)
INDEX_SUFFIX = ".index.json"
_DECOMPRESS = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open, ".zst": None}  # each reads a file object
_KINDS = {".txt": "txt", ".jsonl": "jsonl"}


class DatasetError(UserError):
    """Bad input or a broken dataset; the message names the file (and line)."""


# ----------------------------------------------------------------------------- reading inputs

class Text(NamedTuple):
    text: str


class LabelledText(NamedTuple):
    text: str
    label: float | str | tuple  # a class number (whole, at least 0), a class name, a regression's target,
    where: str = ""             # or (a multi-label text) a tuple of class numbers or of class names


_FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_CLASS_NUMBER = 65_535  # of a multi-label text: its 0/1 vector is as long as the highest + 1


def _labelled_text(obj: dict, key: str, label_key: str, where: str) -> LabelledText:
    """A `{"text", "label"}` record (`key`: the text field, `label_key` the label's): ValueError
    naming the field at fault."""
    if label_key not in obj:
        raise ValueError(f"no field {label_key!r} (--label-key) beside {key!r}")
    label = obj[label_key]
    if isinstance(label, str) and label:
        return LabelledText(obj[key], label, where)
    if isinstance(label, list):
        names = all(isinstance(x, str) and x for x in label)
        numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= MAX_CLASS_NUMBER
                      and float(x).is_integer() for x in label)  # (1.0 as pandas writes 1: class 1)
        label = [int(x) for x in label] if numbers else label
        if not (names or numbers) or len(set(label)) != len(label):
            raise ValueError(f"field {label_key!r}: a multi-label text's classes are a list of different class "
                             f"numbers (0 to {MAX_CLASS_NUMBER:,}) or of different class names; got {json.dumps(obj[label_key])}")
        return LabelledText(obj[key], tuple(label), where)
    number = isinstance(label, (int, float)) and not isinstance(label, bool)
    if not number or not abs(label) <= _FLOAT32_MAX:  # (a float32 a row: NaN and inf fail this too)
        raise ValueError(f"field {label_key!r} must be a class number (0, 1, ...), a class name or, for a "
                         f"regression, a number (a float32); got {json.dumps(label)}")
    return LabelledText(obj[key], float(label), where)


class _ClassNumbers:
    """Labelled texts' labels as numbers: a number as it is; a class name by its place in
    `--label-names` where given (a name not among them is an error naming its line), else by its
    place among the names the data holds, sorted (as transformers' run_classification.py numbers
    them; `numbered` renumbers what `number` gave in order of first sight). One dataset holds
    numbers or names, not both, and one label a text or (multi-label texts) lists of them."""

    def __init__(self, given: list[str] | None):
        self.given = list(given) if given else None
        self.seen: dict[str, int] = {}  # name -> its number in order of first sight (no --label-names)
        self.kind: str | None = None  # "number" or "name", of the first label read
        self.multi: bool | None = None  # whether the labels are lists (multi-label texts), of the first read
        self.lists: list[tuple[float, ...]] = []  # multi-label rows' classes, as `number` gave them, by row

    def number(self, record: LabelledText) -> float | tuple[float, ...]:
        multi = isinstance(record.label, tuple)
        if self.multi not in (None, multi):
            raise DatasetError(f"{record.where}: its label is {'a list of classes' if multi else 'one label'} where "
                               f"the labels before it are {'one label each' if multi else 'lists of classes'}; one "
                               f"dataset holds texts of one label or multi-label texts, not both")
        self.multi = multi
        if multi:
            return tuple(self._one(record, label) for label in record.label)
        return self._one(record, record.label)

    def _one(self, record: LabelledText, label: float | str) -> float:
        kind = "name" if isinstance(label, str) else "number"
        if self.kind not in (None, kind):
            raise DatasetError(f"{record.where}: its label is a class {kind} where the labels before it are "
                               f"class {self.kind}s; one dataset holds one or the other")
        self.kind = kind
        if kind == "number":
            return float(label)
        if self.given is not None:
            if label not in self.given:
                raise DatasetError(f"{record.where}: label {json.dumps(label)} is not among --label-names "
                                   f"({', '.join(self.given)})")
            return float(self.given.index(label))
        return float(self.seen.setdefault(label, len(self.seen)))

    def numbered(self, labels: np.ndarray | None, where: str) -> tuple[np.ndarray, list[str] | None]:
        """(labels renumbered as the names sorted, the names by number), or (labels, --label-names);
        multi-label texts' (`lists`; `labels` None) as 0/1 vectors, one per class [n, classes]."""
        names, renumber = self.given, self.kind == "name" and self.given is None
        if renumber:
            names = sorted(self.seen)
            place = np.asarray([names.index(name) for name in self.seen], np.float32)
        if not self.multi:
            return (place[labels.astype(np.int64)] if renumber else labels), names
        numbers = [place[np.asarray(row, np.int64)] if renumber else np.asarray(row) for row in self.lists]
        high = int(max((max(r, default=-1) for r in numbers), default=-1))
        if names is not None and high >= len(names):
            raise DatasetError(f"{where}: classes up to {high}, but --label-names names classes 0 to {len(names) - 1}")
        width = len(names) if names is not None else high + 1
        hot = np.zeros((len(numbers), max(width, 1)), np.uint8)
        for row, classes in zip(hot, numbers):
            row[np.asarray(classes, np.int64)] = 1.0
        return hot, names


class Example(NamedTuple):
    prompt: str
    completion: str
    eos_in_text: bool = False  # TRL's rule (its prompt-completion records): a completion that ends with
    # the EOS token's text gets no second EOS; `{"in_text", "out_text"}` examples always get one


def _kind(path: str, explicit: bool) -> tuple[str | None, str | None]:
    """(kind 'txt' | 'jsonl' | None, compression suffix | None) from the file name."""
    name, compression = storage.basename(path).lower(), None
    for suffix in _DECOMPRESS:
        if name.endswith(suffix):
            name, compression = name[: -len(suffix)], suffix
    if name.endswith(".tar"):
        raise DatasetError(f"{path}: tar archives are not supported; extract them first")
    kind = next((k for ext, k in _KINDS.items() if name.endswith(ext)), None)
    return (kind or ("txt" if explicit else None)), compression


def find_inputs(path: str) -> list[str]:
    """``path`` itself if it is a file, else every .txt/.jsonl (optionally .gz/.zst/.xz/.bz2) below it."""
    if not storage.exists(path):
        raise DatasetError(f"{path}: no such file or directory")
    if not storage.isdir(path):
        return [path]
    files = [f for f in storage.list_files(path) if _kind(f, explicit=False)[0]]
    if not files:
        raise DatasetError(f"{path}: no input files (.txt, .jsonl, optionally compressed) found")
    return files


@contextlib.contextmanager
def _open_text(path: str, compression: str | None) -> Iterator[io.TextIOBase]:
    with contextlib.ExitStack() as stack:
        raw = stack.enter_context(storage.open(path, "rb"))
        if compression == ".zst":
            raw = stack.enter_context(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
        elif compression:
            raw = stack.enter_context(_DECOMPRESS[compression](raw))
        yield io.TextIOWrapper(raw, encoding="utf-8")


Record = (Text | LabelledText | Example | conversations.Conversation | preferences.TextPair | preferences.ConversationPair
          | preferences.LabeledText | preferences.LabeledConversation)


def _jsonl_records(f, path: str, key: str, label_key: str | None = None) -> Iterator[Record]:
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: invalid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if key in obj:
            if not isinstance(obj[key], str):
                raise DatasetError(f"{where}: field {key!r} must be a string, got {type(obj[key]).__name__}")
            if label_key is None:
                yield Text(obj[key])
                continue
            try:
                yield _labelled_text(obj, key, label_key, where)
            except ValueError as e:
                raise DatasetError(f"{where}: {e}") from None
            continue
        read = next((read for fits, read in _RECORD_KINDS if fits(obj)), None)
        if read is None:
            raise DatasetError(f"{where}: no {key!r} field, no 'in_text'/'out_text' or 'prompt'/'completion' pair, "
                               f"no 'messages', no 'chosen'/'rejected' pair and no 'completion'/'label' "
                               f"(keys: {sorted(obj)}); use --json-key to name the text field")
        try:
            yield read(obj, where)
        except ValueError as e:
            raise DatasetError(f"{where}: {e}") from None


def _in_out_text(obj: dict, where: str) -> Example:
    """An `{"in_text", "out_text"}` record (the original's prompt/completion examples)."""
    for field in ("in_text", "out_text"):
        if not isinstance(obj[field], str):
            raise ValueError(f"field {field!r} must be a string, got {type(obj[field]).__name__}")
    return Example(obj["in_text"], obj["out_text"])


def _prompt_completion(obj: dict, where: str) -> Example | conversations.Conversation:
    """A `{"prompt", "completion"}` record (TRL's prompt-completion data): two strings, an example as
    `{"in_text", "out_text"}` is; two lists of messages, a conversation trained on the completion's
    assistant turns only. ValueError naming the field at fault."""
    prompt, completion = obj["prompt"], obj["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return Example(prompt, completion, eos_in_text=True)
    if isinstance(prompt, list) and isinstance(completion, list) and prompt and completion:
        try:
            return conversations.read({"messages": [*prompt, *completion], "tools": obj.get("tools")}, where,
                                      prompt_messages=len(prompt))
        except ValueError as e:
            if "no assistant message" in str(e):
                raise ValueError("field 'completion' has no assistant message to train on") from None
            raise ValueError(f"prompt + completion: {e}") from None
    raise ValueError(f"fields 'prompt' and 'completion' must be two strings or two non-empty lists of messages, "
                     f"got {type(prompt).__name__} and {type(completion).__name__}")


# A JSONL record's kind (after the text field, `--json-key`): the first that fits reads it.
_RECORD_KINDS = (
    (preferences.is_pair, preferences.read),
    (preferences.is_unpaired, preferences.read_unpaired),
    (lambda obj: "prompt" in obj and "completion" in obj, _prompt_completion),  # TRL's prompt-completion format
    (lambda obj: "in_text" in obj and "out_text" in obj, _in_out_text),
    (lambda obj: "messages" in obj, conversations.read),
)


def read_records(path: str, json_key: str = "text", label_key: str | None = None) -> Iterator[Record]:
    """Records of one input file; a .txt file is one record (split on EOT later). With `label_key`,
    a JSONL record's text (`json_key`) and its label there are a labelled text."""
    kind, compression = _kind(path, explicit=True)
    try:
        with _open_text(path, compression) as f:
            if kind == "jsonl":
                yield from _jsonl_records(f, path, json_key, label_key)
            else:
                yield Text(f.read())
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start} of a decoded block)") from None
    except (OSError, EOFError, lzma.LZMAError, zstandard.ZstdError) as e:
        raise DatasetError(f"{path}: cannot read: {e}") from None


def wikitext_detokenize(s: str) -> str:
    """Undo WikiText's tokenization (``" @-@ "`` etc.), as the original tool's flag did."""
    for a, b in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" : ", ": "), (" ; ", "; "),
                 (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", "), ("s '", "s'")):
        s = s.replace(a, b)
    for pattern, repl in ((r"\(\s*([^\)]*?)\s*\)", r"(\1)"), (r"\[\s*([^\]]*?)\s*\]", r"[\1]"),
                          (r"{\s*([^}]*?)\s*}", r"{\1}"), (r"\"\s*([^\"]*?)\s*\"", r'"\1"'),
                          (r"'\s*([^']*?)\s*'", r"'\1'")):
        s = re.sub(pattern, repl, s)
    for a, b in (("= = = =", "===="), ("= = =", "==="), ("= =", "=="), (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
                 (" \n", "\n"), ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s")):
        s = s.replace(a, b)
    return s


# ----------------------------------------------------------------------------- building

@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """Options of ``create_finetune_dataset.py`` (same names, underscores for dashes)."""
    input_path: str
    name: str
    output_dir: str = "."
    tokenizer: str = "gpt2"
    seq: int = 2048
    json_key: str = "text"
    normalize_with_ftfy: bool = False
    normalize_with_wikitext_detokenize: bool = False
    treat_eot_as_text: bool = False
    min_unique_tokens: int = 0
    n_repack_epochs: int = 1
    seed: int = 10
    preserve_data_order: bool = False
    sequences_per_shard: int = 16384
    overwrite: bool = False
    chat_template: str | None = None  # a Jinja file for "messages" records (default: the tokenizer's, else plain)
    label_key: str | None = None  # JSONL records are labelled texts: their text and the label in this field
    label_names: list[str] | None = None  # labelled texts' class names, by number (default: those given, sorted)
    unpair: bool = False  # preference pairs become two unpaired examples (KTO's data): chosen desirable, rejected not
    verbose: bool = False
    progress: bool = False


class _Packer:
    """Cuts token pieces into rows of ``width`` tokens, each with a per-token loss mask and segment."""

    def __init__(self, width: int, pad_id: int):
        self.width, self.pad_id = width, pad_id
        self.tokens = np.zeros(0, np.int64)
        self.mask = np.zeros(0, np.uint8)
        self.pieces = np.zeros(0, np.int64)  # which piece (document, example, padding) each token is of
        self.padding = self.n_pieces = 0

    def _emit(self):
        n = len(self.tokens) // self.width * self.width
        pieces = self.pieces[:n].reshape(-1, self.width)
        segments = np.concatenate([np.zeros_like(pieces[:, :1]), np.cumsum(pieces[:, 1:] != pieces[:, :-1], axis=1)],
                                  axis=1).astype(np.uint16)  # renumbered 0, 1, ... per row
        rows = (self.tokens[:n].reshape(-1, self.width), self.mask[:n].reshape(-1, self.width), segments)
        self.tokens, self.mask, self.pieces = self.tokens[n:], self.mask[n:], self.pieces[n:]
        return rows

    def _append(self, ids, mask):
        self.tokens = np.concatenate([self.tokens, ids])
        self.mask = np.concatenate([self.mask, mask])
        self.pieces = np.concatenate([self.pieces, np.full(len(ids), self.n_pieces, np.int64)])
        self.n_pieces += 1

    def add(self, ids: np.ndarray, mask: np.ndarray, how: str):
        """Append a piece: ``how`` "cut" (a document: may straddle rows), "whole" (never straddles
        two rows), "row" (a row of its own, padded). Returns full rows [k, width]."""
        if how == "row" or (how == "whole" and len(self.tokens) + len(ids) > self.width):
            self.close_row()
        self._append(ids, mask)
        if how == "row":
            self.close_row()
        return self._emit()

    def close_row(self):
        """Pad the current partial row with EOS (mask 0; one segment of its own)."""
        pad = (-len(self.tokens)) % self.width
        self.padding += pad
        if pad:
            self._append(np.full(pad, self.pad_id, np.int64), np.zeros(pad, np.uint8))


class _Stats(dict):
    def add(self, key, n=1):
        self[key] = self.get(key, 0) + n


class Piece(NamedTuple):
    """Tokens to pack: ids, their mask, how `_Packer.add` places them, an unpaired example's label
    and a labelled text's (None for other data)."""
    ids: np.ndarray
    mask: np.ndarray
    how: str
    label: bool | None = None
    text_label: float | tuple | None = None


def _pieces(records, tok, cfg: BuildConfig, stats: _Stats, chat: ChatTemplate, classes: _ClassNumbers,
            batch_chars=1 << 20):
    """A `Piece` per document/example/conversation (a preference pair: one per side; an unpaired
    example: its own row, which `_with_kl_rows` gives its KL row), tokenizing in batches for speed."""
    import ftfy

    def clean(s):
        s = ftfy.fix_text(s, normalization="NFKC") if cfg.normalize_with_ftfy else s
        return wikitext_detokenize(s) if cfg.normalize_with_wikitext_detokenize else s

    def encode(texts):  # split_special_tokens: "<|endoftext|>" left in text stays text
        return tok(texts, add_special_tokens=False, split_special_tokens=True,
                   return_attention_mask=False)["input_ids"] if texts else []

    def without_eos(completion: str) -> str:  # as TRL: a completion already ending with EOS's text gets no second
        eos = tok.eos_token or ""
        return completion[: -len(eos)] if eos and completion.endswith(eos) else completion

    def completed(p, c):  # a prompt's and its completion's ids -> (ids, mask on the completion and its EOS)
        c = c + [tok.eos_token_id]
        return np.asarray(p + c, np.int64), np.r_[np.zeros(len(p), np.uint8), np.ones(len(c), np.uint8)]

    def rendered(conversation):
        try:
            ids, mask = conversations.encode(chat, conversation)
        except ValueError as e:
            raise DatasetError(f"{conversation.where}: {e}") from None
        return np.asarray(ids, np.int64), mask

    def flush(batch):
        docs = [s for s in batch if isinstance(s, str)]
        examples = [e for e in batch if isinstance(e, Example)]
        text_pairs = [e for e in batch if isinstance(e, preferences.TextPair)]
        labeled = [e for e in batch if isinstance(e, preferences.LabeledText)]
        doc_ids = iter(encode(docs))
        prompt_ids = iter(encode([e.prompt for e in examples]))
        completion_ids = iter(encode([without_eos(e.completion) if e.eos_in_text else e.completion for e in examples]))
        pair_ids = iter(zip(*(encode([without_eos(getattr(e, k)) if k != "prompt" else e.prompt for e in text_pairs])
                              for k in preferences.TextPair._fields)))
        labeled_ids = iter(zip(encode([e.prompt for e in labeled]), encode([without_eos(e.completion) for e in labeled])))
        texts = [e.text for e in batch if isinstance(e, LabelledText)]  # as /classify encodes them
        text_ids = iter(tok(texts, return_attention_mask=False)["input_ids"] if texts else [])

        def cut(text):  # as transformers' truncation=True cuts it: the text's end, its special tokens kept
            return tok(text, truncation=True, max_length=cfg.seq, return_attention_mask=False)["input_ids"]
        for item in batch:
            if isinstance(item, str):
                ids = next(doc_ids) + [tok.eos_token_id]
                yield Piece(np.asarray(ids, np.int64), np.ones(len(ids), np.uint8), "cut")
            elif isinstance(item, LabelledText):
                ids = next(text_ids)
                if not ids:
                    stats.add("labelled_texts_dropped_empty")
                    continue
                if len(ids) > cfg.seq:
                    stats.add("labelled_texts_cut")
                    ids = cut(item.text)
                    if len(ids) > cfg.seq:  # (the tokenizer's special tokens alone fill the row)
                        raise DatasetError(f"{item.where}: --seq {cfg.seq} holds no text beside the tokenizer's "
                                           f"{tok.num_special_tokens_to_add()} special tokens")
                # one row: the text, then a pad (a row is seq + 1 tokens); its mask (of each token as a
                # target) is 1 on the tokens after the first and the pad: as stored (of each position
                # as an input), 1 on every token of the text
                yield Piece(np.asarray([*ids, tok.eos_token_id], np.int64), np.r_[0, np.ones(len(ids), np.uint8)],
                            "row", text_label=item.label)
            elif isinstance(item, conversations.Conversation):
                ids, mask = rendered(item)
                if len(ids) > cfg.seq + 1:
                    stats.add("conversations_dropped_too_long")
                    continue
                yield Piece(ids, mask, "whole")
            elif isinstance(item, Example):
                ids, mask = completed(next(prompt_ids), next(completion_ids))
                if len(ids) > cfg.seq + 1:
                    stats.add("examples_dropped_too_long")
                    continue
                yield Piece(ids, mask, "whole")
            elif isinstance(item, (preferences.LabeledText, preferences.LabeledConversation)):
                ids, mask = (completed(*next(labeled_ids)) if isinstance(item, preferences.LabeledText)
                             else rendered(item.conversation))
                if len(ids) > cfg.seq + 1:
                    stats.add("unpaired_dropped_too_long")
                elif not mask[1:].any():  # nothing predicted (an empty prompt and completion)
                    stats.add("unpaired_dropped_untrained")
                else:
                    yield Piece(ids, mask, "row", item.label)
            else:  # a preference pair: two rows, chosen then rejected
                if isinstance(item, preferences.TextPair):
                    p, chosen, rejected = next(pair_ids)
                    sides = completed(p, chosen), completed(p, rejected)
                else:
                    sides = rendered(item.chosen), rendered(item.rejected)
                if max(len(ids) for ids, _ in sides) > cfg.seq + 1:
                    stats.add("pairs_dropped_too_long")
                    continue
                if not all(mask[1:].any() for _, mask in sides):  # a side with no token predicted (empty prompt
                    stats.add("pairs_dropped_untrained")            # and completion): no log-probability to compare
                    continue
                for ids, mask in sides:
                    yield Piece(ids, mask, "row")

    def cleaned(conversation):
        return dataclasses.replace(conversation, messages=tuple(
            {**m, "content": clean(m["content"])} if isinstance(m.get("content"), str) else m
            for m in conversation.messages))

    def items():  # documents (str), examples, conversations and preference pairs, cleaned
        for record in preferences.unpaired(records) if cfg.unpair else records:
            if isinstance(record, Example):
                stats.add("examples")
                yield record._replace(prompt=clean(record.prompt), completion=clean(record.completion))
                continue
            if isinstance(record, conversations.Conversation):
                stats.add("conversations")
                yield cleaned(record)
                continue
            if isinstance(record, preferences.TextPair):
                stats.add("pairs")
                yield preferences.TextPair(*map(clean, record))
                continue
            if isinstance(record, preferences.ConversationPair):
                stats.add("pairs")
                yield preferences.ConversationPair(cleaned(record.chosen), cleaned(record.rejected))
                continue
            if isinstance(record, LabelledText):
                stats.add("labelled_texts")
                yield LabelledText(clean(record.text), classes.number(record), record.where)
                continue
            if isinstance(record, preferences.LabeledText):
                stats.add("unpaired")
                stats.add("unpaired_desirable", int(record.label))
                yield preferences.LabeledText(clean(record.prompt), clean(record.completion), record.label)
                continue
            if isinstance(record, preferences.LabeledConversation):
                stats.add("unpaired")
                stats.add("unpaired_desirable", int(record.label))
                yield preferences.LabeledConversation(cleaned(record.conversation), record.label)
                continue
            for doc in [record.text] if cfg.treat_eot_as_text else record.text.split(EOT):
                if doc.strip():  # as the original, minus blank documents
                    stats.add("documents")
                    yield clean(doc)

    batch, chars = [], 0
    for item in items():
        batch.append(item)
        chars += _chars(item)
        if chars >= batch_chars:
            yield from flush(batch)
            batch, chars = [], 0
    yield from flush(batch)


def _label_info(labels: np.ndarray, names: list[str] | None, where: str) -> dict:
    """What a labelled-texts index says of its labels: their range, whether all are class numbers,
    and the classes' names (where named); of multi-label texts (0/1 vectors), the range of the
    classes they hold and how many classes a vector has."""
    summary = _label_summary(labels)
    low, high = summary["label_range"]
    if labels.ndim == 2 and not labels.any():
        raise DatasetError(f"{where}: no multi-label text has a class (every list is empty)")
    if labels.ndim == 1 and names is not None and not (summary["whole_labels"] and high < len(names)):
        raise DatasetError(f"{where}: labels from {low:g} to {high:g}, but --label-names names classes 0 to "
                           f"{len(names) - 1}")
    return {**summary, **({"label_names": names} if names else {})}


def _label_summary(labels: np.ndarray) -> dict:
    """A labelled-texts index's label keys: the labels' range and whether all are class numbers; of
    multi-label texts' 0/1 vectors, the range of the classes held (0 to 0 where none is) and the width."""
    if labels.ndim == 2:
        held = np.flatnonzero(labels.any(axis=0))
        return {"label_range": [float(held[0]), float(held[-1])] if len(held) else [0.0, 0.0], "whole_labels": True,
                "multi_label": True, "label_width": labels.shape[1]}
    return {"label_range": [float(labels.min()), float(labels.max())],
            "whole_labels": bool(np.all((labels >= 0) & (labels == np.round(labels))))}


def _chars(item) -> int:
    """An item's text length (what `_pieces` batches tokenization by)."""
    if isinstance(item, str):
        return len(item)
    if isinstance(item, LabelledText):
        return len(item.text)
    if isinstance(item, preferences.TextPair):
        return sum(map(len, item))
    if isinstance(item, (Example, preferences.LabeledText)):
        return len(item.prompt) + len(item.completion)
    if isinstance(item, preferences.ConversationPair):
        return item.chars
    if isinstance(item, preferences.LabeledConversation):
        item = item.conversation
    return sum(len(m.get("content") or "") for m in item.messages)


def _progress(cfg: BuildConfig, **kw):
    from tqdm import tqdm

    return tqdm(disable=not cfg.progress, mininterval=1, smoothing=0.1, **kw)


def _template_text(path: str) -> str:
    try:
        return storage.read_text(path)
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"--chat-template {path}: cannot read it ({e})") from None


def _masked(stats) -> bool:
    """Whether the data trains on part of its tokens: prompt/completion examples, conversations,
    pairs, unpaired examples or labelled texts."""
    return bool(stats.get("examples") or stats.get("conversations") or stats.get("pairs") or stats.get("unpaired")
                or stats.get("labelled_texts"))


def _pairs(stats) -> bool:
    """Whether rows come in twos: preference pairs, or unpaired examples with their KL rows (each
    makes a dataset of its own)."""
    return bool(stats.get("pairs") or stats.get("unpaired"))


def _classes(stats) -> bool:
    """Whether the data is labelled texts (a classifier's: a row and a float32 label each)."""
    return bool(stats.get("labelled_texts"))


def _labeled(stats) -> bool:
    """Whether the data is unpaired preferences (rows labelled desirable or not)."""
    return bool(stats.get("unpaired"))


def _with_kl_rows(pieces, width: int, stats: _Stats, where: str):
    """Each unpaired example's row (a labelled `Piece`) followed by its KL row: its prompt (the tokens
    before its first trained one) and the completion (the rest of that row) of the next example with
    another prompt, cut to `width` (examples in a run with one prompt, as several judged completions
    of it, or a pair unpaired, all take the completion that follows the run); the last run takes the
    first example's with another prompt than its own. Other pieces pass, in order."""
    def split(piece):
        start = int(np.argmax(piece.mask > 0))
        return (piece.ids[:start], piece.mask[:start]), (piece.ids[start:], piece.mask[start:])

    def prompt(piece):
        return split(piece)[0][0]

    def flush(run, other):
        for waiting in run:
            yield waiting
            yield _kl_row(split(waiting)[0], split(other)[1], waiting.label, width, stats)

    firsts, run, examples = [], [], 0  # firsts: the first example of the first two prompts
    for piece in pieces:
        if piece.label is None:  # (not an unpaired example)
            yield piece
            continue
        examples += 1
        if len(firsts) < 2 and not any(np.array_equal(prompt(f), prompt(piece)) for f in firsts):
            firsts.append(piece)
        if run and not np.array_equal(prompt(run[0]), prompt(piece)):
            yield from flush(run, piece)
            run = []
        run.append(piece)
    if not run:
        return
    if len(firsts) < 2:
        dropped = _dropped(stats)
        what = (f"one unpaired example{f' left, once {dropped} were dropped' if dropped else ''}" if examples == 1
                else f"every unpaired example ({examples}) has the same prompt")
        raise DatasetError(f"{where}: {what}: KTO's KL estimate pairs each prompt with another prompt's "
                           f"completion, so it needs two prompts at least")
    same = np.array_equal(prompt(firsts[0]), prompt(run[0]))
    yield from flush(run, firsts[1] if same else firsts[0])


def _dropped(stats: _Stats) -> str:
    """The unpaired examples dropped so far, "N longer than the row and M with nothing to train on"
    ("" where none were)."""
    return " and ".join(f"{stats[k]} {what}" for k, what in (("unpaired_dropped_too_long", "longer than the row"),
                                                             ("unpaired_dropped_untrained", "with nothing to train on"))
                        if stats.get(k))


def _kl_row(prompt, completion, label: bool, width: int, stats: _Stats) -> Piece:
    ids, mask = np.concatenate([prompt[0], completion[0]]), np.concatenate([prompt[1], completion[1]])
    if len(ids) > width:
        stats.add("kl_rows_cut")
        ids, mask = ids[:width], mask[:width]
    return Piece(ids, mask, "row", label)


def _pack_all(cfg: BuildConfig, tok, files: list[str], raw_tokens, raw_mask, raw_segments, raw_labels,
              stats: _Stats, chat: ChatTemplate, classes: _ClassNumbers):
    """Pass 1: read, tokenize and pack every repack epoch into raw row files (with unpaired
    examples, a label per row). -> rows per epoch."""
    rng = np.random.default_rng([cfg.seed, 0])
    packer = _Packer(cfg.seq + 1, tok.eos_token_id)
    rows_per_epoch = []
    bar = _progress(cfg, desc="tokenizing", unit="doc")

    def write(toks, masks, segments) -> int:
        toks.astype(_dtype(tok)).tofile(raw_tokens)
        masks.tofile(raw_mask)
        segments.tofile(raw_segments)
        return len(toks)

    for _ in range(cfg.n_repack_epochs):
        order = sorted(files) if cfg.preserve_data_order else [files[i] for i in rng.permutation(len(files))]
        rows = 0
        pieces = (piece for path in order for piece in _pieces(read_records(path, cfg.json_key, cfg.label_key), tok, cfg, stats, chat,
                                                                            classes))
        for piece in _with_kl_rows(pieces, cfg.seq + 1, stats, cfg.input_path):
            written = write(*packer.add(piece.ids, piece.mask, piece.how))
            if piece.label is not None:
                np.full(written, piece.label, np.uint8).tofile(raw_labels)
            if isinstance(piece.text_label, tuple):
                classes.lists += [piece.text_label] * written
            elif piece.text_label is not None:
                np.full(written, piece.text_label, np.float32).tofile(raw_labels)
            rows += written
            stats.add("tokens", len(piece.ids))
            bar.update(1)
        rows_per_epoch.append(rows)
    bar.close()
    others = [k for k in ("documents", "examples", "conversations") if stats.get(k)]
    if _classes(stats) and (others or _pairs(stats)):
        other = others[0] if others else "preference pairs" if stats.get("pairs") else "unpaired examples"
        raise DatasetError(f"{cfg.input_path}: labelled texts ({{text, label}} records) mixed with {other}; "
                           f"a classifier trains on a dataset of labelled texts only: give them a dataset of their own")
    if stats.get("pairs") and stats.get("unpaired"):
        raise DatasetError(f"{cfg.input_path}: preference pairs ({{prompt, chosen, rejected}} records) mixed with "
                           f"unpaired examples ({{prompt, completion, label}}); each makes a dataset of its own")
    if stats.get("unpaired") and others:
        raise DatasetError(f"{cfg.input_path}: unpaired examples ({{prompt, completion, label}} records) mixed with "
                           f"{others[0]}; KTO trains on a dataset of unpaired examples only: give them a dataset "
                           f"of their own")
    if _pairs(stats) and others:
        raise DatasetError(f"{cfg.input_path}: preference pairs ({{prompt, chosen, rejected}} records) mixed with "
                           f"{others[0]}; DPO trains on a dataset of pairs only: give them a dataset of their own")
    if _masked(stats) and len(packer.tokens):  # masked datasets keep their last row
        packer.close_row()
        rows_per_epoch[-1] += write(*packer._emit())
    stats["trailing_tokens_dropped"] = len(packer.tokens)
    stats["padding_tokens"] = packer.padding
    return rows_per_epoch


def _dtype(tok) -> np.dtype:
    return np.dtype(np.uint16 if len(tok) <= 1 << 16 else np.uint32)


def _unique_counts(rows: np.ndarray) -> np.ndarray:
    s = np.sort(rows, axis=1)
    return 1 + (np.diff(s, axis=1) != 0).sum(axis=1)


def _final_order(cfg: BuildConfig, tok, tokens: np.ndarray, rows_per_epoch, stats) -> np.ndarray:
    """Pass 2 plan: row ids to write, shuffled within each repack epoch, low-diversity rows dropped
    (a preference pair's two rows move, and are dropped, together)."""
    rng = np.random.default_rng([cfg.seed, 1])
    order, start = [], 0
    group = 2 if _pairs(stats) else 1
    for n in rows_per_epoch:
        ids = np.arange(start, start + n)
        if cfg.min_unique_tokens > 0 and n:
            counts = np.concatenate([_unique_counts(tokens[i:min(i + 4096, start + n)])
                                     for i in range(start, start + n, 4096)])
            passes = (counts >= cfg.min_unique_tokens).reshape(-1, group)  # a pair by both sides; an unpaired
            keep = np.repeat(passes[:, 0] if _labeled(stats) else passes.all(axis=1), group)  # example by its own row
            if cfg.verbose:
                for i in ids[~keep]:
                    print(f"excluding row with {counts[i - start]} unique tokens:\n"
                          f"{tok.decode(tokens[i])!r}\n")
            stats.add("sequences_below_min_unique", int((~keep).sum()))
            ids = ids[keep]
        start += n
        if not cfg.preserve_data_order:  # (one row at a time as before pairs existed: the same orders)
            ids = rng.permutation(ids) if group == 1 else rng.permutation(ids.reshape(-1, group)).reshape(-1)
        order.append(ids)
    return np.concatenate(order) if order else np.zeros(0, np.int64)


class _HashingWriter:
    """Forwards writes to ``f`` and keeps their sha256 (np.save streams through ``write``)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, b):
        self.sha.update(b)
        return self.f.write(b)


def _save_npy(path: str, array: np.ndarray) -> str:
    """Atomically write ``array`` as .npy at ``path``; returns its sha256."""
    with storage.atomic_writer(path) as f:
        w = _HashingWriter(f)
        np.lib.format.write_array(w, np.ascontiguousarray(array), allow_pickle=False)
    return w.sha.hexdigest()


def _write_shards(cfg, order, tokens, masks, segments, labels, has_mask, has_segments) -> list[dict]:
    """Shards of rows ``order``; with ``has_mask`` (examples, conversations, pairs) masks too, with
    ``has_segments`` (packed examples and conversations) segments, with ``labels`` (unpaired
    examples: a row's label, else None) labels."""
    shards = []
    bar = _progress(cfg, desc="writing shards", unit="seq", total=len(order))
    for i, start in enumerate(range(0, len(order), cfg.sequences_per_shard)):
        ids = order[start:start + cfg.sequences_per_shard]
        shard = {"tokens": f"{cfg.name}-{i:05d}.tokens.npy", "mask": None, "segments": None, "n_sequences": len(ids),
                 "sha256": {}}
        shard["sha256"]["tokens"] = _save_npy(storage.join(cfg.output_dir, shard["tokens"]), tokens[ids])
        if has_mask:
            shard["mask"] = f"{cfg.name}-{i:05d}.mask.npy"
            shard["sha256"]["mask"] = _save_npy(storage.join(cfg.output_dir, shard["mask"]), masks[ids, 1:])
        if has_segments:
            shard["segments"] = f"{cfg.name}-{i:05d}.segments.npy"
            shard["sha256"]["segments"] = _save_npy(storage.join(cfg.output_dir, shard["segments"]), segments[ids])
        if labels is not None:
            shard["labels"] = f"{cfg.name}-{i:05d}.labels.npy"
            shard["sha256"]["labels"] = _save_npy(storage.join(cfg.output_dir, shard["labels"]), labels[ids])
        shards.append(shard)
        bar.update(len(ids))
    bar.close()
    return shards


def index_path(output_dir: str, name: str) -> str:
    return storage.join(output_dir, name + INDEX_SUFFIX)


def build_dataset(cfg: BuildConfig) -> str:
    """Tokenize and pack ``cfg.input_path`` into a dataset; returns the index path.

    Everything that can fail on bad input happens before the output directory is touched:
    pass 1 packs into a local temporary directory, pass 2 writes shards (each atomically) and
    commits the index last.
    """
    from mesh_transformer.io.tokenizer import load_tokenizer

    if cfg.seq < 1 or cfg.n_repack_epochs < 1 or cfg.sequences_per_shard < 1:
        raise DatasetError("seq, n_repack_epochs and sequences_per_shard must be positive")
    out_index = index_path(cfg.output_dir, cfg.name)
    old = json.loads(storage.read_text(out_index)) if storage.exists(out_index) else None
    if old and not cfg.overwrite:
        raise DatasetError(f"{out_index} already exists (pass --overwrite to replace it)")
    files = find_inputs(cfg.input_path)
    try:
        tok = load_tokenizer(cfg.tokenizer)
    except ValueError as e:
        raise DatasetError(str(e)) from None
    chat = ChatTemplate(tok, _template_text(cfg.chat_template) if cfg.chat_template else None)
    width, dtype, stats = cfg.seq + 1, _dtype(tok), _Stats(files=len(files))
    if cfg.label_key is not None and cfg.label_key == cfg.json_key:
        raise DatasetError(f"--label-key {cfg.label_key}: the label's field, not the text's (--json-key)")
    if cfg.label_names is not None and cfg.label_key is None:
        raise DatasetError("--label-names names labelled texts' classes: give --label-key (the records' label field) too")
    if cfg.label_names is not None and (not cfg.label_names or not all(cfg.label_names)
                                        or len(set(cfg.label_names)) != len(cfg.label_names)):
        raise DatasetError(f"--label-names: the classes' names, each once, in class-number order; "
                           f"got {json.dumps(cfg.label_names)}")
    classes = _ClassNumbers(cfg.label_names)
    with tempfile.TemporaryDirectory(prefix="mesh-transformer-dataset-") as tmp:
        raw_tokens, raw_mask, raw_segments, raw_labels = (os.path.join(tmp, f"{k}.raw")
                                                          for k in ("tokens", "mask", "segments", "labels"))
        with (open(raw_tokens, "wb") as ft, open(raw_mask, "wb") as fm, open(raw_segments, "wb") as fs,
              open(raw_labels, "wb") as fl):
            rows_per_epoch = _pack_all(cfg, tok, files, ft, fm, fs, fl, stats, chat, classes)
        if not stats.get("documents") and not _masked(stats):
            raise DatasetError(f"{cfg.input_path}: empty input (no documents, examples or conversations found)")
        if cfg.label_key is not None and not _classes(stats):
            raise DatasetError(f"{cfg.input_path}: --label-key {cfg.label_key}, but no record has a text field "
                               f"({cfg.json_key!r}, --json-key) to label")
        n_rows = sum(rows_per_epoch)
        if n_rows == 0 and _labeled(stats):
            raise DatasetError(f"{cfg.input_path}: no unpaired example left to train on: of {stats['unpaired']} "
                               f"read, {_dropped(stats)} (seq+1 = {width} tokens)")
        if n_rows == 0 and _classes(stats):
            raise DatasetError(f"{cfg.input_path}: every labelled text is empty (no tokens)")
        if n_rows == 0 and _pairs(stats):
            raise DatasetError(f"{cfg.input_path}: every preference pair has a side longer than seq+1 = {width} tokens")
        if n_rows == 0:
            raise DatasetError(f"{cfg.input_path}: only {stats.get('tokens', 0)} tokens, fewer than one "
                               f"sequence of seq+1 = {width} tokens")
        tokens = np.memmap(raw_tokens, dtype, "r", shape=(n_rows, width))
        masks = np.memmap(raw_mask, np.uint8, "r", shape=(n_rows, width))
        segments = np.memmap(raw_segments, np.uint16, "r", shape=(n_rows, width))
        labels = (None if classes.multi else np.fromfile(raw_labels, np.float32) if _classes(stats) else
                  np.fromfile(raw_labels, np.uint8) if _labeled(stats) else None)
        order = _final_order(cfg, tok, tokens, rows_per_epoch, stats)
        if len(order) == 0:
            raise DatasetError(f"{cfg.input_path}: every sequence has fewer than "
                               f"--min-unique-tokens={cfg.min_unique_tokens} unique tokens")
        label_info = {}
        if _classes(stats):
            labels, names = classes.numbered(labels, cfg.input_path)
            label_info = _label_info(labels[order], names, cfg.input_path)
        storage.makedirs(cfg.output_dir)
        if old:  # from here until the new index lands, no index points at half-replaced shards
            storage.remove(out_index)
        has_segments = _masked(stats) and not _pairs(stats) and not _classes(stats)  # a pair's or text's row
                                                                                     # holds one example
        shards = _write_shards(cfg, order, tokens, masks, segments, labels, _masked(stats), has_segments)
        del tokens, masks, segments
    version = (MULTI_LABEL_VERSION if classes.multi else CLASSES_VERSION if _classes(stats) else LABELS_VERSION if _labeled(stats)
               else PAIRS_VERSION if _pairs(stats) else VERSION)
    index = {
        "format": FORMAT, "version": version, "name": cfg.name, "seq": cfg.seq,
        "dtype": dtype.name, "tokenizer": cfg.tokenizer, "vocab_size": len(tok), "eos_id": tok.eos_token_id,
        "n_sequences": int(len(order)), "n_tokens": int(len(order) * width),
        "has_mask": _masked(stats), "has_segments": has_segments, "pairs": _pairs(stats),
        "labels": _labeled(stats) or _classes(stats), "classes": _classes(stats),
        **label_info,
        "shards": shards,
        "stats": dict(stats),
        "options": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("verbose", "progress")},
    }
    storage.write_text(out_index, json.dumps(index, indent=1))
    new_files = {s.get(k) for s in shards for k in SHARD_ARRAYS}
    for stale in ({s.get(k) for s in old["shards"] for k in SHARD_ARRAYS} - new_files if old else ()):
        if stale:
            with contextlib.suppress(FileNotFoundError):
                storage.remove(storage.join(cfg.output_dir, stale))
    return out_index


# ----------------------------------------------------------------------------- loading

def default_cache_dir() -> str:
    return os.environ.get("MESH_TRANSFORMER_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "mesh_transformer", "datasets"))


def _sha256(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


class Dataset:
    """Memory-mapped view of a dataset's shards: ``read(ids)`` gathers sequences by global id."""

    def __init__(self, index: dict, tokens: list[np.ndarray], masks: list[np.ndarray | None], path: str = "",
                 segments: list[np.ndarray | None] | None = None, labels: list[np.ndarray | None] | None = None):
        self.index, self.path = index, path
        self._tokens, self._masks = tokens, masks
        self._segments = segments or [None] * len(tokens)
        self._labels = labels or [None] * len(tokens)
        self._starts = np.cumsum([0] + [len(t) for t in tokens])
        self.seq, self.n_sequences = index["seq"], int(self._starts[-1])
        self.has_mask, self.eos_id = index["has_mask"], index["eos_id"]
        # rows 2i, 2i+1: a preference pair's chosen and rejected, or an unpaired example's row and KL row
        self.pairs = bool(index.get("pairs"))
        self.labels = bool(index.get("labels"))  # each row labelled: unpaired preferences (desirable or not),
        self.classes = bool(index.get("classes"))  # or labelled texts (a classifier's data: a text a row)
        self.multi_label = bool(index.get("multi_label"))  # labelled with lists of classes: a 0/1 vector a row
        self.label_width = int(index.get("label_width", 1))  # numbers a row's label is (classes, multi-label)
        if self.pairs and self.n_sequences % 2:
            raise DatasetError(f"{path or 'dataset'}: holds preference pairs but an odd number of rows "
                               f"({self.n_sequences}); it is damaged: build it again")
        if self.labels or self.classes:
            problem = ("its index has no labels" if not self.labels
                       else "a shard has no labels" if any(x is None for x in self._labels)
                       else "its rows are paired" if self.classes and self.pairs
                       else "its rows are not paired" if not self.classes and not self.pairs else None)
            if problem:
                what = "labelled texts" if self.classes else "unpaired examples"
                raise DatasetError(f"{path or 'dataset'}: its index says it holds {what}, but {problem}; "
                                   f"it is damaged: build it again")
        self.has_segments = all(s is not None for s in self._segments)  # stored; else the EOS rule

    def __len__(self) -> int:
        return self.n_sequences

    @classmethod
    def from_arrays(cls, tokens: np.ndarray, mask: np.ndarray | None = None, eos_id: int = 50256,
                    segments: np.ndarray | None = None, pairs: bool = False,
                    labels: np.ndarray | None = None, classes: bool = False) -> "Dataset":
        """An in-memory dataset (tests, synthetic data): tokens [n, seq+1], mask [n, seq] or None,
        segments [n, seq+1] or None (derived from EOS when read); `pairs`: rows are preference pairs;
        `labels` [n] or None: unpaired examples' labels (with `pairs`: rows and their KL rows), or with
        `classes` labelled texts' (a class number or a regression's target a row), or [n, classes]
        multi-label texts' (a 0/1 vector a row)."""
        index = {"seq": tokens.shape[1] - 1, "has_mask": mask is not None, "eos_id": eos_id, "pairs": pairs,
                 "labels": labels is not None, "classes": classes}
        if classes:
            index.update(_label_summary(labels))
        return cls(index, [tokens], [mask], segments=[segments], labels=[labels])

    @classmethod
    def open(cls, path: str, cache_dir: str | None = None, verify: bool = False) -> "Dataset":
        """Open an index (local or gs://). gs:// shards are downloaded once into ``cache_dir``
        (default ``$MESH_TRANSFORMER_CACHE`` or ~/.cache/mesh_transformer/datasets), keyed by
        their sha256 and checked on download; local shards are mapped in place
        (``verify=True`` checks their sha256 too)."""
        try:
            index = json.loads(storage.read_text(path))
        except (OSError, json.JSONDecodeError) as e:
            raise DatasetError(f"{path}: cannot read dataset index: {e}") from None
        if index.get("format") != FORMAT or index.get("version") not in READABLE_VERSIONS:
            raise DatasetError(f"{path}: not a {FORMAT} index of version {' or '.join(map(str, READABLE_VERSIONS))} "
                               f"(format={index.get('format')!r}, version={index.get('version')!r})")
        base = storage.dirname(path)
        arrays = {kind: [] for kind in SHARD_ARRAYS}
        for shard in index["shards"]:
            for kind in arrays:
                if not shard.get(kind):
                    arrays[kind].append(None)
                    continue
                local = _local_copy(storage.join(base, shard[kind]), shard["sha256"][kind], cache_dir, verify)
                arr = np.load(local, mmap_mode="r")
                want = ((shard["n_sequences"], *([index["label_width"]] if index.get("multi_label") else []))
                        if kind == "labels" else (shard["n_sequences"], index["seq"] + (kind != "mask")))
                if arr.shape != want:
                    raise DatasetError(f"{local}: shape {arr.shape}, index {path} says {want}")
                arrays[kind].append(arr)
        return cls(index, arrays["tokens"], arrays["mask"], path, arrays["segments"], arrays["labels"])

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sequences ``ids`` (-1 = padding) -> tokens int32 [k, seq+1], mask float32 [k, seq]."""
        ids = np.asarray(ids, np.int64)
        tokens = np.full((len(ids), self.seq + 1), self.eos_id, np.int32)
        mask = np.zeros((len(ids), self.seq), np.float32)
        shard = np.searchsorted(self._starts, ids, side="right") - 1
        for s in np.unique(shard[ids >= 0]):
            sel = np.flatnonzero((shard == s) & (ids >= 0))
            rows = ids[sel] - self._starts[s]
            tokens[sel] = self._tokens[s][rows][:, :self.seq + 1]  # (a mixture's longer rows: cut to its seq)
            mask[sel] = 1.0 if self._masks[s] is None else self._masks[s][rows][:, :self.seq]
        return tokens, mask

    def read_labels(self, ids: np.ndarray) -> np.ndarray:
        """float32 [k]: 1 where row ``ids`` (-1 = padding, 0) is a desirable example's (unpaired data);
        a labelled text's label (0 for padding); [k, label_width] a multi-label text's 0/1 vector."""
        ids = np.asarray(ids, np.int64)
        out = np.zeros((len(ids), *([self.label_width] if self.multi_label else [])), np.float32)
        shard = np.searchsorted(self._starts, ids, side="right") - 1
        for s in np.unique(shard[ids >= 0]):
            sel = np.flatnonzero((shard == s) & (ids >= 0))
            out[sel] = self._labels[s][ids[sel] - self._starts[s]]
        return out

    def read_segments(self, ids: np.ndarray, tokens: np.ndarray, documents_apart: bool = True) -> np.ndarray:
        """uint16 [k, seq+1] segments of sequences ``ids`` (their ``tokens`` from `read`): the stored
        ones, or for a dataset without them (plain text, version 1) the EOS rule (`segment_ids`);
        in a mixture, each shard's own way, and a plain-text shard's rows one segment each unless
        `documents_apart` (the config's `document_masking`), as they train alone."""
        if not any(s is not None for s in self._segments) and documents_apart:
            return segment_ids(tokens, self.eos_id)
        ids = np.asarray(ids, np.int64)
        out = np.zeros((len(ids), self.seq + 1), np.uint16)  # padding rows (-1): one segment, mask 0
        shard = np.searchsorted(self._starts, ids, side="right") - 1
        for s in np.unique(shard[ids >= 0]):
            sel = np.flatnonzero((shard == s) & (ids >= 0))
            stored = self._segments[s]
            if stored is not None:
                out[sel] = stored[ids[sel] - self._starts[s]][:, :self.seq + 1]
            elif documents_apart or self._masks[s] is not None:  # (a version-1 dataset's examples: EOS rule)
                out[sel] = segment_ids(tokens[sel], self.eos_id)
        return out

    def epoch_order(self, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
        """The sequence ids epoch `epoch` of a `Loader`'s stream reads, in order: a permutation drawn
        from (seed, epoch), by pairs where rows are paired; all ids in order without `shuffle`."""
        n, rng = len(self), np.random.default_rng([seed, epoch])
        if not shuffle:
            return np.arange(n)
        if self.pairs:  # a pair's rows stay together
            return (2 * rng.permutation(n // 2)[:, None] + np.arange(2)).reshape(-1)
        return rng.permutation(n)

    def stream_key(self) -> dict:
        """What a loader's saved position depends on besides its seed (a mixture adds its parts)."""
        return {"n_sequences": len(self)}


class Mixture(Dataset):
    """Datasets trained on together in set proportions (the config's `train_set` as {path: weight}).

    Its rows are its parts' rows one after the other, and a `Loader` reads it as it reads any
    dataset, an epoch at a time (an epoch: as many rows as the parts hold together). Each epoch
    takes from each part its share of the epoch (`weights`, normalised; largest remainders, so the
    shares add up) and shuffles them together. A part reads its own stream of permutations (drawn
    from (seed, part, block of passes)): a part that gives fewer rows than it holds gives the next ones in the
    next epoch, one that gives more goes through all its rows before any comes again. Rows are
    read at the shortest part's `seq`; a pair of rows (preference data) moves as one.
    """

    def __init__(self, parts: list[Dataset], weights: list[float], paths: list[str]):
        first = parts[0]
        for path, part in zip(paths[1:], parts[1:]):
            for what, ours, theirs in [
                    ("rows in pairs (preference data)", first.pairs, part.pairs),
                    ("labels", first.labels, part.labels),
                    ("labelled texts", first.classes, part.classes),
                    ("multi-label texts", first.multi_label, part.multi_label),
                    ("the label width", first.label_width, part.label_width),
                    ("the end-of-text id", first.eos_id, part.eos_id),
                    ("the vocabulary size", first.index.get("vocab_size"), part.index.get("vocab_size"))]:
                if ours != theirs:
                    said = (lambda v: ("yes" if v else "no") if isinstance(v, bool) else json.dumps(v))
                    raise DatasetError(f"{path}: the datasets of a mixture must be alike, but it and {paths[0]} "
                                       f"differ in {what} ({said(theirs)} and {said(ours)})")
        index = {**first.index, "seq": min(p.seq for p in parts), "has_mask": any(p.has_mask for p in parts),
                 "shards": [s for p in parts for s in p.index.get("shards", [])]}
        super().__init__(index, [t for p in parts for t in p._tokens], [m for p in parts for m in p._masks],
                         " + ".join(paths), [g for p in parts for g in p._segments],
                         [lab for p in parts for lab in p._labels])
        self.parts, self.paths = parts, paths
        self.weights = [w / sum(weights) for w in weights]
        self._offsets = np.cumsum([0] + [len(p) for p in parts])[:-1]
        self._unit = 2 if self.pairs else 1  # rows that move as one
        self._units = [len(p) // self._unit for p in parts]
        self._shares = _largest_remainders(self.weights, sum(self._units))  # units of each part an epoch
        self._kept: dict[int, tuple] = {}  # part -> ((seed, block), its last block of several passes)
        for path, part in zip(paths, parts):
            if len(part) < self._unit:
                raise DatasetError(f"{path}: holds no {'pair' if self.pairs else 'row'}: a mixture's part gives rows")
        for path, weight, share in zip(paths, weights, self._shares):
            if share == 0:
                raise DatasetError(f"{path}: its weight {weight:g} gives it no row of an epoch of {len(self):,} rows")

    def stream_key(self) -> dict:
        """The stream depends on each part's rows and share of an epoch (not on how the weights were
        written, nor where the files lie)."""
        return {"n_sequences": len(self),
                "mixture": [[len(p), share * self._unit, _fingerprint(p)] for p, share in zip(self.parts, self._shares)]}

    def epoch_shares(self) -> list[int]:
        """How many of each part's units (rows; pairs where paired) an epoch takes."""
        return list(self._shares)

    def describe(self) -> str:
        """One line: each part's share of an epoch, and how many passes over its rows that is."""
        return "mixture, an epoch of {:,} rows: ".format(len(self)) + ", ".join(
            f"{path} {share * self._unit:,} rows ({weight:.0%}, {share / units:.2f} of its rows)"
            for path, weight, share, units in zip(self.paths, self.weights, self._shares, self._units))

    def epoch_order(self, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
        taken = [offset // self._unit + self._part_stream(k, seed, shuffle, epoch * share, share)
                 for k, (offset, share) in enumerate(zip(self._offsets, self._shares))]
        units = np.concatenate(taken)
        if shuffle:
            units = np.random.default_rng([seed, epoch]).permutation(units)
        return (self._unit * units[:, None] + np.arange(self._unit)).reshape(-1)

    def _part_stream(self, k: int, seed: int, shuffle: bool, start: int, count: int) -> np.ndarray:
        """Units [start, start + count) of part k's stream: its units pass after pass, each pass a
        permutation (`_passes`)."""
        n, out = self._units[k], []
        size = _passes_per_block(n) * n  # units of a block of passes
        while count > 0:
            block, offset = divmod(start, size)
            units = (self._passes(k, seed, block, n) if shuffle
                     else np.tile(np.arange(n), _passes_per_block(n))[None]).reshape(-1)
            take = min(count, size - offset)
            out.append(units[offset:offset + take])
            start, count = start + take, count - take
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def _passes(self, k: int, seed: int, block: int, n: int) -> np.ndarray:
        """[passes, n]: part k's permutations of block `block` of its passes, drawn together from
        (seed, k, block) (a part of few rows given many times an epoch costs one draw, not one a pass).
        A block of several passes (at most ~64k units) is kept until the part's next is drawn; a whole
        pass of a big part is not kept."""
        kept = self._kept.get(k)
        if kept is not None and kept[0] == (seed, block):
            return kept[1]
        rng = np.random.default_rng([seed, 1_000_003, k, block])
        if _passes_per_block(n) == 1:
            return rng.permutation(n)[None]
        passes = np.argsort(rng.random((_passes_per_block(n), n)), axis=1, kind="stable")
        passes.flags.writeable = False
        self._kept[k] = ((seed, block), passes)
        return passes


def _passes_per_block(n: int) -> int:
    """A part's passes drawn at once: about 64k units a draw."""
    return max(1, (1 << 16) // max(n, 1))


def _fingerprint(ds: Dataset) -> str | None:
    """A short digest of a dataset's token shards (their sha256s from its index; None in memory)."""
    shas = [shard.get("sha256", {}).get("tokens", "") for shard in ds.index.get("shards", [])]
    return hashlib.sha256("".join(shas).encode()).hexdigest()[:16] if shas else None


def _largest_remainders(shares: list[float], total: int) -> list[int]:
    """Whole counts in proportion to `shares` (which add up to 1) that add up to `total`."""
    exact = [share * total for share in shares]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(shares)), key=lambda i: counts[i] - exact[i])[:total - sum(counts)]:
        counts[i] += 1
    return counts


def _local_copy(path: str, sha256: str, cache_dir: str | None, verify: bool) -> str:
    if not storage.is_gcs(path):
        if verify and _sha256(path) != sha256:
            raise DatasetError(f"{path}: sha256 does not match the index")
        return path
    local = os.path.join(cache_dir or default_cache_dir(), sha256[:16] + "-" + storage.basename(path))
    if not os.path.exists(local):  # a unique temp name per process, so concurrent downloads are safe
        with storage.open(path, "rb") as src, storage.atomic_writer(local) as dst:
            hashing = _HashingWriter(dst)
            shutil.copyfileobj(src, hashing, 8 << 20)
            if hashing.sha.hexdigest() != sha256:  # raising here discards the download
                raise DatasetError(f"{path}: sha256 of the downloaded shard does not match the index")
    return local


def segment_ids(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """uint16 [..., seq+1]: which document or example of its row each token belongs to.

    Every document and every prompt/completion example ends with EOS, so a new segment starts after
    each EOS (padding EOS tokens are one-token segments, all with mask 0). The rule for datasets that
    do not store segments: plain text (a document holds no EOS but its last token) and version-1
    datasets (where an example whose prompt contains the EOS id is split in two).
    """
    ends = (tokens == eos_id).astype(np.int64)
    starts = np.concatenate([np.zeros_like(ends[..., :1]), ends[..., :-1]], axis=-1)
    return (np.cumsum(starts, axis=-1) % 65536).astype(np.uint16)


class StreamMismatch(ValueError):
    """A saved loader position of another stream (other data, mixture or seed) than this loader's;
    `key`: the state's key that differs."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


class Loader:
    """Batches ``{"tokens": int32 [A, B_local, seq+1], "mask": float32 [A, B_local, seq]}`` (with
    unpaired preferences also ``"labels"``: float32 [A, B_local, 1]).

    Sequences are read as one stream: epoch ``e`` is a permutation of all ids drawn from
    ``(seed, e)`` (identity when ``shuffle=False``), epochs follow each other, and step ``k``
    takes the next ``A * global_batch`` ids of the stream as ``[A, global_batch]``. A process reads
    only its columns ``rows = (start, stop)`` of that (what its devices hold of the batch sharding;
    processes that share a dp row read the same rows); without ``rows``, process ``p`` of ``n``
    reads ``[p * B_local, (p+1) * B_local)`` with ``B_local = global_batch // n``. With ``repeat=False`` the stream is one epoch and the last
    batch is padded with mask-0 rows. A background thread keeps ``prefetch`` batches ready.

    ``state()`` is the position after the last batch handed out; ``Loader(..., state=s)``
    continues exactly there (also with another process count or batch size).

    A dataset of preference pairs is shuffled by pairs, so a batch (and each process's even slice
    of it) holds whole pairs: rows 2i and 2i+1, chosen and rejected.
    """

    def __init__(self, dataset: Dataset, global_batch: int, seed: int = 0, *, process_index: int = 0,
                 process_count: int = 1, rows: tuple[int, int] | None = None, accumulation: int = 1,
                 shuffle: bool = True, repeat: bool = True, state: dict | None = None, prefetch: int = 4,
                 segments: bool = False, documents_apart: bool = True):
        if global_batch % process_count:
            raise ValueError(f"global_batch={global_batch} is not divisible by process_count={process_count}")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} not in [0, {process_count})")
        if len(dataset) == 0:
            raise ValueError(f"{dataset.path}: dataset has no sequences")
        self.dataset, self.seed, self.shuffle, self.repeat = dataset, seed, shuffle, repeat
        self.segments = segments  # add "segments" [A, B_local, seq+1] (see `Dataset.read_segments`)
        self.documents_apart = documents_apart  # plain text's documents as segments (`document_masking`)
        self.accumulation, self.global_batch = accumulation, global_batch
        if rows is None:
            rows = (process_index * global_batch // process_count, (process_index + 1) * global_batch // process_count)
        if not 0 <= rows[0] < rows[1] <= global_batch:
            raise ValueError(f"rows={rows} are not a slice of a batch of {global_batch}")
        if dataset.pairs and (global_batch % 2 or rows[0] % 2 or rows[1] % 2):
            raise ValueError(f"{dataset.path or 'dataset'} holds preference pairs: a batch ({global_batch} rows) and "
                             f"each process's rows {rows} must hold whole pairs (even counts)")
        self.local_batch = rows[1] - rows[0]
        self._columns = slice(*rows)
        self._position = self._resume(state) if state else 0  # stream index of the next sequence
        self._prefetch, self._queue, self._thread = prefetch, None, None
        self._stop = threading.Event()
        self._orders: dict[int, np.ndarray] = {}

    def _resume(self, state: dict) -> int:
        ours = {"seed": self.seed, "shuffle": self.shuffle, "mixture": None, **self.dataset.stream_key()}
        for key, value in ours.items():  # ("mixture": absent from a single dataset's state, as before mixtures)
            if state.get(key) != value:
                raise StreamMismatch(key, f"loader state has {key}={state.get(key)!r}, this loader has {value!r}")
        return state["epoch"] * len(self.dataset) + state["position"]

    def state(self) -> dict:
        epoch, position = divmod(self._position, len(self.dataset))
        return {"epoch": int(epoch), "position": int(position), "seed": self.seed, "shuffle": self.shuffle,
                **self.dataset.stream_key()}

    @property
    def steps_per_epoch(self) -> float:
        return len(self.dataset) / (self.accumulation * self.global_batch)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}  # keep 2 at most
            self._orders[epoch] = self.dataset.epoch_order(epoch, self.seed, self.shuffle)
        return self._orders[epoch]

    def _ids(self, start: int, count: int) -> np.ndarray:
        """Sequence ids at stream positions [start, start+count); -1 past the end without repeat."""
        n, out = len(self.dataset), []
        while count:
            epoch, offset = divmod(start, n)
            if epoch and not self.repeat:
                out.append(np.full(count, -1, np.int64))
                break
            take = min(count, n - offset)
            out.append(self._order(epoch)[offset:offset + take])
            start, count = start + take, count - take
        return np.concatenate(out)

    def batch_at(self, position: int) -> dict:
        """The batch whose first sequence is at stream ``position`` (this process's slice)."""
        per_step = self.accumulation * self.global_batch
        ids = self._ids(position, per_step).reshape(self.accumulation, self.global_batch)[:, self._columns]
        tokens, mask = self.dataset.read(ids.reshape(-1))
        a, b = ids.shape
        batch = {"tokens": tokens.reshape(a, b, -1), "mask": mask.reshape(a, b, -1)}
        if self.dataset.labels:  # [A, B, 1] (multi-label texts: [A, B, classes]), so every array of a batch shards alike
            batch["labels"] = self.dataset.read_labels(ids.reshape(-1)).reshape(a, b, -1)
        if self.segments:
            batch["segments"] = self.dataset.read_segments(ids.reshape(-1), tokens,
                                                           self.documents_apart).reshape(a, b, -1)
        return batch

    def _produce(self, position: int):
        per_step = self.accumulation * self.global_batch
        try:
            while not self._stop.is_set():
                if not self.repeat and position >= len(self.dataset):
                    item = StopIteration()
                else:
                    item = (self.batch_at(position), position + per_step)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        pass
                if isinstance(item, StopIteration):
                    return
                position += per_step
        except Exception as e:  # surfaces in the consumer's next()
            self._queue.put(e)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._thread is None:
            self._queue = queue.Queue(maxsize=self._prefetch)
            self._thread = threading.Thread(target=self._produce, args=(self._position,), daemon=True)
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._queue.put(item)  # stay exhausted / failed on further calls
            raise item
        batch, self._position = item
        return batch

    def close(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if hasattr(self, "_stop"):
            self._stop.set()
