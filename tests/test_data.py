"""Tokenizer, dataset tool and loader: token-exact checks on tiny corpora."""
import gzip
import json
import os
import re

import numpy as np
import pytest
import zstandard

import create_finetune_dataset
from mesh_transformer.io import storage
from helpers import refusal, word_tokenizer
from mesh_transformer.data import BuildConfig, Dataset, DatasetError, Loader, build_dataset, segment_ids
from mesh_transformer.io.tokenizer import load_tokenizer

EOS = 50256
DOCS = ["The quick brown fox jumps over the lazy dog. " * 3,
        "Call me Ishmael. Some years ago, never mind how long precisely, I went to sea.",
        "It was the best of times, it was the worst of times; café, naïve, 日本語 — all fine."]
SEQ = 16


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def stream(tok, docs):
    """What packing must produce before cutting: each document's tokens, then EOS."""
    return [t for d in docs for t in tok.encode(d) + [EOS]]


def build(src, out, name="ds", **kw):
    cfg = BuildConfig(input_path=str(src), name=name, output_dir=str(out), seq=kw.pop("seq", SEQ),
                      preserve_data_order=kw.pop("preserve_data_order", True), **kw)
    return Dataset.open(build_dataset(cfg))


def all_rows(ds):
    return ds.read(np.arange(len(ds)))


# ----------------------------------------------------------------------------- tokenizer

def test_gpt2_tokenizer_offline(tok, tmp_path):
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.eos_token_id == EOS and len(tok) == 50257
    text = "Unicode café 日本語 and  spaces\n\ttabs"
    assert tok.decode(tok.encode(text)) == text
    tok.save_pretrained(tmp_path)  # a local directory loads through AutoTokenizer
    assert load_tokenizer(str(tmp_path)).encode("Hello world") == [15496, 995]


def test_unreachable_hub_name_is_a_clear_error():
    with pytest.raises(ValueError, match="could not load tokenizer 'no-such-org/no-such-tokenizer'"):
        load_tokenizer("no-such-org/no-such-tokenizer")


# ----------------------------------------------------------------------------- dataset tool

def test_txt_splits_on_endoftext_and_packs_seq_plus_one(tok, tmp_path):
    (tmp_path / "in.txt").write_text("<|endoftext|>".join(DOCS) + "<|endoftext|>\n", encoding="utf-8")
    ds = build(tmp_path / "in.txt", tmp_path / "out")
    want = stream(tok, DOCS)
    tokens, mask = all_rows(ds)
    assert tokens.shape == (len(want) // (SEQ + 1), SEQ + 1) and tokens.dtype == np.int32
    assert tokens.ravel().tolist() == want[: tokens.size]  # remainder dropped, as the original
    assert ds.index["stats"]["trailing_tokens_dropped"] == len(want) % (SEQ + 1)
    assert ds.index["stats"]["documents"] == 3 and not ds.has_mask and mask.min() == 1.0
    assert tok.decode(tokens.ravel()).startswith(DOCS[0] + "<|endoftext|>" + DOCS[1])
    shard = np.load(tmp_path / "out" / "ds-00000.tokens.npy")
    assert shard.dtype == np.uint16 and ds.index["dtype"] == "uint16"


def test_every_input_kind_gives_the_same_tokens(tok, tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.txt").write_text(DOCS[0], encoding="utf-8")
    with gzip.open(d / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": DOCS[1], "meta": 1}) + "\n\n")
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        (json.dumps({"text": DOCS[2]}) + "\n").encode()))
    (d / "d.txt.gz").write_bytes(gzip.compress(DOCS[0].encode()))
    (d / "notes.md").write_text("not an input")
    ds = build(d, tmp_path / "out")
    want = stream(tok, DOCS + DOCS[:1])  # sorted file order: a, b, c, d
    assert all_rows(ds)[0].ravel().tolist() == want[: len(want) // (SEQ + 1) * (SEQ + 1)]
    assert ds.index["stats"]["files"] == 4


def test_json_key_and_treat_eot_as_text(tok, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"body": "a<|endoftext|>b " * 8}) + "\n")
    ds = build(tmp_path / "in.jsonl", tmp_path / "out", json_key="body", treat_eot_as_text=True, seq=8)
    literal = tok("a<|endoftext|>b " * 8, split_special_tokens=True)["input_ids"]
    assert EOS not in literal and all_rows(ds)[0].ravel().tolist() == (literal + [EOS])[:ds.n_sequences * 9]


def test_prompt_completion_mask(tok, tmp_path):
    examples = [("Q: 2+2?\nA:", " 4"), ("Q: capital of France?\nA:", " Paris"),
                ("Q: too long " * 20, " x"), ("Q: 3+5?\nA:", " 8")]
    with open(tmp_path / "qa.jsonl", "w") as f:
        for p, c in examples:
            f.write(json.dumps({"in_text": p, "out_text": c}) + "\n")
    ds = build(tmp_path / "qa.jsonl", tmp_path / "out")
    tokens, mask = all_rows(ds)
    assert ds.has_mask and ds.index["stats"]["examples_dropped_too_long"] == 1
    pieces = [(tok.encode(p), tok.encode(c) + [EOS]) for p, c in examples if len(p) < 100]
    # greedy packing, never splitting an example: rows are [ex0 ex1 pad...] [ex2 pad...]
    row, rows = [], []
    for p, c in pieces:
        if len(row) + len(p) + len(c) > SEQ + 1:
            rows.append(row)
            row = []
        row += [(t, 0) for t in p] + [(t, 1) for t in c]
    rows.append(row)
    assert tokens.shape == (len(rows), SEQ + 1)
    for r, expect in enumerate(rows):
        padded = expect + [(EOS, 0)] * (SEQ + 1 - len(expect))
        assert tokens[r].tolist() == [t for t, _ in padded]
        assert mask[r].tolist() == [m for _, m in padded[1:]]  # mask[t] weights predicting token t+1
    trained = tokens[:, 1:][mask == 1]  # the targets the loss sees: completions and their EOS only
    assert tok.decode(trained) == " 4<|endoftext|> Paris<|endoftext|> 8<|endoftext|>"


def test_segments_are_stored_so_a_prompt_holding_eos_stays_one_example(tmp_path):
    """Format v2 stores each token's segment with prompt/completion data: an example whose prompt
    (or completion) contains the EOS id ("w0" here) is one segment, where the EOS rule would cut it.
    Plain text stores none (a document's only EOS is its last token) and reads them by the EOS rule."""
    words = word_tokenizer(tmp_path / "tok")
    examples = [("w5 w0 w6", "w7 w8"), ("w9", "w10 w0 w11"), ("w12 w13 w14 w15 w16", "w17 w18 w19")]
    with open(tmp_path / "qa.jsonl", "w") as f:
        for p, c in examples:
            f.write(json.dumps({"in_text": p, "out_text": c}) + "\n")
    ds = build(tmp_path / "qa.jsonl", tmp_path / "out", tokenizer=words, seq=12)
    assert ds.index["version"] == 2 and ds.index["has_segments"] and ds.has_segments
    assert (tmp_path / "out" / "ds-00000.segments.npy").exists()
    batch = next(iter(Loader(ds, 2, shuffle=False, segments=True, prefetch=1)))
    tokens, segments = batch["tokens"][0], batch["segments"][0]
    # row 0: [w5 w0 w6 w7 w8 EOS][w9 w10 w0 w11 EOS][pad pad]; row 1: [example 2 + EOS][pad x4]
    assert tokens[0].tolist() == [5, 0, 6, 7, 8, 0, 9, 10, 0, 11, 0, 0, 0]
    assert segments[0].tolist() == [0] * 6 + [1] * 5 + [2] * 2
    assert segments[1].tolist() == [0] * 9 + [1] * 4
    assert segment_ids(tokens, 0)[0].tolist() != segments[0].tolist()  # what the EOS rule would say

    (tmp_path / "docs.txt").write_text("w3 w4 w5<|endoftext|>w6 w7 w8 w9 w10 w11", encoding="utf-8")
    text = build(tmp_path / "docs.txt", tmp_path / "out", name="text", tokenizer=words, seq=4)
    assert not text.has_segments and not list((tmp_path / "out").glob("text-*.segments.npy"))
    batch = next(iter(Loader(text, 2, shuffle=False, segments=True, prefetch=1)))
    assert batch["segments"][0].tolist() == [[0, 0, 0, 0, 1], [0, 0, 0, 0, 0]]


def test_shuffle_repack_and_min_unique_are_seeded(tok, tmp_path):
    for i, d in enumerate(DOCS):
        (tmp_path / f"{i}.txt").write_text(d * 4)
    (tmp_path / "9.txt").write_text("na " * 200)  # repetitive: every row has 1-2 unique tokens
    kw = dict(preserve_data_order=False, n_repack_epochs=2, min_unique_tokens=4)
    a = build(tmp_path, tmp_path / "a", **kw)
    b = build(tmp_path, tmp_path / "b", **kw)
    c = build(tmp_path, tmp_path / "c", seed=11, **kw)
    plain = build(tmp_path, tmp_path / "p", n_repack_epochs=1)
    assert a.index["shards"][0]["sha256"] == b.index["shards"][0]["sha256"]
    assert a.index["shards"][0]["sha256"] != c.index["shards"][0]["sha256"]
    one_epoch = plain.index["stats"]["tokens"]
    dropped = a.index["stats"]["sequences_below_min_unique"]
    assert a.index["stats"]["tokens"] == 2 * one_epoch
    assert dropped >= 2 * 9 and len(a) + dropped == 2 * one_epoch // (SEQ + 1)
    assert min(len(set(r)) for r in all_rows(a)[0].tolist()) >= 4
    in_order = build(tmp_path, tmp_path / "o", **dict(kw, preserve_data_order=True))
    assert len(in_order) == len(a) and all_rows(in_order)[0].tolist() != all_rows(a)[0].tolist()


@pytest.mark.parametrize("content, name, message", [
    ("", "empty.txt", "empty.txt: empty input"),
    ('{"text": "ok"}\n{"text": "ok"}\n{"text": broken\n', "bad.jsonl", "bad.jsonl line 3: invalid JSON"),
    ('{"text": "ok"}\n{"body": "no text"}\n', "nokey.jsonl", "nokey.jsonl line 2: no 'text' field"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, content, name, message):
    (tmp_path / name).write_text(content)
    out = tmp_path / "out"
    assert create_finetune_dataset.main([str(tmp_path / name), "ds", "--output-dir", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("flag, value, least", [("--seq", "0", 1), ("--sequences-per-shard", "0", 1),
                                               ("--n-repack-epochs", "-1", 1), ("--min-unique-tokens", "-5", 0)])
def test_a_size_out_of_range_is_one_error_naming_its_flag(tmp_path, capsys, flag, value, least):
    (tmp_path / "in.txt").write_text(DOCS[0])
    argv = [str(tmp_path / "in.txt"), "ds", "--output-dir", str(tmp_path / "out"), flag, value]
    err = refusal(create_finetune_dataset.main, argv, capsys)
    assert f"error: {flag} must be at least {least}; got {value}\n" in err
    assert not (tmp_path / "out").exists()


def test_existing_dataset_is_kept_unless_overwrite(tok, tmp_path):
    (tmp_path / "in.txt").write_text(DOCS[0] * 4)
    first = build(tmp_path / "in.txt", tmp_path / "out", sequences_per_shard=2)
    assert len(first.index["shards"]) > 1
    with pytest.raises(DatasetError, match="already exists"):
        build(tmp_path / "in.txt", tmp_path / "out")
    second = build(tmp_path / "in.txt", tmp_path / "out", overwrite=True)
    assert all_rows(second)[0].tolist() == all_rows(first)[0].tolist()
    assert sorted(os.listdir(tmp_path / "out")) == ["ds-00000.tokens.npy", "ds.index.json"]  # stale shards gone


def test_tampered_shard_fails_verification(tmp_path):
    (tmp_path / "in.txt").write_text(DOCS[0] * 2)
    index = build(tmp_path / "in.txt", tmp_path / "out").path
    shard = tmp_path / "out" / "ds-00000.tokens.npy"
    rows = np.load(shard)
    rows[0, 0] ^= 1
    np.save(shard, rows)
    assert Dataset.open(index).read([0])[0][0, 0] == rows[0, 0]  # shapes still match: opens unverified
    with pytest.raises(DatasetError, match="ds-00000.tokens.npy: sha256 does not match"):
        Dataset.open(index, verify=True)


# ----------------------------------------------------------------------------- loader

def synthetic(n=10, seq=4):
    """Row i is all i's, so a batch's token[..., 0] spells the sequence ids it holds."""
    return Dataset.from_arrays(np.repeat(np.arange(n, dtype=np.uint16)[:, None], seq + 1, axis=1))


def ids(batch):
    return batch["tokens"][..., 0]


def take(loader, k):
    return [next(loader) for _ in range(k)]


def test_loader_shapes_determinism_and_epochs():
    ds = synthetic()
    batches = take(Loader(ds, 2, seed=1, accumulation=2), 5)  # 5 steps x 4 = 2 epochs of 10
    assert batches[0]["tokens"].shape == (2, 2, 5) and batches[0]["tokens"].dtype == np.int32
    assert batches[0]["mask"].shape == (2, 2, 4) and batches[0]["mask"].dtype == np.float32
    stream = np.concatenate([ids(b).ravel() for b in batches])
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10].tolist() != stream[10:].tolist()  # reshuffled every epoch
    again = take(Loader(ds, 2, seed=1, accumulation=2), 5)
    assert all((ids(a) == ids(b)).all() for a, b in zip(batches, again))
    other = take(Loader(ds, 2, seed=2, accumulation=2), 5)
    assert not all((ids(a) == ids(b)).all() for a, b in zip(batches, other))


def test_processes_read_disjoint_slices_of_the_global_batch():
    ds = synthetic(12)
    whole = take(Loader(ds, 4, seed=3, accumulation=2), 3)
    parts = [take(Loader(ds, 4, seed=3, accumulation=2, process_index=p, process_count=2), 3) for p in (0, 1)]
    for step, full in enumerate(whole):
        joined = np.concatenate([parts[0][step]["tokens"], parts[1][step]["tokens"]], axis=1)
        assert parts[0][step]["tokens"].shape == (2, 2, 5) and (joined == full["tokens"]).all()


@pytest.mark.parametrize("stop_after", [1, 3])  # mid-epoch 0; in epoch 1 after crossing the boundary
def test_resume_from_state_is_exact(stop_after):
    ds = synthetic(10)
    uninterrupted = take(Loader(ds, 4, seed=5), 6)
    first = Loader(ds, 4, seed=5)
    take(first, stop_after)
    state = json.loads(json.dumps(first.state()))
    first.close()
    assert state == {"epoch": stop_after * 4 // 10, "position": stop_after * 4 % 10, "seed": 5,
                     "n_sequences": 10, "shuffle": True}
    resumed = take(Loader(ds, 4, seed=5, state=state), 6 - stop_after)
    assert [ids(b).tolist() for b in resumed] == [ids(b).tolist() for b in uninterrupted[stop_after:]]
    halves = [take(Loader(ds, 4, seed=5, state=state, process_index=p, process_count=2), 1)[0] for p in (0, 1)]
    assert np.concatenate([ids(h) for h in halves], 1).tolist() == ids(uninterrupted[stop_after]).tolist()
    with pytest.raises(ValueError, match="seed=5"):
        Loader(ds, 4, seed=6, state=state)


def test_validation_reads_once_in_order_with_padded_last_batch():
    ds = Dataset.from_arrays(synthetic(7).read(np.arange(7))[0], mask=np.ones((7, 4), np.uint8))
    batches = list(Loader(ds, 3, shuffle=False, repeat=False))
    assert [ids(b)[0].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, EOS, EOS]]
    assert batches[-1]["mask"][0].sum(axis=1).tolist() == [4, 0, 0]


def test_gcs_round_trip(tok, tmp_path, gcs_bucket):
    src = f"{gcs_bucket}/raw/corpus.jsonl"
    storage.write_text(src, "".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    out = f"{gcs_bucket}/datasets"
    index = build_dataset(BuildConfig(src, "ds", out, seq=SEQ, preserve_data_order=True, sequences_per_shard=3))
    assert index == f"{out}/ds.index.json"
    remote = Dataset.open(index, cache_dir=str(tmp_path / "cache"))
    assert len(remote.index["shards"]) > 1
    want = stream(tok, DOCS)
    assert all_rows(remote)[0].ravel().tolist() == want[: len(remote) * (SEQ + 1)]
    batch = next(Loader(remote, 2, seed=0))
    assert batch["tokens"].shape == (1, 2, SEQ + 1)
    assert len(os.listdir(tmp_path / "cache")) == len(remote.index["shards"])  # cached, keyed by sha256


# ----------------------------------------------------------------------------- the dataset tool's other options

def original_wikitext_detokenizer(string):
    """The original create_finetune_tfrecords.py's function, transcribed (the oracle)."""
    import re
    string = string.replace("s '", "s'")
    string = re.sub(r"/' [0-9]/", r"/'[0-9]/", string)
    for a, b in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" : ", ": "), (" ; ", "; "), (" . ", ". "),
                 (" ! ", "! "), (" ? ", "? "), (" , ", ", ")):
        string = string.replace(a, b)
    string = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", string)
    string = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", string)
    string = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", string)
    string = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', string)
    string = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", string)
    for a, b in (("= = = =", "===="), ("= = =", "==="), ("= =", "=="), (" " + chr(176) + " ", chr(176)),
                 (" \n", "\n"), ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s")):
        string = string.replace(a, b)
    return string


WIKITEXT = (" = = Valkyria Chronicles III = = \n Senjō no Valkyria 3 : Unrecorded Chronicles ( Japanese : 戦場のヴァルキュリア3 ) , "
            "commonly referred to as Valkyria Chronicles III outside Japan , is a tactical role @-@ playing game . "
            "It sold 1 @,@ 000 copies at 3 @.@ 5 dollars ; the players ' favourite \" war story \" ! "
            "Temperatures near 20 ° C . The team 's N [ note ] { x } ' quoted ' ? \n")
MOJIBAKE = "The cafÃ© served crÃ¨me brÃ»lÃ©e â€” â€œgreatâ€\x9d, said ï¬\x81ve people."


@pytest.mark.parametrize("option, text, normalize", [
    ("normalize_with_wikitext_detokenize", WIKITEXT, original_wikitext_detokenizer),
    ("normalize_with_ftfy", MOJIBAKE, None),
])
def test_normalization_options_change_the_text_as_the_original_did(tok, tmp_path, option, text, normalize):
    import ftfy
    normalize = normalize or (lambda s: ftfy.fix_text(s, normalization="NFKC"))
    (tmp_path / "in.txt").write_text(text * 3, encoding="utf-8")
    plain = build(tmp_path / "in.txt", tmp_path / "plain", seq=8)
    fixed = build(tmp_path / "in.txt", tmp_path / "fixed", seq=8, **{option: True})
    want = stream(tok, [normalize(text * 3)])
    assert all_rows(fixed)[0].ravel().tolist() == want[: len(want) // 9 * 9]
    assert normalize(text) != text and all_rows(plain)[0].ravel().tolist() != all_rows(fixed)[0].ravel().tolist()


def test_create_finetune_dataset_cli_flags_reach_the_build(tok, tmp_path):
    """--normalize-with-ftfy, --normalize-with-wikitext-detokenize and --min-unique-tokens through the CLI."""
    (tmp_path / "in.txt").write_text(WIKITEXT + MOJIBAKE + "<|endoftext|>" + "na " * 60, encoding="utf-8")
    out = tmp_path / "out"
    assert create_finetune_dataset.main([str(tmp_path / "in.txt"), "ds", "--output-dir", str(out), "--seq", "8",
                                         "--normalize-with-ftfy", "--normalize-with-wikitext-detokenize",
                                         "--min-unique-tokens", "3", "--preserve-data-order"]) == 0
    import ftfy
    docs = [original_wikitext_detokenizer(ftfy.fix_text(WIKITEXT + MOJIBAKE, normalization="NFKC")), "na " * 60]
    want = np.array(stream(tok, docs)[: len(stream(tok, docs)) // 9 * 9]).reshape(-1, 9)
    kept = want[[len(set(r)) >= 3 for r in want.tolist()]]
    ds = Dataset.open(str(out / "ds.index.json"))
    assert len(kept) < len(want) and ds.index["stats"]["sequences_below_min_unique"] == len(want) - len(kept)
    np.testing.assert_array_equal(all_rows(ds)[0], kept)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"  # {% generation %}: transformers' own assistant mask
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
          "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4, naïvely."}, {"role": "user", "content": "And 3+5?"},
        {"role": "assistant", "content": "8"}]


def test_a_conversation_trains_on_the_assistant_turns_transformers_marks(tok):
    """Our spans (the template's rendering up to each assistant turn and through it) mark the tokens
    transformers' `return_assistant_tokens_mask` marks from a template's `{% generation %}` blocks."""
    from mesh_transformer.data import conversations
    from mesh_transformer.io.chat_template import ChatTemplate
    ids, mask = conversations.encode(ChatTemplate(tok, CHATML), conversations.read({"messages": CHAT}, "x"))
    hf = tok.apply_chat_template(CHAT, chat_template=CHATML, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    assert ids == hf["input_ids"] and mask.tolist() == hf["assistant_masks"]
    assert tok.decode(np.array(ids)[mask == 1]) == "4, naïvely.<|im_end|>\n8<|im_end|>\n"


def test_a_chat_dataset_is_packed_whole_and_masked_with_the_plain_or_a_given_template(tok, tmp_path):
    with open(tmp_path / "chat.jsonl", "w") as f:
        f.write(json.dumps({"messages": CHAT}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "long " * 140},
                                         {"role": "assistant", "content": "x"}]}) + "\n")
    ds = build(tmp_path / "chat.jsonl", tmp_path / "out", seq=48)
    tokens, mask = all_rows(ds)
    assert ds.has_mask and ds.has_segments and ds.index["stats"]["conversations"] == 3
    assert ds.index["stats"]["conversations_dropped_too_long"] == 1
    trained = tokens[:, 1:][mask == 1]  # the plain template (the gpt2 tokenizer has none), an EOS after each turn
    assert tok.decode(trained) == " 4, naïvely.\n\n<|endoftext|> 8\n\n<|endoftext|> Yo\n\n<|endoftext|>"
    first = (tok.encode("System: Answer briefly.\n\nUser: 2+2?\n\nAssistant:") + tok.encode(" 4, naïvely.\n\n")
             + [EOS] + tok.encode("User: And 3+5?\n\nAssistant:") + tok.encode(" 8\n\n") + [EOS])
    assert tokens[0, :len(first)].tolist() == first  # whole, from the row's start
    (tmp_path / "chatml.jinja").write_text(CHATML)
    out = tmp_path / "out2"
    assert create_finetune_dataset.main([str(tmp_path / "chat.jsonl"), "ds", "--output-dir", str(out), "--seq", "128",
                                         "--chat-template", str(tmp_path / "chatml.jinja"),
                                         "--preserve-data-order"]) == 0
    given = Dataset.open(str(out / "ds.index.json"))
    tokens, mask = all_rows(given)
    assert tok.decode(tokens[:, 1:][mask == 1]) == "4, naïvely.<|im_end|>\n8<|im_end|>\nYo<|im_end|>\n"


def test_a_conversation_is_rendered_as_the_server_renders_a_request(tok):
    """The same message and tool handling as /v1/chat/completions: a call's `arguments` (JSON text)
    reach the template as an object, `developer` is `system`, text parts are joined, tools get their
    object type; `weight: 0` turns are not trained, nor a first message of the assistant's (where it
    starts cannot be told)."""
    from mesh_transformer.data import conversations
    from mesh_transformer.io.chat_template import PLAIN_TEMPLATE, ChatTemplate
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "Snow."},
                {"role": "assistant", "content": "Snow.", "weight": 0}]
    tools = [{"type": "function", "function": {"name": "w", "parameters": {"properties": {"city": {"type": "string"}}}}}]
    conv = conversations.read({"messages": messages, "tools": tools}, "x")
    ids, mask = conversations.encode(ChatTemplate(tok), conv)
    hf_messages = [{"role": "system", "content": "Be brief."}, messages[1],
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"id": "c1", "type": "function", "function": {"name": "w", "arguments": {"city": "Oslo"}}}]},
                   messages[3], {"role": "assistant", "content": "Snow."}]
    hf_tools = [{"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    text = tok.apply_chat_template(hf_messages, tools=hf_tools, chat_template=PLAIN_TEMPLATE, tokenize=False)
    assert tok.decode(ids) == text.replace('</tool_call>\n\n', '</tool_call>\n\n<|endoftext|>', 1)
    assert tok.decode(np.array(ids)[mask == 1]) == ' <tool_call>{"name": "w", "arguments": {"city": "Oslo"}}</tool_call>' \
        "\n\n<|endoftext|>"  # the weight-0 turn is not trained
    lead = conversations.read({"messages": [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Yo"},
                                            {"role": "assistant", "content": "Ok"}]}, "x")
    ids, mask = conversations.encode(ChatTemplate(tok, CHATML), lead)
    assert tok.decode(np.array(ids)[mask == 1]) == "Ok<|im_end|>\n"
    assert tok.decode(ids).startswith("<|im_start|>assistant\nHi!<|im_end|>")  # rendered, not trained


@pytest.mark.parametrize("record, message", [
    ({"messages": []}, "line 1: field 'messages' must be a non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "line 1: messages[0].role: must be one of"),
    ({"messages": [{"role": "user", "content": 5}]}, "line 1: messages[0].content: must be a string, got int"),
    ({"messages": [{"role": "user", "content": "x"}]}, "line 1: no assistant message to train on"),
    ({"messages": CHAT, "tools": "none"}, "line 1: tools: a list of tools"),
    ({"messages": CHAT, "tools": [{"type": "retrieval"}]}, "line 1: tools[0].type: only function tools"),
    ({"messages": [*CHAT[:2], {"role": "assistant", "tool_calls": [{"function": {"name": "w", "arguments": "{oops"}}]}]},
     "line 1: messages[2].tool_calls[0].function.arguments: an object (or its JSON text) is required, got not JSON"),
    ({"messages": [*CHAT[:2], {**CHAT[2], "weight": 0.5}]}, "line 1: messages[2].weight must be 0 or 1"),
    ({"prompt": "q", "completion": [CHAT[2]]}, "line 1: fields 'prompt' and 'completion' must be two strings or two "
                                               "non-empty lists of messages, got str and list"),
    ({"prompt": CHAT[:1], "completion": [CHAT[0]]}, "line 1: field 'completion' has no assistant message"),
])
def test_a_bad_conversation_exits_2_naming_the_line_and_field(tmp_path, capsys, record, message):
    (tmp_path / "chat.jsonl").write_text(json.dumps(record) + "\n")
    out = tmp_path / "out"
    assert create_finetune_dataset.main([str(tmp_path / "chat.jsonl"), "ds", "--output-dir", str(out)]) == 2
    assert f"chat.jsonl {message}" in capsys.readouterr().err and not out.exists()


def test_a_template_that_rewrites_earlier_turns_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    (tmp_path / "last.jinja").write_text("{{ messages[-1]['content'] }}")  # the latest turn only
    out = tmp_path / "out"
    assert create_finetune_dataset.main([str(tmp_path / "chat.jsonl"), "ds", "--output-dir", str(out),
                                         "--chat-template", str(tmp_path / "last.jinja")]) == 2
    err = capsys.readouterr().err
    assert "chat.jsonl line 1: the chat template does not render messages[2]" in err and not out.exists()
    assert create_finetune_dataset.main([str(tmp_path / "chat.jsonl"), "ds", "--output-dir", str(out),
                                         "--chat-template", str(tmp_path / "nowhere.jinja")]) == 2
    assert "--chat-template" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("form", ["text", "conversational"])
def test_prompt_completion_records_are_trls_sft_examples(form, tmp_path):
    """TRL's prompt-completion records (`{"prompt", "completion"}`, text or lists of messages) are
    the tokens and completion mask TRL's SFTTrainer trains on (`completion_only_loss`, its EOS added
    to text); packed whole, as `{"in_text", "out_text"}` examples are."""
    import copy

    import datasets
    import trl
    from helpers import make_hf_model
    tok = copy.deepcopy(load_tokenizer("gpt2"))
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.pad_token = tok.eos_token
    tok.save_pretrained(tmp_path / "tok")
    if form == "text":
        records = [{"prompt": f"Question {i}: 2 + {i} =", "completion": f" {2 + i}, of course."} for i in range(3)]
        records[1]["completion"] += "<|endoftext|>"  # ends with EOS's text: TRL adds no second EOS, nor do we
    else:
        records = [{"prompt": [{"role": "user", "content": f"2 + {i}?"}],
                    "completion": [{"role": "assistant", "content": f"It is {2 + i}."}]} for i in range(3)]
    model = make_hf_model(tmp_path / "model", "gpt2", vocab_size=50257)
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, bf16=False)
    theirs = trl.SFTTrainer(model=model, args=args, processing_class=tok, train_dataset=datasets.Dataset.from_list(records))
    src = tmp_path / "pc.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokens, mask = all_rows(build(src, tmp_path / "out", tokenizer=str(tmp_path / "tok"), seq=63))
    row, at = 0, 0
    for example in theirs.train_dataset:
        ids, trained = example["input_ids"], [label != -100 for label in example["labels"]]  # -100: no loss
        if at + len(ids) > 64:  # it starts the next row
            row, at = row + 1, 0
        assert tokens[row, at: at + len(ids)].tolist() == ids
        assert mask[row, at: at + len(ids) - 1].tolist() == trained[1:]  # ours: whether the next token trains
        assert 0 < sum(trained) < len(ids)
        at += len(ids)
    assert row == len(tokens) - 1 == (0 if form == "text" else 2)  # text: the three share one row


@pytest.mark.parametrize("suffix, compress", [(".xz", "lzma"), (".bz2", "bz2")])
def test_xz_and_bz2_inputs(tok, tmp_path, suffix, compress):
    import importlib
    module = importlib.import_module(compress)
    (tmp_path / f"a.jsonl{suffix}").write_bytes(module.compress(
        "".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode()))
    (tmp_path / f"b.txt{suffix}").write_bytes(module.compress(DOCS[0].encode()))
    ds = build(tmp_path, tmp_path / "out")
    want = stream(tok, DOCS + DOCS[:1])
    assert all_rows(ds)[0].ravel().tolist() == want[: len(want) // (SEQ + 1) * (SEQ + 1)]
    assert ds.index["stats"]["files"] == 2


@pytest.fixture(scope="module")
def big_vocab_tokenizer(tmp_path_factory):
    """A word-level HF tokenizer with 70,000 entries (over uint16's 65,536), saved as a directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, 70_000)}}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("big-vocab")
    PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<|endoftext|>").save_pretrained(path)
    return path


def test_vocabularies_over_65536_are_stored_as_uint32(big_vocab_tokenizer, tmp_path):
    words = [1, 65_535, 65_536, 65_537, 69_999, 12, 70_000 - 2]
    (tmp_path / "in.txt").write_text(" ".join(f"w{i}" for i in words) * 1, encoding="utf-8")
    ds = build(tmp_path / "in.txt", tmp_path / "out", tokenizer=str(big_vocab_tokenizer), seq=3)
    shard = np.load(tmp_path / "out" / "ds-00000.tokens.npy")
    assert ds.index["dtype"] == "uint32" and shard.dtype == np.uint32
    assert all_rows(ds)[0].ravel().tolist() == (words + [0])[:8]  # ids above 65,535 kept exactly, EOS 0


@pytest.mark.parametrize("write, message", [
    (lambda p: p.with_name("bad.txt").write_bytes(b"fine text\n\xff\xfe broken"), "bad.txt: not valid UTF-8"),
    (lambda p: p.with_name("trunc.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 50)[:40]),
     "trunc.jsonl.gz: cannot read"),
    (lambda p: p.with_name("x.jsonl").write_text('{"text": "ok"}\n{"text": 5}\n'), "x.jsonl line 2: field 'text' must be a string"),
    (lambda p: p.with_name("qa.jsonl").write_text('{"in_text": "q"}\n'), "qa.jsonl line 1"),
])
def test_more_bad_inputs_exit_2_and_write_nothing(tmp_path, capsys, write, message):
    write(tmp_path / "placeholder")
    [path] = [p for p in tmp_path.iterdir()]
    out = tmp_path / "out"
    assert create_finetune_dataset.main([str(path), "ds", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("before, after", [(4, 2), (2, 6), (4, 3)])
def test_resume_with_another_batch_size_continues_the_stream(before, after):
    """The README: a resumed run gets exactly the next sequences, also with another batch size."""
    ds = synthetic(10)
    stream_ids = np.concatenate([ids(b).ravel() for b in take(Loader(ds, 1, seed=9), 30)])
    first = Loader(ds, before, seed=9)
    take(first, 2)
    state = first.state()
    first.close()
    resumed = take(Loader(ds, after, seed=9, state=state), 3)
    assert all(ids(b).shape == (1, after) for b in resumed)
    np.testing.assert_array_equal(np.concatenate([ids(b).ravel() for b in resumed]),
                                  stream_ids[2 * before: 2 * before + 3 * after])


# ----------------------------------------------------------------------------- mixtures

def marked_rows(part: int, n: int, seq: int = 4, **kw) -> Dataset:
    """n rows; row i's first token is `part`, its second i: a batch says which part and row it read."""
    tokens = np.zeros((n, seq + 1), np.uint16)
    tokens[:, 0], tokens[:, 1] = part, np.arange(n)
    return Dataset.from_arrays(tokens, eos_id=9999, **kw)


def parts_read(loader, steps):
    """[(part, row)] of the rows `loader` gives in `steps` steps, in order."""
    rows = np.concatenate([b["tokens"][..., :2].reshape(-1, 2) for b in take(loader, steps)])
    return [tuple(r) for r in rows.tolist()]


def test_a_mixture_gives_each_dataset_its_share_of_every_epoch():
    """Weights 3 : 1 over 10 and 30 rows: every epoch of 40 rows holds 30 of the first (each row three
    times) and 10 of the second, whose rows all come once before any comes again; the stream is
    seeded and resumes exactly, on one process or two; a loader position saved with other weights
    is refused."""
    from mesh_transformer.data import Mixture, StreamMismatch
    small, big = marked_rows(1, 10), marked_rows(2, 30)
    mix = Mixture([small, big], [3, 1], ["small", "big"])
    assert len(mix) == 40 and mix.seq == 4
    stream = parts_read(Loader(mix, 8, seed=7), 15)  # 3 epochs
    for epoch in range(3):
        rows = stream[epoch * 40:(epoch + 1) * 40]
        assert sorted(r for p, r in rows if p == 1) == sorted(list(range(10)) * 3)
        assert sum(p == 2 for p, _ in rows) == 10
    assert sorted(r for p, r in stream if p == 2) == list(range(30))  # a pass over the big part in 3 epochs
    assert stream[:40] != stream[40:80]
    assert parts_read(Loader(mix, 8, seed=7), 15) == stream and parts_read(Loader(mix, 8, seed=8), 15) != stream
    first = Loader(mix, 8, seed=7)
    take(first, 6)
    state = json.loads(json.dumps(first.state()))
    first.close()
    assert state["mixture"] == [[10, 30, None], [30, 10, None]]  # rows, rows an epoch, the tokens' digest
    assert parts_read(Loader(mix, 8, seed=7, state=state), 9) == stream[48:]
    same = Mixture([small, big], [0.75, 0.25], ["small", "big"])  # the same shares, however written
    assert parts_read(Loader(same, 8, seed=7, state=state), 9) == stream[48:]
    halves = [parts_read(Loader(mix, 8, seed=7, state=state, process_index=p, process_count=2), 1) for p in (0, 1)]
    assert halves[0] + halves[1] == stream[48:56]
    with pytest.raises(StreamMismatch, match=re.escape("loader state has mixture=[[10, 30, None], [30, 10, None]], "
                                                       "this loader has [[10, 20, None], [30, 20, None]]")):
        Loader(Mixture([small, big], [1, 1], ["small", "big"]), 8, seed=7, state=state)
    with pytest.raises(StreamMismatch, match=re.escape("loader state has mixture=[[10, 30, None], [30, 10, None]], "
                                                       "this loader has None")):
        Loader(Dataset.from_arrays(np.zeros((40, 5), np.uint16)), 8, seed=7, state=state)  # one dataset of as many rows
    with pytest.raises(DatasetError, match=re.escape("rare: its weight 0.001 gives it no row of an epoch of 40 rows")):
        Mixture([small, big], [1, 0.001], ["small", "rare"])
    with pytest.raises(DatasetError, match=re.escape("none: holds no row: a mixture's part gives rows")):
        Mixture([small, Dataset.from_arrays(np.zeros((0, 5), np.uint16), eos_id=9999)], [1, 1], ["small", "none"])
    tiny = Mixture([marked_rows(1, 3), big], [1, 1], ["tiny", "big"])  # 70,000 passes of 3 rows, across blocks of passes
    rows = tiny._part_stream(0, seed=7, shuffle=True, start=65_529, count=3 * 70_000).reshape(-1, 3)
    assert (np.sort(rows, axis=1) == np.arange(3)).all() and len({tuple(r) for r in rows}) == 6  # each a permutation
    assert (tiny._part_stream(0, 7, True, 65_529 + 3 * 5, 3) == rows[5]).all()  # the stream, wherever it is read


def test_a_mixture_keeps_pairs_whole_cuts_rows_to_the_shortest_and_refuses_unlike_data():
    """Preference pairs move as pairs; a part of longer rows is read cut to the shortest part's seq;
    stored segments serve their part's rows, and plain text's are split at each end of text only
    with document masking, as when it trains alone; parts that are not alike
    (pairs and not, another tokenizer's end of text, other classes) are one error naming the part."""
    from mesh_transformer.data import Mixture
    pairs = Mixture([marked_rows(1, 6, pairs=True), marked_rows(2, 8, pairs=True)], [1, 1], ["a", "b"])
    rows = parts_read(Loader(pairs, 4, seed=0), 7)
    for chosen, rejected in zip(rows[::2], rows[1::2]):
        assert chosen[0] == rejected[0] and rejected[1] == chosen[1] + 1 and chosen[1] % 2 == 0
    tokens = np.full((3, 9), 5, np.uint16)
    tokens[:, 3] = 0  # an end of text at 3: two segments by the EOS rule
    long = Dataset.from_arrays(tokens, mask=np.ones((3, 8), np.uint8), eos_id=0,
                               segments=np.repeat(np.arange(9, dtype=np.uint16)[None] // 5, 3, 0))
    short = Dataset.from_arrays(np.where(np.arange(5) == 1, 0, 6)[None].repeat(2, 0).astype(np.uint16), eos_id=0)
    mix = Mixture([long, short], [1, 1], ["long", "short"])
    assert mix.seq == 4 and mix.has_mask
    got, mask = mix.read(np.arange(5))
    assert got.shape == (5, 5) and got[0].tolist() == [5, 5, 5, 0, 5] and mask[3:].tolist() == [[1] * 4] * 2
    assert mix.read_segments(np.arange(5), got).tolist() == [[0, 0, 0, 0, 0]] * 3 + [[0, 0, 1, 1, 1]] * 2
    assert mix.read_segments(np.arange(5), got, documents_apart=False).tolist() == [[0] * 5] * 5  # as plain text
    with pytest.raises(DatasetError, match=re.escape("b: the datasets of a mixture must be alike, but it and a "
                                                     "differ in rows in pairs (preference data) (no and yes)")):
        Mixture([marked_rows(1, 4, pairs=True), marked_rows(2, 4)], [1, 1], ["a", "b"])
    with pytest.raises(DatasetError, match=re.escape("short: the datasets of a mixture must be alike, but it and "
                                                     "long differ in the end-of-text id (9999 and 0)")):
        Mixture([long, marked_rows(2, 4)], [1, 1], ["long", "short"])


def test_a_mixtures_labels_are_its_parts_and_kto_balance_counts_each_parts_share():
    """Labels read through a mixture are each part's own (unpaired examples' with their KL rows,
    multi-label texts' vectors); KTO's balance advice counts the examples an epoch trains on, each
    part by its share. A single dataset's epochs stay the permutations earlier versions drew
    (checkpoints saved by them resume where they were)."""
    from mesh_transformer.data import Mixture
    from mesh_transformer.train.loop import desirable_examples
    good = marked_rows(1, 4, pairs=True, labels=np.array([1, 1, 1, 1], np.uint8))  # 2 examples, both desirable
    bad = marked_rows(2, 12, pairs=True, labels=np.zeros(12, np.uint8))  # 6, none
    assert desirable_examples(bad) == (0, 6)
    mix = Mixture([good, bad], [1, 1], ["good", "bad"])  # an epoch: 4 examples of each
    assert mix.epoch_shares() == [4, 4] and desirable_examples(mix) == (4, 4)
    batch = Loader(mix, 8, seed=1).batch_at(0)
    assert (batch["labels"][0, :, 0] == (batch["tokens"][0, :, 0] == 1)).all()
    hot = np.eye(3, dtype=np.uint8)[[0, 1, 2, 0]]
    tags = Mixture([marked_rows(1, 4, labels=hot, classes=True), marked_rows(2, 4, labels=hot[::-1], classes=True)],
                   [1, 1], ["a", "b"])
    assert tags.read_labels(np.arange(8)).tolist() == np.r_[hot, hot[::-1]].tolist()
    for pairs, n in ((False, 10), (True, 10)):  # what `Loader` drew before mixtures, epoch after epoch
        ds = marked_rows(1, n, pairs=pairs)
        for epoch in range(2):
            rng = np.random.default_rng([3, epoch])
            before = ((2 * rng.permutation(n // 2)[:, None] + np.arange(2)).reshape(-1) if pairs
                      else rng.permutation(n))
            assert ds.epoch_order(epoch, 3, shuffle=True).tolist() == before.tolist()
