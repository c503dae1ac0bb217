"""A sequence classifier fine-tuned on labelled texts (`{"text", "label"}` records, config key
"classify"; train/classify.py): its loss and gradients are transformers' ForSequenceClassification's
with `labels`, its data is what /classify reads, its runs learn, validate and export."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest
import torch

from helpers import hf_classifier, hf_grads_as_params, make_hf_gptj, make_hf_model, mesh
from mesh_transformer import loading, lora
from mesh_transformer.config import Config, ConfigError, TrainConfig, config_from_dict
from mesh_transformer.data import BuildConfig, Dataset, DatasetError, Loader, build_dataset
from mesh_transformer.io import hf
from mesh_transformer.io.checkpoint import CheckpointManager
from mesh_transformer.io.tokenizer import load_tokenizer
from mesh_transformer.train.step import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def build(src, out, name="texts", seq=16, label_key="label", **kw):
    return Dataset.open(build_dataset(BuildConfig(input_path=str(src), name=name, output_dir=str(out), seq=seq,
                                                  preserve_data_order=True, label_key=label_key, **kw)))


def bos_eos_tokenizer(path):
    """A word-level tokenizer ("w0" ... "w99") that puts BOS before a text and EOS after it, as
    BERT-like and some decoder tokenizers do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    words = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(100)}}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return str(path)


# (family case, labels, how): three classes, a regression, two classes (GPT-2: learned positions, Conv1D
# weights), LoRA adapters with the score head trained whole beside them, and four classes a text
# may have any of (multi-label)
@pytest.mark.parametrize("case, labels, how", [("gptj", 3, "full"), ("llama_gqa2_llama3_rope", 1, "full"),
                                               ("gpt2", 2, "full"), ("llama_gqa2_llama3_rope", 3, "lora"),
                                               ("gptj", 4, "multi")])
def test_loss_accuracy_and_gradients_equal_transformers(case, labels, how, tmp_path):
    """On dp 2 x mp 2, a batch of texts of 1 to 30 tokens (and four padding rows, which count for
    nothing, whatever their label; in two microbatches of 1 and 3 texts, the same step): the loss
    (cross-entropy over the classes; a regression's squared error), the accuracy and every
    gradient equal transformers' ForSequenceClassification given `labels` (its own
    problem type: regression for one label, else single-label; multi-label: the mean binary
    cross-entropy of every class of every text, with the accuracy of those yes/no decisions and the
    share of texts with all right), read at each text's last token.
    With LoRA, PEFT's SEQ_CLS adapter (its B drawn; the score head in `modules_to_save`) on that
    classifier: the adapters' and the head's gradients are PEFT's."""
    import peft
    theirs = hf_classifier(make_hf_model(tmp_path / "lm", case), labels, tmp_path / "clf")
    config, params = hf.load_hf(str(tmp_path / "clf"), mp=2)
    multi = how == "multi"
    if multi:
        theirs.config.problem_type = "multi_label_classification"
    config = dataclasses.replace(config, compute_dtype="float32", remat="none",
                                 problem_type="multi_label_classification" if multi else None)
    train = TrainConfig(per_replica_batch=4, cores_per_replica=2, classify={})
    if how == "lora":
        theirs = peft.get_peft_model(theirs, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8,
                                                             target_modules=["q_proj", "v_proj", "down_proj"]))
        torch.manual_seed(2)
        with torch.no_grad():  # PEFT's B starts at zero, where the adapters change nothing
            for name, p in theirs.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.5)
        theirs.save_pretrained(tmp_path / "adapter")
        spec, params = lora.load_peft(str(tmp_path / "adapter"), config)
        assert "score" in params["llama/score"]  # PEFT's modules_to_save, read with the adapter
        train = dataclasses.replace(train, lora=spec.to_dict())
    seq, lengths = config.seq, [5, 17, 1, 30]
    rng = np.random.default_rng(0)
    tokens = np.zeros((8, seq + 1), np.int32)  # rows 4 to 7: padding
    mask = np.zeros((8, seq), np.float32)
    for i, n in enumerate(lengths):  # ids from 1: transformers pools at the last token that is not its pad (0)
        tokens[i, :n] = rng.integers(1, theirs.config.vocab_size, n)
        mask[i, :n] = 1
    targets = (rng.integers(0, 2, (4, labels)) if multi else rng.permutation(np.arange(4) % labels) if labels > 1
               else rng.normal(size=4)).astype(np.float32)

    ids, attention = torch.tensor(tokens[:4, :seq], dtype=torch.long), torch.tensor(mask[:4])
    out = theirs(input_ids=ids, attention_mask=attention,
                 labels=torch.tensor(targets, dtype=torch.long if labels > 1 and not multi else torch.float32))
    out.loss.backward()
    loss = out.loss.item()
    expected = hf_grads_as_params(theirs, tmp_path / "grads", peft_model=how == "lora", config=config)

    assert config.num_labels == labels
    tr = Trainer(Config(config, train), mesh(2, 2))
    if how == "lora":
        tr.set_base(hf.load_hf(str(tmp_path / "clf"), mp=2)[1])
        assert "llama/score" not in tr.base and "score" in tr.param_specs["llama/score"]
    assert tr.metric_names == (("loss", "accuracy", "exact_match") if multi else ("loss", "accuracy") if labels > 1
                               else ("loss",))
    params = jax.device_put(params, tr.state_shardings.params)
    def batch_of(padding_label, rows=np.arange(8)[None]):  # rows [A, B]: the microbatches
        labels = np.concatenate([targets, np.full((4, *targets.shape[1:]), padding_label)]).astype(np.float32)
        labels = labels[rows] if multi else labels[rows][..., None]
        return tr.shard_batch({"tokens": tokens[rows], "mask": mask[rows], "labels": labels})
    batch = batch_of(0)
    sums, count = tr.eval_values(params, batch)
    ours = {k: float(v) for k, v in tr.means(sums, count).items()}
    assert float(count) == 4
    for padding_label in range(1, max(labels, 2)):  # whatever a padding row's label, it counts for nothing
        again = tr.means(*tr.eval_values(params, batch_of(padding_label)))
        assert {k: float(v) for k, v in again.items()} == ours
    assert ours["loss"] == pytest.approx(loss, rel=2e-5, abs=2e-6)
    if multi:
        right = (out.logits.detach().numpy() > 0) == (targets > 0.5)
        assert 0 < right.mean() < 1 and ours["accuracy"] == pytest.approx(right.mean())
        assert ours["exact_match"] == pytest.approx(right.all(-1).mean())
    elif labels > 1:
        right = (out.logits.argmax(-1).numpy() == targets).mean()
        assert 0 < right < 1 and ours["accuracy"] == pytest.approx(right)

    ours_loss, grads = tr.loss_and_grads(params, batch)
    assert float(ours_loss) == pytest.approx(loss, rel=2e-5, abs=2e-6)
    grads = jax.device_get(grads)
    scale = max(float(np.abs(g).max()) for leaves in expected.values() for g in leaves.values())
    assert scale > 1e-3
    accumulated = tr.loss_and_grads(params, batch_of(0, np.array([[0, 4, 5, 6], [1, 2, 3, 7]])))  # 2 microbatches, 1 and 3 texts
    assert float(accumulated[0]) == pytest.approx(float(ours_loss), rel=1e-6)
    for a, b in zip(jax.tree.leaves(jax.device_get(accumulated[1])), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, atol=1e-5 * scale)
    errors = {(m, n): float(np.abs(np.asarray(g)[tuple(slice(0, s) for s in expected[m][n].shape)]
                                   - expected[m][n]).max()) for m, leaves in grads.items() for n, g in leaves.items()}
    assert max(errors.values()) < 1e-4 * scale, max(errors.items(), key=lambda kv: kv[1])


def test_multi_label_sums_count_each_decision_and_whole_texts():
    """A multi-label batch's sums: the loss, transformers' BCEWithLogitsLoss of each class of each
    text (the mean over classes, summed over texts); accuracy, the share of each text's yes/no
    decisions right; exact_match, 1 for a text with all right; a padding row (not counted) adds nothing."""
    from mesh_transformer.train.classify import MULTI_LABEL, ClassifyConfig
    scores = np.array([[2.0, -1.0], [1.0, 1.0], [-1.0, -1.0]], np.float32)
    labels = np.array([[1, 0], [1, 0], [1, 1]], np.float32)  # the third row: padding, whatever it says
    total, sums, count = ClassifyConfig(MULTI_LABEL, 2).text_sums(scores, labels, np.array([1, 1, 0], np.float32))
    bce = torch.nn.functional.binary_cross_entropy_with_logits(torch.tensor(scores[:2]), torch.tensor(labels[:2]))
    assert float(count) == 2 and float(total) == pytest.approx(2 * bce.item(), rel=1e-6)
    assert float(sums["accuracy"]) == 1.5 and float(sums["exact_match"]) == 1.0


def test_labelled_texts_are_rows_as_classify_reads_them(tmp_path):
    """With --label-key, each `{"text", "label"}` record is one row: the text's tokens as /classify
    encodes it (the tokenizer's special tokens; "<|endoftext|>" in the text is the special token),
    cut to `seq` as transformers' truncation cuts it (the special tokens kept), masked on its
    tokens, its label beside it; a text of no tokens is dropped; the index says version 5, the
    labels' range and that they are class numbers; the loader gives labels [A, B, 1]. Without
    --label-key the same records are documents, as before labelled texts existed."""
    texts = ["The film was great.", "Awful.", " ".join(["word"] * 40), "", "x<|endoftext|>y"]
    labels = [1, 0, 2, 0, 1.0]
    ds = build(write_jsonl(tmp_path / "t.jsonl", [{"text": t, "label": y} for t, y in zip(texts, labels)]),
               tmp_path / "data")
    tok = load_tokenizer("gpt2")
    want = [tok(t)["input_ids"][:16] for t in texts if t]
    assert [len(w) for w in want] == [5, 3, 16, 3] and want[3][1] == tok.eos_token_id
    tokens, mask = ds.read(np.arange(len(ds)))
    for row, ids in enumerate(want):
        assert tokens[row, :len(ids)].tolist() == ids and (tokens[row, len(ids):] == tok.eos_token_id).all()
        assert mask[row].tolist() == [1.0] * len(ids) + [0.0] * (16 - len(ids))
    assert ds.read_labels(np.arange(4)).tolist() == [1, 0, 2, 1]
    assert ds.classes and ds.labels and not ds.pairs and not ds.has_segments
    index = ds.index
    assert index["version"] == 5 and index["label_range"] == [0, 2] and index["whole_labels"]
    assert index["stats"]["labelled_texts"] == 5 and index["stats"]["labelled_texts_dropped_empty"] == 1
    assert index["stats"]["labelled_texts_cut"] == 1
    batch = Loader(ds, 2, accumulation=2, shuffle=False).batch_at(0)
    assert batch["labels"].shape == (2, 2, 1) and batch["labels"][:, :, 0].tolist() == [[1, 0], [2, 1]]

    scores = build(write_jsonl(tmp_path / "r.jsonl", [{"text": "a", "label": 0.25}, {"text": "b", "label": -3}]),
                   tmp_path / "data", name="scores")
    assert scores.index["label_range"] == [-3, 0.25] and not scores.index["whole_labels"]
    docs = build(tmp_path / "t.jsonl", tmp_path / "data", name="docs", label_key=None)
    assert not docs.classes and not docs.labels and docs.index["stats"]["documents"] == 5  # (EOT splits one)

    from mesh_transformer.serve import openai
    tok_dir = bos_eos_tokenizer(tmp_path / "tok")
    bos_eos = load_tokenizer(tok_dir)
    words = ["w3 w4 w5", " ".join(f"w{i}" for i in range(30)), ""]
    ds = build(write_jsonl(tmp_path / "w.jsonl", [{"text": t, "label": 1} for t in words]), tmp_path / "data",
               name="words", tokenizer=tok_dir)
    engine = type("Engine", (), {"tokenizer": bos_eos})()  # what /classify's encoding reads of its engine
    want = [openai.encode(engine, t, "input", add_special_tokens=True) for t in words]
    assert want[0] == [0, 5, 6, 7, 1] and len(want[1]) == 32 and want[2] == [0, 1]
    cut = bos_eos(words[1], truncation=True, max_length=16)["input_ids"]
    assert cut[0] == 0 and cut[-1] == 1 and cut[1:-1] == want[1][1:15]
    tokens, mask = ds.read(np.arange(len(ds)))
    for row, ids in enumerate([want[0], cut, want[2]]):
        assert tokens[row, :len(ids)].tolist() == ids and mask[row].sum() == len(ids)


@pytest.mark.parametrize("records, message", [
    ([{"text": "a", "label": True}], "line 1: field 'label' must be a class number (0, 1, ...), a class name or, "
                                     "for a regression, a number (a float32); got true"),
    ([{"text": "a", "label": ""}], 'a class name or, for a regression, a number (a float32); got ""'),
    ([{"text": "a", "label": 1e39}], "a number (a float32); got 1e+39"),
    ([{"text": "a", "label": 10 ** 400}], f"a number (a float32); got {10 ** 400}"),
    ([{"text": "a", "label": 0}, {"text": "b"}], "line 2: no field 'label' (--label-key) beside 'text'"),
    ([{"text": "a", "label": 1}, {"text": "b", "label": "red"}], "line 2: its label is a class name where the "
                                                                "labels before it are class numbers"),
    ([{"text": "a", "label": 1}, {"prompt": "b", "completion": "c"}],
     "labelled texts ({text, label} records) mixed with examples; a classifier trains on a dataset of labelled "
     "texts only"),
    ([{"text": "", "label": 1}], "every labelled text is empty (no tokens)"),
    ([{"text": "a", "label": [0, "red"]}], "line 1: field 'label': a multi-label text's classes are a list of "
                                           'different class numbers (0 to 65,535) or of different class names; got [0, "red"]'),
    ([{"text": "a", "label": [70000]}], "different class names; got [70000]"),
    ([{"text": "a", "label": [1, 1]}], "different class names; got [1, 1]"),
    ([{"text": "a", "label": [0.5]}], "different class names; got [0.5]"),
    ([{"text": "a", "label": [1]}, {"text": "b", "label": 0}], "line 2: its label is one label where the labels "
                                                               "before it are lists of classes"),
    ([{"text": "a", "label": 0}, {"text": "b", "label": [1]}], "line 2: its label is a list of classes where the "
                                                               "labels before it are one label each"),
    ([{"text": "a", "label": []}, {"text": "b", "label": []}], "no multi-label text has a class (every list is empty)"),
])
def test_bad_labelled_texts_are_one_clear_error(records, message, tmp_path):
    with pytest.raises(DatasetError, match=re.escape(message)):
        build(write_jsonl(tmp_path / "t.jsonl", records), tmp_path / "data")
    assert not (tmp_path / "data").exists()  # nothing written


def test_multi_label_texts_are_0_1_vectors_of_their_classes(tmp_path):
    """A label that is a list (of class names or numbers; empty: no class) makes a multi-label
    dataset (version 6): a 0/1 vector a row, one per class: the names sorted, --label-names' order
    (which may name classes no text has), or the numbers up to the highest. Version-5 readers
    cannot mistake it for one label a row."""
    records = [{"text": f"Item {i}", "tags": tags} for i, tags in
               enumerate([["red", "blue"], [], ["green"], ["blue", "green", "red"]])]
    src = write_jsonl(tmp_path / "t.jsonl", records)
    ds = build(src, tmp_path / "data", label_key="tags")
    assert ds.index["version"] == 6 and ds.multi_label and ds.label_width == 3
    assert np.load(tmp_path / "data" / "texts-00000.labels.npy").dtype == np.uint8  # a byte a class
    assert ds.index["label_names"] == ["blue", "green", "red"] and ds.index["label_range"] == [0, 2]
    assert ds.read_labels(np.array([0, 1, 2, 3, -1])).tolist() == [[1, 0, 1], [0, 0, 0], [0, 1, 0], [1, 1, 1],
                                                                    [0, 0, 0]]
    ds = build(src, tmp_path / "given", label_key="tags", label_names=["red", "green", "blue", "white"])
    assert ds.label_width == 4 and ds.read_labels(np.arange(2)).tolist() == [[1, 0, 1, 0], [0, 0, 0, 0]]
    numbered = [{"text": "a", "tags": [3.0]}, {"text": "b", "tags": [0, 1]}]  # (3.0: class 3, as pandas writes it)
    ds = build(write_jsonl(tmp_path / "n.jsonl", numbered), tmp_path / "numbers", label_key="tags")
    assert ds.label_width == 4 and ds.read_labels(np.arange(2)).tolist() == [[0, 0, 0, 1], [1, 1, 0, 0]]
    loader = Loader(ds, global_batch=2, seed=0, shuffle=False)
    assert loader.batch_at(0)["labels"].shape == (1, 2, 4)
    with pytest.raises(DatasetError, match=re.escape("classes up to 3, but --label-names names classes 0 to 1")):
        build(write_jsonl(tmp_path / "n.jsonl", numbered), tmp_path / "bad", label_key="tags", label_names=["a", "b"])


def test_class_names_are_numbered_sorted_or_as_label_names_says(tmp_path):
    """Labels that are class names become class numbers: the names sorted (as transformers'
    run_classification.py numbers them), or in `--label-names`' order, which names a class the data
    may lack; the index keeps the names. A name not among --label-names, a number past them, and
    --label-names naming a class twice are one error each."""
    records = [{"text": f"Item {i}", "label": name} for i, name in enumerate(["red", "green", "red", "blue"])]
    src = write_jsonl(tmp_path / "t.jsonl", records)
    ds = build(src, tmp_path / "data")
    assert ds.index["label_names"] == ["blue", "green", "red"] and ds.read_labels(np.arange(4)).tolist() == [2, 1, 2, 0]
    assert ds.index["label_range"] == [0, 2] and ds.index["whole_labels"]
    import create_finetune_dataset  # the flags, as a user gives them
    assert create_finetune_dataset.main([str(src), "given", "--output-dir", str(tmp_path / "data"), "--seq", "16",
                                         "--preserve-data-order", "--label-key", "label",
                                         "--label-names", "red", "green", "blue", "white"]) == 0
    ds = Dataset.open(str(tmp_path / "data" / "given.index.json"))
    assert ds.index["label_names"] == ["red", "green", "blue", "white"]
    assert ds.read_labels(np.arange(4)).tolist() == [0, 1, 0, 2]
    for names, records, message in [
            (["red", "green"], records, 'line 4: label "blue" is not among --label-names (red, green)'),
            (["a", "b"], [{"text": "x", "label": 2}], "labels from 2 to 2, but --label-names names classes 0 to 1"),
            (["a", "a"], [{"text": "x", "label": 0}], '--label-names: the classes\' names, each once, in class-number '
                                                     'order; got ["a", "a"]')]:
        with pytest.raises(DatasetError, match=re.escape(message)):
            build(write_jsonl(tmp_path / "bad.jsonl", records), tmp_path / "bad", label_names=names)
    with pytest.raises(DatasetError, match=re.escape("--label-names names labelled texts' classes: give --label-key")):
        build(src, tmp_path / "bad", label_names=["red"], label_key=None)
    with pytest.raises(DatasetError, match=re.escape("--label-key text: the label's field, not the text's")):
        build(src, tmp_path / "bad", label_key="text")
    with pytest.raises(DatasetError, match=re.escape("--label-key label, but no record has a text field ('text', "
                                                     "--json-key) to label")):
        build(write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "a", "completion": "b", "label": True},
                                                   {"prompt": "c", "completion": "d", "label": False}]), tmp_path / "bad")
    with pytest.raises(DatasetError, match=re.escape("line 1: --seq 1 holds no text beside the tokenizer's 2 special "
                                                     "tokens")):
        build(write_jsonl(tmp_path / "w.jsonl", [{"text": "w1 w2", "label": 0}]), tmp_path / "bad",
              tokenizer=bos_eos_tokenizer(tmp_path / "tok"), seq=1)


TINY = {"layers": 1, "d_model": 8, "n_heads": 1, "n_vocab": 16, "seq": 8}


@pytest.mark.parametrize("overrides, message", [
    (dict(classify={}), "config key 'num_labels': 'classify' trains a classifier: set num_labels to the number of "
                        "classes (1 for a regression), got 0"),
    (dict(num_labels=3, problem_type="single_label_classification",
          classify={"problem_type": "multi_label_classification"}),
     "config key 'classify.problem_type': \"multi_label_classification\", but the model's problem_type is "
     "\"single_label_classification\"; set one, or both alike"),
    (dict(problem_type="regression"), "config key 'problem_type': says what a classifier's outputs mean: "
                                      "set num_labels too"),
    (dict(num_labels=2, problem_type="multi", classify={}), "config key 'problem_type' must be one of "
                                                            "single_label_classification, multi_label_classification"),
    (dict(num_labels=3, classify={"problem_type": "regression"}), "a regression trains one output here, got 3"),
    (dict(num_labels=1, classify={"problem_type": "single_label_classification"}),
     "a single-label classification needs 2 classes at least, got 1"),
    (dict(num_labels=2, classify={"problem_type": "softmax"}), "config key 'classify.problem_type' must be one of "
                                                               "single_label_classification, multi_label_classification, "
                                                               "regression"),
    (dict(num_labels=2, classify={"labels": 2}), "config key 'classify.labels' is unknown"),
    (dict(num_labels=1, classify={}, reward={}), "config key 'classify': trains a classifier on labelled texts: "
                                                 "not with 'reward'"),
    (dict(num_labels=2, classify={}, z_loss=1e-4), "config key 'z_loss': applies to the language-model loss only; "
                                                   "with 'classify' set it to 0"),
    (dict(num_labels=2, classify={}, dpo={}), "config key 'classify': trains a classifier on labelled texts: "
                                              "not with 'dpo'"),
    (dict(num_labels=2), "num_labels 2: a classifier trains on preference pairs as a reward model"),
    (dict(label_names=["a", "b"]), "config key 'label_names': names a classifier's classes: set num_labels too"),
    (dict(num_labels=3, classify={}, label_names=["a", "b"]), "config key 'label_names': must be a list of 3 "
                                                               'different names, one per class (num_labels), got ["a", "b"]'),
    (dict(num_labels=2, classify={}, label_names=["a", "a"]), 'got ["a", "a"]'),
])
def test_bad_classifier_config_is_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Trainer(config_from_dict({**TINY, **overrides}), mesh(1, 1))


def test_a_classify_run_records_what_its_outputs_mean():
    """The model config's problem_type is the classify run's, however given (as transformers' loss
    records it on the model's config): what its export says and /classify serves. A reward model
    (no classify) records none, and serves the sigmoid of its reward."""
    for keys, want in [(dict(num_labels=1, classify={}), "regression"),
                       (dict(num_labels=1, classify={"problem_type": "regression"}), "regression"),
                       (dict(num_labels=3, classify={}), "single_label_classification"),
                       (dict(num_labels=3, problem_type="multi_label_classification", classify={}),
                        "multi_label_classification"),
                       (dict(num_labels=1, reward={}), None)]:
        config = config_from_dict({**TINY, **keys})
        assert config.model.problem_type == want and config_from_dict(config.to_json_dict()) == config


def test_class_names_travel_from_and_to_transformers_id2label(tmp_path):
    """A HF classifier's id2label is its config's label_names (none where they are transformers'
    LABEL_i, or name two classes alike) and is what an export writes, as its problem_type is the
    config's (where its label count allows it); a batch's labels cross to the hosts of a cluster as
    bytes where they are class numbers (or multi-label 0/1 vectors), as float32 where they are a
    regression's targets."""
    from mesh_transformer.train.cluster import pack_batch, unpack_batch
    lm = make_hf_model(tmp_path / "lm", "gpt2")
    hf_classifier(lm, 3, tmp_path / "named", names=["no", "maybe", "yes"])
    hf_classifier(lm, 2, tmp_path / "plain")
    hf_classifier(lm, 2, tmp_path / "same", names=["x", "x"])  # names that do not tell the classes apart
    named = hf.load_hf(str(tmp_path / "named"))[0]
    assert named.label_names == ["no", "maybe", "yes"] and hf.load_hf(str(tmp_path / "plain"))[0].label_names is None
    assert hf.load_hf(str(tmp_path / "same"))[0].label_names is None
    assert hf.config_to_hf(named)["id2label"] == {0: "no", 1: "maybe", 2: "yes"}
    assert "label_names" not in named.architecture()  # names, not weights (`loop._check_same_classes` holds them)
    assert named.problem_type is None and "problem_type" not in hf.config_to_hf(named)
    for problem, ours in [("multi_label_classification", "multi_label_classification"), ("regression", "regression"),
                          ("single_label", None)]:
        raw = json.loads((tmp_path / "named" / "config.json").read_text())
        (tmp_path / "named" / "config.json").write_text(json.dumps({**raw, "problem_type": problem}))
        config = hf.load_hf(str(tmp_path / "named"))[0]  # (a regression of 3 outputs: transformers' MSE of each)
        assert config.problem_type == ours and "problem_type" not in config.architecture()
        assert hf.config_to_hf(config).get("problem_type") == ours
    batch = {"tokens": np.zeros((1, 2, 5), np.int64), "mask": np.ones((1, 2, 4), np.float32)}
    for labels, dtype in [(np.array([[[2.0], [0.0]]], np.float32), np.uint8),
                          (np.array([[[0.25], [-3.0]]], np.float32), np.float32),
                          (np.array([[[1, 0, 1], [0, 0, 0]]], np.float32), np.uint8)]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no cast of a negative number to a byte)
            packed = pack_batch({**batch, "labels": labels}, 4)
        assert packed["labels"].dtype == dtype and np.array_equal(unpack_batch(packed)["labels"], labels)


COLOURS = ("red", "green", "blue")
NAMES = sorted(COLOURS)  # the classes' numbers: the names sorted
ITEMS = [{"text": f"Item {i} is {COLOURS[i % 3]}.", "label": COLOURS[i % 3]} for i in range(33)]
RUN = dict(layers=2, d_model=32, n_heads=4, n_vocab=50257, seq=16, pe_rotary_dims=4, compute_dtype="float32",
           remat="none", cores_per_replica=2, tpu_size=8, per_replica_batch=2, warmup_steps=0, anneal_steps=8,
           lr=1e-2, end_lr=1e-3, total_steps=8, ckpt_every=8, val_every=8, name="classify", num_labels=3,
           classify={}, label_names=NAMES)


def test_a_classifier_run_learns_validates_and_exports_to_transformers(tmp_path):
    """device_train.py fine-tunes a classifier of 3 named classes from a causal LM's HF checkpoint
    (`--hf`: the head dropped, a score head drawn): its loss falls and it classifies every training
    and held-out text right; to_hf_weights.py writes a GPTJForSequenceClassification, its id2label the
    classes' names, that transformers loads and that gives the held-out texts the run's validation
    loss and accuracy; the checkpoint loads (to serve) with the names. A dataset of labelled texts
    without 'classify', 'classify' without one, data or weights (a resume, an HF classifier) that
    name the classes otherwise than the config, labels past num_labels and a regression's targets
    for classes are one clear line each."""
    import transformers
    from mesh_transformer.train.loop import open_datasets
    hf_dir = tmp_path / "hf"
    make_hf_gptj(hf_dir, vocab_size=50257, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64,
                 initializer_range=0.2)
    data = tmp_path / "data"
    build(write_jsonl(tmp_path / "train.jsonl", ITEMS[:24]), data, name="train")
    build(write_jsonl(tmp_path / "val.jsonl", ITEMS[24:]), data, name="val")
    (tmp_path / "run").mkdir()
    config = {**RUN, "train_set": str(data / "train.index.json"), "val_set": {"held": str(data / "val.index.json")},
              "model_dir": str(tmp_path / "run" / "ckpt")}
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    run = subprocess.run([sys.executable, "device_train.py", "--config", str(tmp_path / "run" / "config.json"),
                          "--cpu-devices", "8", "--no-tensorboard", "--log-dir", str(tmp_path / "run" / "logs"),
                          "--hf", str(hf_dir)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "a language model's checkpoint read as a classifier of 3 label(s)" in run.stdout + run.stderr
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines())}
    assert rows[8]["train/loss"] < rows[1]["train/loss"] and rows[8]["train/accuracy"] == 1.0
    assert rows[8]["val/accuracy_held"] == 1.0 and rows[8]["val/loss_held"] < 0.5
    assert CheckpointManager(str(tmp_path / "run" / "ckpt"), read_only=True).extras(8)["objective"] == "classify"
    assert loading.load(ckpt=str(tmp_path / "run" / "ckpt"), mp=2, dp=1).config.label_names == NAMES  # /classify's

    export = subprocess.run([sys.executable, "to_hf_weights.py", "--input-ckpt", str(tmp_path / "run" / "ckpt"),
                             "--output-path", str(tmp_path / "export"), "--dtype", "fp32", "--cpu"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stdout[-2000:] + export.stderr[-2000:]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    assert type(model).__name__ == "GPTJForSequenceClassification" and model.config.num_labels == 3
    assert model.config.id2label == dict(enumerate(NAMES))
    tokenizer = load_tokenizer("gpt2")
    with torch.no_grad():  # a text at a time: its last token is the one read
        logits = torch.cat([model(torch.tensor([tokenizer.encode(r["text"])])).logits for r in ITEMS[24:]])
    labels = torch.tensor([NAMES.index(r["label"]) for r in ITEMS[24:]])
    assert (logits.argmax(-1) == labels).all()
    assert torch.nn.functional.cross_entropy(logits, labels).item() == pytest.approx(rows[8]["val/loss_held"], rel=1e-3)

    def refusal(**overrides):
        with pytest.raises(ConfigError) as e:
            open_datasets(config_from_dict({**config, **overrides}))
        return str(e.value)
    build(write_jsonl(tmp_path / "docs.jsonl", [{"text": "Plain text. " * 10}]), data, name="docs", label_key=None)
    assert refusal(train_set=str(data / "docs.index.json")) == (
        f"config key 'classify': {data / 'docs.index.json'} holds no labelled texts (create_finetune_dataset.py "
        "--label-key label makes them from {text, label} records)")
    train_set = data / "train.index.json"
    assert refusal(classify=None, num_labels=0, label_names=None) == (
        f"{train_set} holds labelled texts ({{text, label}} records): set num_labels and the config key 'classify' "
        "(e.g. {}) to train a classifier on them")
    assert refusal(label_names=None) == (f"config key 'label_names': {train_set} numbers its classes "
                                         f'["blue", "green", "red"]: set label_names ["blue", "green", "red"] '
                                         f"(and num_labels 3)")
    assert refusal(label_names=list(COLOURS)) == (f"config key 'label_names': {train_set} numbers its classes "
                                            f'["blue", "green", "red"], this config ["red", "green", "blue"]: '
                                            f"build it with --label-names red green blue")
    build(write_jsonl(tmp_path / "numbers.jsonl", [{"text": "a", "label": 2}, {"text": "b", "label": 0.5}]), data,
          name="numbers")
    build(write_jsonl(tmp_path / "top.jsonl", [{"text": "a", "label": 2}]), data, name="top")
    assert refusal(train_set=str(data / "top.index.json"), num_labels=2, label_names=None) == (
        f"config key 'num_labels': 2 classes, but {data / 'top.index.json'} has labels up to 2 (set num_labels 3)")
    from mesh_transformer.train.loop import RunOptions, TrainHost  # weights whose classes have other names
    with pytest.raises(ConfigError) as e:  # a resume with the names reordered (data rebuilt to match)
        TrainHost(config_from_dict({**config, "label_names": list(COLOURS)})).start_state()
    assert str(e.value) == (f"config key 'label_names': {tmp_path / 'run' / 'ckpt'} (step 8) names its classes "
                            f'["blue", "green", "red"], this config ["red", "green", "blue"]: its score head would '
                            f"train under other class numbers")
    with pytest.raises(ConfigError) as e:  # --tune-model-path of it, the same
        TrainHost(config_from_dict({**config, "label_names": list(COLOURS), "model_dir": str(tmp_path / "again")}),
                  RunOptions(tune_model_path=str(tmp_path / "run" / "ckpt"))).start_state()
    assert str(e.value).startswith(f"config key 'label_names': {tmp_path / 'run' / 'ckpt'} names its classes")
    with pytest.raises(ConfigError) as e:  # a named HF classifier, the config naming none
        TrainHost(config_from_dict({**config, "label_names": None, "model_dir": str(tmp_path / "again")}),
                  RunOptions(hf=str(tmp_path / "export"))).start_state()
    assert str(e.value) == (f"config key 'label_names': {tmp_path / 'export'} names its classes "
                            f'["blue", "green", "red"]: set label_names ["blue", "green", "red"]')
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'nowhere'}: no config.json (is this a HF model")):
        TrainHost(config_from_dict({**config, "model_dir": str(tmp_path / "again")}),
                  RunOptions(hf=str(tmp_path / "nowhere"))).start_state()
    assert refusal(train_set=str(data / "numbers.index.json")) == (
        f"{data / 'numbers.index.json'}: labels from 0.5 to 2, not all class numbers (0, 1, ...): a regression's "
        "targets? (num_labels 1 trains one)")


TAGS = ["big", "blue", "green", "red"]  # the classes' numbers: the names sorted
TAGGED = [{"text": f"Item {i} is {COLOURS[i % 3]}{' and big' if i % 4 < 2 else ''}.",
           "tags": [COLOURS[i % 3]] + (["big"] if i % 4 < 2 else [])} for i in range(40)]


def test_a_multi_label_run_learns_validates_and_exports_to_transformers(tmp_path):
    """device_train.py fine-tunes a multi-label classifier (texts tagged with a colour and maybe
    "big": 4 classes, any of them a text) from a causal LM: its loss falls and every yes/no decision
    on the held-out texts is right; the export is a transformers classifier whose problem_type
    is multi_label_classification, which gives the held-out texts the run's validation loss (its
    BCEWithLogitsLoss) and whose text-classification pipeline scores each class with its own
    sigmoid, as /classify does. Data of one label a text, multi-label data without the problem
    type, and a class count other than the data's are one clear line each."""
    import transformers
    from mesh_transformer.serve.classify import probabilities
    from mesh_transformer.train.loop import open_datasets
    hf_dir = tmp_path / "hf"
    make_hf_gptj(hf_dir, vocab_size=50257, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64,
                 initializer_range=0.2)
    data = tmp_path / "data"
    build(write_jsonl(tmp_path / "train.jsonl", TAGGED[:32]), data, name="train", label_key="tags")
    build(write_jsonl(tmp_path / "val.jsonl", TAGGED[32:]), data, name="val", label_key="tags")
    config = {**RUN, "num_labels": 4, "label_names": TAGS, "classify": {"problem_type": "multi_label_classification"},
              "total_steps": 40, "anneal_steps": 40, "ckpt_every": 40, "val_every": 40,
              "train_set": str(data / "train.index.json"), "val_set": {"held": str(data / "val.index.json")},
              "model_dir": str(tmp_path / "ckpt")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    run = subprocess.run([sys.executable, "device_train.py", "--config", str(tmp_path / "config.json"),
                          "--cpu-devices", "8", "--no-tensorboard", "--log-dir", str(tmp_path / "logs"),
                          "--hf", str(hf_dir)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines())}
    assert rows[40]["train/loss"] < rows[1]["train/loss"] / 2
    assert rows[40]["val/accuracy_held"] == 1.0 and rows[40]["val/exact_match_held"] == 1.0

    export = subprocess.run([sys.executable, "to_hf_weights.py", "--input-ckpt", str(tmp_path / "ckpt"),
                             "--output-path", str(tmp_path / "export"), "--dtype", "fp32", "--cpu"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stdout[-2000:] + export.stderr[-2000:]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    assert model.config.problem_type == "multi_label_classification" and model.config.id2label == dict(enumerate(TAGS))
    tokenizer = load_tokenizer("gpt2")
    held = TAGGED[32:]
    targets = torch.tensor([[float(tag in r["tags"]) for tag in TAGS] for r in held])
    with torch.no_grad():  # a text at a time: its last token is the one read
        logits = torch.cat([model(torch.tensor([tokenizer.encode(r["text"])])).logits for r in held])
        loss = model(torch.tensor([tokenizer.encode(held[0]["text"])]), labels=targets[:1]).loss
    assert ((logits > 0) == (targets > 0.5)).all()
    assert torch.nn.functional.binary_cross_entropy_with_logits(logits, targets).item() == pytest.approx(
        rows[40]["val/loss_held"], rel=1e-3)
    assert loss.item() == pytest.approx(torch.nn.functional.binary_cross_entropy_with_logits(
        logits[:1], targets[:1]).item(), rel=1e-5)  # transformers' own loss for its problem_type
    pipe = transformers.pipeline("text-classification", model=model, tokenizer=tokenizer, top_k=None)
    scores = {d["label"]: d["score"] for d in pipe([held[0]["text"]])[0]}
    np.testing.assert_allclose([scores[t] for t in TAGS], probabilities(logits[:1].numpy(),
                                                                        "multi_label_classification")[0], rtol=1e-5)
    assert loading.load(ckpt=str(tmp_path / "ckpt"), mp=2, dp=1).config.problem_type == "multi_label_classification"

    from mesh_transformer.train.loop import TrainHost
    with pytest.raises(ConfigError) as e:  # a resume that would train the head under another loss
        TrainHost(config_from_dict({**config, "classify": {}})).start_state()
    assert str(e.value) == (f"config key 'problem_type': {tmp_path / 'ckpt'} (step 40) trained a "
                            f"multi_label_classification, this config a single_label_classification; to switch, "
                            f"start a new model_dir with --tune-model-path {tmp_path / 'ckpt'}")

    def refusal(**overrides):
        with pytest.raises(ConfigError) as e:
            open_datasets(config_from_dict({**config, **overrides}))
        return str(e.value)
    train_set = data / "train.index.json"
    assert refusal(classify={}, problem_type=None) == (
        f"{train_set} holds multi-label texts (a list of classes each): set the config key 'problem_type' to "
        '"multi_label_classification"')
    assert refusal(classify={"problem_type": "single_label_classification"}).startswith(  # (the key that set it)
        f"{train_set} holds multi-label texts (a list of classes each): set the config key 'classify.problem_type'")
    build(write_jsonl(tmp_path / "one.jsonl", [{"text": "a", "tags": 2}]), data, name="one", label_key="tags")
    assert refusal(train_set=str(data / "one.index.json"), label_names=None) == (
        f"config key 'classify.problem_type': a multi-label classification trains on texts labelled with lists of "
        f"classes, but {data / 'one.index.json'} gives each text one label")
    build(write_jsonl(tmp_path / "n.jsonl", [{"text": "a", "tags": [2]}]), data, name="n", label_key="tags")
    assert refusal(train_set=str(data / "n.index.json"), label_names=None) == (
        f"config key 'num_labels': 4 classes, but {data / 'n.index.json'} has 3 (set num_labels 3, or build it with "
        f"--label-names naming all 4 classes: the last ones no text has count too)")
