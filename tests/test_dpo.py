"""DPO (train/preference.py) against TRL's DPOTrainer, the reference implementation: the same pairs
tokenized into the same rows and masks, and on one batch the same loss, metrics and gradients,
for a full fine-tune (a reference model of its own) and for LoRA (the reference is the base with
the adapters off), on text and on conversational pairs. Then the preference dataset and loader,
and a whole run with `device_train.py`'s loop: it learns the preference, validates, and resumes
exactly with its reference read back."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import trl  # the oracle (requirements-dev.txt)

from helpers import ONE_CASE_PER_FAMILY, hf_grads_as_params, make_hf_gptj, make_hf_model, mesh
from mesh_transformer import lora
from mesh_transformer.config import Config, ConfigError, TrainConfig, config_from_dict
from mesh_transformer.io.checkpoint import CheckpointManager
from mesh_transformer.data import BuildConfig, Dataset, DatasetError, Loader, build_dataset
from mesh_transformer.io import hf
from mesh_transformer.io.tokenizer import load_tokenizer
from mesh_transformer.train import preference
from mesh_transformer.train.step import Trainer


CASE = "llama_gqa2_llama3_rope"  # a tiny LLaMA (grouped-query attention), with GPT-2's vocabulary
GPT2_VOCAB = 50257
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT_PAIRS = [{"prompt": f"Question {i}: which is red?\nAnswer:", "chosen": f" An apple{'!' * i}.",
               "rejected": " The sky" + " at noon" * i + "."} for i in range(4)]
TEXT_PAIRS[1]["chosen"] += "<|endoftext|>"  # ends with EOS's text already: no second EOS (TRL adds none either)
CHAT_PAIRS = [{"prompt": [{"role": "user", "content": f"A red fruit ({i})?"}],
               "chosen": [{"role": "assistant", "content": "A cherry" + "!" * i}],
               "rejected": [{"role": "assistant", "content": "Blue" * (i + 1)}]} for i in range(4)]
SEQ = 63  # rows of 64 tokens: the tiny models' max_position_embeddings


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def tokenizer_dir(path, chat: bool):
    tok = copy.deepcopy(load_tokenizer("gpt2"))  # load_tokenizer's are shared: never changed in place
    if chat:
        tok.chat_template = CHATML
    tok.save_pretrained(path)
    return str(path)


def build(src, out, tokenizer="gpt2", seq=SEQ, **kw):
    cfg = BuildConfig(input_path=str(src), name=kw.pop("name", "pairs"), output_dir=str(out), tokenizer=tokenizer,
                      seq=seq, preserve_data_order=kw.pop("preserve_data_order", True), **kw)
    return Dataset.open(build_dataset(cfg))


def trl_trainer(tmp_path, model, ref_model, tokenizer, records, dpo, peft_config=None):
    import datasets
    tok = copy.deepcopy(load_tokenizer(tokenizer))
    tok.pad_token = tok.eos_token
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(records), **dpo,
                         report_to="none", use_cpu=True, bf16=False)  # TRL's default autocasts to bf16
    return trl.DPOTrainer(model=model, ref_model=ref_model, args=args, processing_class=tok, peft_config=peft_config,
                          train_dataset=datasets.Dataset.from_list(records))


def peft_adapter():
    import peft
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def randomise_adapter(model, directory):
    """PEFT's B starts at zero (the adapter then changes nothing): draw it, and save the adapter."""
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    model.save_pretrained(directory)


# TRL's loss variants, each under its `DPOConfig` names: every loss type but "aot"/"aot_unpaired" (refused),
# each f-divergence, LD-DPO's alpha and WPO's weighting, with every one of them somewhere.
VARIANTS = {
    "sigmoid": {},
    "hinge+ipo": dict(loss_type=["hinge", "ipo"], loss_weights=[1.0, 0.5]),
    "robust-js": dict(loss_type="robust", label_smoothing=0.1, f_divergence_type="js_divergence"),
    "mpo-ld": dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0], ld_alpha=0.5),
    "exo+discopop-alpha": dict(loss_type=["exo_pair", "discopop"], label_smoothing=1e-3, discopop_tau=0.2,
                               f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3),
    "nca+sppo+apo_zero-wpo": dict(loss_type=["nca_pair", "sppo_hard", "apo_zero"], use_weighting=True),
    "sigmoid_norm+hinge-forward_kl": dict(loss_type=["sigmoid_norm", "hinge"], f_divergence_type="forward_kl"),
    "apo_down+sft-ld0": dict(loss_type=["apo_down", "sft"], ld_alpha=0.0),
}


@pytest.mark.parametrize("how, variant", [("full-text", "sigmoid"), ("lora-chat", "sigmoid"),
                                          *(("full-text", v) for v in VARIANTS if v != "sigmoid"),
                                          ("lora-chat", "nca+sppo+apo_zero-wpo")])
def test_dpo_equals_trl(how, variant, tmp_path):
    """The rows and masks are TRL's tokenization; the loss, TRL's logged metrics and every gradient
    are TRL's (float32, mp=2; the full fine-tune also dp=2), for each loss variant."""
    full, chat = how.startswith("full"), how.endswith("chat")
    records, beta = (CHAT_PAIRS, 0.5) if chat else (TEXT_PAIRS, 0.3)
    dpo = dict(VARIANTS[variant], beta=beta)
    tokenizer = tokenizer_dir(tmp_path / "tok", chat)
    policy = make_hf_model(tmp_path / "policy", CASE, seed=0, vocab_size=GPT2_VOCAB)
    if full:
        reference = make_hf_model(tmp_path / "reference", CASE, seed=1, vocab_size=GPT2_VOCAB)
        theirs = trl_trainer(tmp_path, policy, reference, tokenizer, records, dpo)
    else:  # TRL adds a fresh adapter and takes the base (adapters off) as the reference; its B is then made random
        theirs = trl_trainer(tmp_path, policy, None, tokenizer, records, dpo, peft_config=peft_adapter())
        randomise_adapter(theirs.model, tmp_path / "adapter")

    ds = build(write_jsonl(tmp_path / "pairs.jsonl", records), tmp_path / "data", tokenizer=tokenizer)
    assert ds.pairs and len(ds) == 2 * len(records)
    tokens, mask = ds.read(np.arange(len(ds)))
    for i, row in enumerate(theirs.train_dataset):
        for side, completion in enumerate((row["chosen_ids"], row["rejected_ids"])):
            n = len(row["prompt_ids"]) + len(completion)
            assert tokens[2 * i + side, :n].tolist() == row["prompt_ids"] + completion
            assert mask[2 * i + side].tolist() == [0] * (len(row["prompt_ids"]) - 1) + [1] * len(completion) + [0] * (SEQ - n + 1)

    loss, logged = trl_step(theirs)
    train = dict(per_replica_batch=len(records) // (2 if full else 1), dpo=dpo, cores_per_replica=2)
    tr, params, expected = ours_beside_trl(tmp_path, full, train, theirs, policy)
    assert_same_step(tr, params, tokens, mask, loss, logged, expected, preference.METRICS[1:])


def trl_step(theirs):
    """(loss, {metric: value}) of TRL's trainer on its first batch, its gradients left in its model."""
    loss = theirs.compute_loss(theirs.model, next(iter(theirs.get_train_dataloader())))
    loss.backward()
    return loss.item(), {k: v[-1] for k, v in theirs._metrics["train" if theirs.model.training else "eval"].items()}


def ours_beside_trl(tmp_path, full, train, theirs, policy):
    """(our Trainer, our params, TRL's gradients as our params) for TRL's run on the HF models saved
    under tmp_path: full fine-tuning on dp2 x mp2 against "reference"; else TRL's PEFT adapter
    (saved to "adapter") on mp2, the reference being the base with it off. `train`: TrainConfig keys."""
    config, params = hf.load_hf(str(tmp_path / "policy"), mp=2)
    config = dataclasses.replace(config, compute_dtype="float32", remat="none")
    if full:
        tr = Trainer(Config(config, TrainConfig(**train)), mesh(2, 2))
        tr.set_base(hf.load_hf(str(tmp_path / "reference"), mp=2)[1])
        return tr, params, hf_grads_as_params(policy, tmp_path / "grads")
    spec, params = lora.load_peft(str(tmp_path / "adapter"), config)
    tr = Trainer(Config(config, TrainConfig(**train, lora=spec.to_dict())), mesh(1, 2))
    tr.set_base(hf.load_hf(str(tmp_path / "policy"), mp=2)[1])
    return tr, params, hf_grads_as_params(theirs.model, tmp_path / "grads", peft_model=True, config=config)


def assert_same_step(tr, params, tokens, mask, loss, logged, expected, names, labels=None):
    """Our loss, metrics `names` and gradients on one batch of pair rows (tokens, mask; KTO's
    `labels` [rows]) equal TRL's (`loss`, `logged`, `expected` gradients as our params)."""
    params = jax.device_put(params, tr.state_shardings.params)
    rows = {"tokens": tokens[None], "mask": mask[None]}
    batch = tr.shard_batch(rows if labels is None else {**rows, "labels": labels[None, :, None]})
    sums, count = tr.eval_values(params, batch)
    ours = {k: float(v) for k, v in tr.means(sums, count).items()}
    assert float(count) == len(tokens) // 2
    assert abs(ours["loss"] - loss) < 2e-5 * max(1.0, abs(loss))
    for name in names:
        assert abs(ours[name] - logged[name]) < 2e-4 * max(1.0, abs(logged[name])), name

    ours_loss, grads = tr.loss_and_grads(params, batch)
    assert abs(float(ours_loss) - loss) < 2e-5 * max(1.0, abs(loss))
    grads = jax.device_get(grads)
    scale = max(float(np.abs(g).max()) for leaves in expected.values() for g in leaves.values())
    assert scale > 1e-3  # the pairs move the weights
    errors = {(m, n): float(np.abs(np.asarray(g)[tuple(slice(0, s) for s in expected[m][n].shape)]
                                   - expected[m][n]).max()) for m, leaves in grads.items() for n, g in leaves.items()}
    assert max(errors.values()) < 1e-4 * scale, max(errors.items(), key=lambda kv: kv[1])


# TRL's reference-free trainers (trl.experimental): CPOConfig and ORPOConfig, each under its own config key.
FREE_VARIANTS = {
    "cpo": ("cpo", {}),
    "simpo": ("cpo", dict(loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.5, beta=2.0, label_smoothing=0.1)),
    "cpo-simpo": ("cpo", dict(loss_type="simpo", cpo_alpha=0.5, beta=2.0)),
    "cpo-hinge": ("cpo", dict(loss_type="hinge", cpo_alpha=0.3, beta=0.5)),
    "cpo-ipo-alphapo": ("cpo", dict(loss_type="ipo", alpha=0.2, beta=0.3)),
    "orpo": ("orpo", dict(beta=0.3)),
}


def trl_batch_as_rows(batch):
    """TRL's collated pairs (chosen_* and rejected_* input ids and labels, -100 off the completion,
    padded) as our pair rows: tokens [2k, SEQ+1], mask [2k, SEQ] (1 where the next token is trained)."""
    k = len(batch["chosen_input_ids"])
    tokens, mask = np.zeros((2 * k, SEQ + 1), np.int32), np.zeros((2 * k, SEQ), np.float32)
    for i in range(k):
        for side, name in enumerate(("chosen", "rejected")):
            ids, labels = batch[f"{name}_input_ids"][i], batch[f"{name}_labels"][i]
            n = int(batch[f"{name}_attention_mask"][i].sum())  # padded on the right
            tokens[2 * i + side, :n] = ids[:n].numpy()
            mask[2 * i + side, :n - 1] = (labels[1:n] != -100).numpy()
    return tokens, mask


@pytest.mark.parametrize("variant", [*FREE_VARIANTS, "orpo-lora"])
def test_reference_free_objectives_equal_trl(variant, tmp_path):
    """CPO (and SimPO, AlphaPO's rewards) and ORPO need no reference: on one batch of TRL's own
    rows, the loss, every logged metric and every gradient equal TRL's CPOTrainer's / ORPOTrainer's
    (float32, dp2 x mp2; LoRA: PEFT's adapter, made random, on mp2)."""
    import datasets
    from trl.experimental import cpo, orpo
    lora_run = variant.endswith("-lora")
    key, options = FREE_VARIANTS[variant.removesuffix("-lora")]
    trainer_class, config_class = {"cpo": (cpo.CPOTrainer, cpo.CPOConfig),
                                   "orpo": (orpo.ORPOTrainer, orpo.ORPOConfig)}[key]
    policy = make_hf_model(tmp_path / "policy", CASE, seed=0, vocab_size=GPT2_VOCAB)
    tok = copy.deepcopy(load_tokenizer("gpt2"))
    tok.pad_token = tok.eos_token
    args = config_class(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(TEXT_PAIRS), max_length=SEQ,
                        report_to="none", use_cpu=True, bf16=False, **options)
    theirs = trainer_class(model=policy, args=args, processing_class=tok,
                           peft_config=peft_adapter() if lora_run else None,
                           train_dataset=datasets.Dataset.from_list(TEXT_PAIRS))
    if lora_run:
        randomise_adapter(theirs.model, tmp_path / "adapter")
    batch = next(iter(theirs.get_train_dataloader()))
    loss = theirs.compute_loss(theirs.model, batch)
    loss.backward()
    logged = {k: v[-1] for k, v in theirs._stored_metrics["train"].items()}
    tokens, mask = trl_batch_as_rows(batch)

    config, params = hf.load_hf(str(tmp_path / "policy"), mp=2)
    config = dataclasses.replace(config, compute_dtype="float32", remat="none")
    train = dict(cores_per_replica=2, **{key: options})
    if lora_run:
        spec, params = lora.load_peft(str(tmp_path / "adapter"), config)
        tr = Trainer(Config(config, TrainConfig(per_replica_batch=len(TEXT_PAIRS), lora=spec.to_dict(), **train)),
                     mesh(1, 2))
        tr.set_base(hf.load_hf(str(tmp_path / "policy"), mp=2)[1])
        expected = hf_grads_as_params(theirs.model, tmp_path / "grads", peft_model=True, config=config)
    else:
        tr = Trainer(Config(config, TrainConfig(per_replica_batch=len(TEXT_PAIRS) // 2, **train)), mesh(2, 2))
        assert tr.base == {}
        expected = hf_grads_as_params(policy, tmp_path / "grads")
    assert not tr.needs_reference and not tr.holds_reference
    names = [n for n in tr.metric_names[1:] if n != "nll_loss" or options.get("cpo_alpha", 1.0)]  # TRL logs 0 then
    assert_same_step(tr, params, tokens, mask, loss.item(), logged, expected, names)


# ----------------------------------------------------------------------------- reward models

def hf_reward_model(path, seed: int = 0):
    """A tiny LlamaForSequenceClassification of one output (GPT-2's vocabulary) saved to `path`."""
    import torch
    import transformers
    lm = make_hf_model(path / "lm", CASE, seed=seed, vocab_size=GPT2_VOCAB)
    config = transformers.LlamaConfig.from_dict({**lm.config.to_dict(), "id2label": {0: "LABEL_0"},
                                                        "label2id": {"LABEL_0": 0}, "architectures": None})
    torch.manual_seed(seed + 1)
    model = transformers.LlamaForSequenceClassification(config)
    model.load_state_dict(lm.state_dict(), strict=False)
    model.save_pretrained(path)
    return model


def peft_merged_reward(tmp_path, theirs):
    """() -> (our rewards, PEFT's) of the pairs' chosen rows: the SEQ_CLS adapter saved under
    tmp_path (its head's trained copy first drawn apart from the base's) merged into the classifier
    at load (`--lora-adapter`: that head replacing the base's) against TRL's PEFT model now (before
    its gradients are written over its weights)."""
    import torch
    from mesh_transformer import loading
    from mesh_transformer.evaluate.scoring import Scorer
    rows = [row["chosen_ids"] for row in theirs.train_dataset]
    torch.manual_seed(3)
    with torch.no_grad():  # the head's trained copy made to differ from the base's, and saved again
        for name, p in theirs.model.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.5 * torch.randn_like(p))
        theirs.model.save_pretrained(tmp_path / "adapter")
        want = [theirs.model(torch.tensor([ids])).logits.item() for ids in rows]

    def ours():
        loaded = loading.load(hf=str(tmp_path / "policy"), lora_adapter=str(tmp_path / "adapter"), mp=2, dp=1,
                              dtype="float32")
        return Scorer.for_generator(loaded.generator()).classify(rows)[:, 0], want
    return ours


@pytest.mark.parametrize("reward, how", [({}, "full"), ({"center_rewards_coefficient": 0.3}, "full"), ({}, "lora")])
def test_reward_model_equals_trl(reward, how, tmp_path):
    """A reward model (num_labels 1, config key 'reward') on the pairs: its rows are TRL's
    RewardTrainer's (prompt and completion, EOS appended), each row's reward is read at its last
    token (TRL's model reads the last token that is not its pad token, a token the data lacks here),
    and on one batch the loss, TRL's accuracy, margin and mean reward, and every gradient equal TRL's
    (float32, dp2 x mp2). With LoRA (PEFT's SEQ_CLS adapter, its B drawn) the score head trains
    whole beside the adapters, as PEFT's `modules_to_save` trains it: its gradient is TRL's too."""
    import datasets
    import peft
    policy = hf_reward_model(tmp_path / "policy")
    tok = copy.deepcopy(load_tokenizer("gpt2"))
    tok.pad_token = tok.convert_ids_to_tokens(50000)
    args = trl.RewardConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(TEXT_PAIRS),
                            report_to="none", use_cpu=True, bf16=False, **reward)
    adapter = None if how == "full" else peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8,
                                                         target_modules=["q_proj", "v_proj", "down_proj"])
    theirs = trl.RewardTrainer(model=policy, args=args, processing_class=tok, peft_config=adapter,
                               train_dataset=datasets.Dataset.from_list(TEXT_PAIRS))
    if adapter is not None:
        randomise_adapter(theirs.model, tmp_path / "adapter")
        merged_at_load = peft_merged_reward(tmp_path, theirs)
    ds = build(write_jsonl(tmp_path / "pairs.jsonl", TEXT_PAIRS), tmp_path / "data")
    tokens, mask = ds.read(np.arange(len(ds)))
    for i, row in enumerate(theirs.train_dataset):
        for side, ids in enumerate((row["chosen_ids"], row["rejected_ids"])):
            assert tokens[2 * i + side, :len(ids)].tolist() == ids and 50000 not in ids
            assert mask[2 * i + side, len(ids) - 2] == 1 and not mask[2 * i + side, len(ids) - 1:].any()

    loss, logged = trl_step(theirs)
    assert logged["accuracy"] not in (0.0, 1.0) or abs(logged["margin"]) > 1e-3  # the rewards differ
    config, params = hf.load_hf(str(tmp_path / "policy"), mp=2)
    config = dataclasses.replace(config, compute_dtype="float32", remat="none")
    assert config.num_labels == 1
    train = TrainConfig(per_replica_batch=len(TEXT_PAIRS) // 2, cores_per_replica=2, reward=reward)
    if adapter is None:
        tr = Trainer(Config(config, train), mesh(2, 2))
        assert tr.base == {}
        expected = hf_grads_as_params(policy, tmp_path / "grads")
    else:
        spec, params = lora.load_peft(str(tmp_path / "adapter"), config)
        assert "score" in params["llama/score"]  # PEFT's modules_to_save, read with the adapter
        with pytest.raises(ConfigError, match="a sequence classifier's adapter .* on a language model: load its base"):
            lora.load_peft(str(tmp_path / "adapter"), dataclasses.replace(config, num_labels=0))
        tr = Trainer(Config(config, dataclasses.replace(train, lora=spec.to_dict())), mesh(2, 2))
        tr.set_base(hf.load_hf(str(tmp_path / "policy"), mp=2)[1])
        assert "llama/score" not in tr.base and "score" in tr.param_specs["llama/score"]
        expected = hf_grads_as_params(theirs.model, tmp_path / "grads", peft_model=True, config=config)
        np.testing.assert_allclose(*merged_at_load(), atol=1e-5)
    assert tr.metric_names == ("loss", "accuracy", "margin", "mean_reward")
    assert_same_step(tr, params, tokens, mask, loss, logged, expected, ("accuracy", "margin", "mean_reward"))


@pytest.mark.parametrize("overrides, message", [
    (dict(num_labels=1), "num_labels 1: a classifier trains on preference pairs as a reward model "
                        "(config key 'reward') or on labelled texts (config key 'classify')"),
    (dict(reward={}), "config key 'num_labels': 'reward' trains a reward model, a classifier of one output: set "
                      "num_labels 1, got 0"),
    (dict(num_labels=2, reward={}), "set num_labels 1, got 2"),
    (dict(num_labels=1, dpo={}), "a classifier (1 labels) trains with 'reward' or 'classify' only, not 'dpo'"),
    (dict(num_labels=1, reward={"center_rewards_coefficient": -1}),
     "config key 'reward.center_rewards_coefficient' must be a number at least 0, or null, got -1"),
    (dict(num_labels=1, reward={"margin": 1}), "reward"),
    (dict(num_labels=1, reward={}, eval_harness_tasks=["lambada_openai"]),
     "config key 'eval_harness_tasks': a classifier (num_labels 1) neither generates nor scores text"),
    (dict(num_labels=-1), "config key 'num_labels': must be 0 (a language model) or the classifier's label count"),
])
def test_bad_reward_model_config_is_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Trainer(config_from_dict({"layers": 1, "d_model": 8, "n_heads": 1, "n_vocab": 16, "seq": 8, **overrides}),
                mesh(1, 1))


# KTO's unpaired examples: text and conversational, both labels, one completion ending with EOS's text.
KTO_TEXT = [{"prompt": f"Question {i}: which is red?\nAnswer:", "completion": [" An apple.", " The sky" + " at noon" * i,
                                                                               " A rose!<|endoftext|>", " Grass"][i % 4],
             "label": i % 4 in (0, 2)} for i in range(6)]
KTO_CHAT = [{"prompt": [{"role": "user", "content": f"A red fruit ({i})?"}],
             "completion": [{"role": "assistant", "content": "A cherry" + "!" * i if i % 2 else "Blue" * (i + 1)}],
             "label": bool(i % 2)} for i in range(4)]
KTO_VARIANTS = {"kto": {}, "kto-weighted": dict(desirable_weight=1.5, undesirable_weight=0.7, beta=0.5),
                "apo_zero_unpaired": dict(loss_type="apo_zero_unpaired")}


@pytest.mark.parametrize("how, variant", [("full-text", "kto"), ("full-text", "apo_zero_unpaired"),
                                          ("lora-chat", "kto-weighted")])
def test_kto_equals_trl(how, variant, tmp_path):
    """KTO on unpaired examples: our rows (each example's, then its KL row) are TRL's tokenization;
    the loss, TRL's logged metrics (the KL estimate, per-label rewards and log-probabilities) and
    every gradient are TRL's KTOTrainer's on one batch (float32, mp=2; the full fine-tune also dp=2,
    the KL estimate then spans both replicas), for a full fine-tune against a reference model and
    for LoRA against the base."""
    import datasets
    full, chat = how.startswith("full"), how.endswith("chat")
    records, kto = (KTO_CHAT if chat else KTO_TEXT), dict(KTO_VARIANTS[variant])
    tokenizer = tokenizer_dir(tmp_path / "tok", chat)
    # seeds where the policy gives the KL rows more probability than the reference: a positive KL
    # estimate, which the loss then reads (TRL clamps it at 0, as a random adapter makes it with LoRA)
    policy = make_hf_model(tmp_path / "policy", CASE, seed=1, vocab_size=GPT2_VOCAB)
    reference = make_hf_model(tmp_path / "reference", CASE, seed=0, vocab_size=GPT2_VOCAB) if full else None
    tok = copy.deepcopy(load_tokenizer(tokenizer))
    tok.pad_token = tok.eos_token
    args = trl.KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(records), report_to="none",
                         use_cpu=True, bf16=False, train_sampling_strategy="sequential", **kto)
    # TRL's KL row of example j takes example j-1's completion; ours takes the next example's: the same
    # rows when TRL reads the examples in reverse
    theirs = trl.KTOTrainer(model=policy, ref_model=reference, args=args, processing_class=tok,
                            train_dataset=datasets.Dataset.from_list(records[::-1]),
                            peft_config=None if full else peft_adapter())
    if not full:
        randomise_adapter(theirs.model, tmp_path / "adapter")

    ds = build(write_jsonl(tmp_path / "unpaired.jsonl", records), tmp_path / "data", tokenizer=tokenizer)
    assert ds.pairs and ds.labels and len(ds) == 2 * len(records)
    tokens, mask = ds.read(np.arange(len(ds)))
    labels = ds.read_labels(np.arange(len(ds)))
    n = len(records)
    for j, row in enumerate(theirs.train_dataset):
        i = n - 1 - j
        assert labels[2 * i] == labels[2 * i + 1] == row["label"]
        for side, completion in enumerate((row["completion_ids"], row.get("KL_completion_ids"))):
            if completion is None:  # apo_zero_unpaired: TRL makes no KL rows
                completion = theirs.train_dataset[(j - 1) % n]["completion_ids"]
            length = len(row["prompt_ids"]) + len(completion)
            assert tokens[2 * i + side, :length].tolist() == row["prompt_ids"] + completion
            assert mask[2 * i + side].tolist() == ([0] * (len(row["prompt_ids"]) - 1) + [1] * len(completion)
                                                   + [0] * (SEQ - length + 1))

    loss, logged = trl_step(theirs)
    assert (logged["kl"] > 0.1) == (variant == "kto")
    train = dict(per_replica_batch=n // (2 if full else 1), kto=kto, cores_per_replica=2)
    tr, params, expected = ours_beside_trl(tmp_path, full, train, theirs, policy)
    assert_same_step(tr, params, tokens, mask, loss, logged, expected, preference.KTO_METRICS[1:], labels)


@pytest.mark.parametrize("weights, counts, advice", [
    ({}, (30, 10), "kto: 30 desirable and 10 undesirable examples; KTO's paper advises either "
                   "'kto.desirable_weight' in [0.33, 0.44] (at 'undesirable_weight' 1.0) or "
                   "'kto.undesirable_weight' in [2.26, 3.0] (at 'desirable_weight' 1.0), not both"),
    ({"undesirable_weight": 2.5}, (30, 10), None),  # in the range
    ({"desirable_weight": 0.4}, (30, 10), None),
    ({}, (20, 20), None),  # balanced
])
def test_kto_says_where_its_weights_leave_the_papers_range(weights, counts, advice):
    """TRL's KTOTrainer warns when unbalanced labels and the weights fall outside the paper's eq. 8
    range; so do we, at the start of a run (its message, its rounded bounds)."""
    assert preference.KtoConfig.from_dict(weights).weight_advice(*counts) == advice


def test_kto_runs_its_kl_rows_without_a_backward_and_not_at_all_when_unread(monkeypatch):
    """The KL rows get no gradient, so they are run apart, forward only: the compiled KTO step holds
    under 60% of the temporaries DPO's holds on the same rows (DPO keeps every row's activations for
    its backward). With "apo_zero_unpaired", which reads no KL row, they are not run at all: two
    forwards (policy and reference, the examples' rows) instead of four."""
    from helpers import tiny_config
    temps, forwards = {}, {}
    for name, objective in (("dpo", {"dpo": {}}), ("kto", {"kto": {}}),
                            ("apo", {"kto": {"loss_type": "apo_zero_unpaired"}})):
        tr = Trainer(tiny_config(**objective, per_replica_batch=4, seq=64, layers=2), mesh(1, 1))
        tr.base = tr.init_base(0)
        calls = []
        real = type(tr.model).apply
        monkeypatch.setattr(type(tr.model), "apply", lambda self, *a, **k: calls.append(a[1].shape) or real(self, *a, **k))
        lowered = tr.step.lower(tr.abstract_state, tr.abstract_batch())
        monkeypatch.undo()
        forwards[name] = calls
        if name != "apo":
            temps[name] = lowered.compile().memory_analysis().temp_size_in_bytes
    assert temps["kto"] < 0.6 * temps["dpo"]
    assert forwards["dpo"] == [(8, 64)] * 2 and forwards["kto"] == [(4, 64)] * 4 and forwards["apo"] == [(4, 64)] * 2


@pytest.mark.parametrize("objective", [{"dpo": {"loss_type": ["sigmoid", "ipo", "sft"]}}, {"cpo": {"alpha": 0.3}},
                                       {"cpo": {"loss_type": "simpo"}}, {"orpo": {}}, {"kto": {}}],
                         ids=lambda o: json.dumps(o))
def test_padding_pairs_count_for_nothing(objective):
    """A validation pass's padding pair (rows that train on no token) changes no sum and no gradient,
    and nothing becomes NaN or infinite (eagerly, as XLA does not simplify it away there)."""
    config = config_from_dict({"layers": 1, "d_model": 8, "n_heads": 1, "n_vocab": 16, "seq": 8, **objective})
    rule = preference.objective(config.train)
    rng = np.random.default_rng(0)
    logps, reference = (-rng.uniform(0.1, 3.0, (6, 8)).astype(np.float32) for _ in range(2))
    mask = np.zeros((6, 8), np.float32)
    mask[:4, 3:] = 1
    mask[1, 6:] = 0
    labels = np.array([1, 1, 0, 0, 1, 1], np.float32)  # KTO's: a desirable example, an undesirable one

    def total(lp, rows):
        return rule.pair_sums(lp[:rows], reference[:rows], mask[:rows], nll_scale=2 / mask[0:4:2].sum(),
                              labels=labels[:rows])[0]
    for rows in (4, 6):
        value, grad = jax.value_and_grad(total)(logps, rows)
        assert np.isfinite(value) and np.isfinite(grad).all()
        sums, count = rule.pair_sums(logps[:rows], reference[:rows], mask[:rows], labels=labels[:rows])[1:]
        assert float(count) == 2 and all(np.isfinite(float(v)) for v in sums.values())
    padded, plain = (jax.value_and_grad(total)(logps, rows) for rows in (6, 4))
    assert float(padded[0]) == pytest.approx(float(plain[0]), rel=1e-6)
    np.testing.assert_allclose(padded[1], plain[1], rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- data

def test_pairs_are_stored_as_adjacent_rows_and_shuffled_as_pairs(tmp_path):
    """Each pair is two rows (chosen, rejected), padded, masked to the completion; shuffling, when the
    dataset is built and when it is read, moves whole pairs; a batch must hold whole pairs."""
    records = [{"prompt": f"Question {i}:", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(12)]
    src = write_jsonl(tmp_path / "p.jsonl", records)
    ds = build(src, tmp_path / "out", seq=16, preserve_data_order=False)
    index = json.loads((tmp_path / "out" / "pairs.index.json").read_text())
    assert (index["version"], index["pairs"], index["has_segments"], index["stats"]["pairs"]) == (3, True, False, 12)
    tok = load_tokenizer("gpt2")
    tokens, mask = ds.read(np.arange(len(ds)))
    texts = [tok.decode(row[: int(np.flatnonzero(m)[-1]) + 2]) for row, m in zip(tokens, mask)]
    seen = sorted(int(a.split(":")[0].split()[1]) for a in texts[0::2])
    assert seen == list(range(12)) and texts[0::2] != sorted(texts[0::2])  # shuffled, every pair once
    for chosen, rejected in zip(texts[0::2], texts[1::2]):
        i = chosen.split(":")[0].split()[1]
        assert (chosen, rejected) == (f"Question {i}: yes {i}<|endoftext|>", f"Question {i}: no {i}<|endoftext|>")
    loader = Loader(ds, 6, seed=3, accumulation=2, rows=(2, 6))
    for _ in range(3):
        batch = next(loader)
        for rows in batch["tokens"]:
            for chosen, rejected in zip(rows[0::2], rows[1::2]):
                assert tok.decode(chosen).split(":")[0] == tok.decode(rejected).split(":")[0]
    loader.close()
    for bad in (dict(global_batch=5), dict(global_batch=6, rows=(1, 5))):
        with pytest.raises(ValueError, match="preference pairs"):
            Loader(ds, **bad)


def test_unpaired_examples_are_stored_with_their_kl_rows_and_labels(tmp_path):
    """Each unpaired example is two rows, its own and its KL row (its prompt, the next example's
    completion; the last example's takes the first one's), both with its label; shuffling moves
    them together, and the loader's labels follow their rows. Examples longer than the row are
    dropped and counted; a KL row longer than it is cut to it."""
    records = [{"prompt": f"Question {i}:", "completion": f" yes {i}" if i % 3 else f" no {i}", "label": bool(i % 3)}
               for i in range(12)]
    records[4]["prompt"] = "Question 4: (a much longer prompt, it is)"  # 12 tokens, and example 5's completion
    records[5]["completion"] = " yes 5" + " and more" * 4  # 11 with EOS: example 4's KL row is cut to the row
    records.append({"prompt": "x", "completion": " y" * 40, "label": True})  # longer than the row: dropped
    ds = build(write_jsonl(tmp_path / "u.jsonl", records), tmp_path / "out", seq=16, preserve_data_order=False,
               name="unpaired")
    index = json.loads((tmp_path / "out" / "unpaired.index.json").read_text())
    assert (index["version"], index["pairs"], index["labels"], index["has_segments"]) == (4, True, True, False)
    assert (index["stats"]["unpaired"], index["stats"]["unpaired_desirable"], index["stats"]["unpaired_dropped_too_long"],
            index["stats"]["kl_rows_cut"]) == (13, 9, 1, 1)
    tok = load_tokenizer("gpt2")
    tokens, mask = ds.read(np.arange(len(ds)))
    labels = ds.read_labels(np.arange(len(ds)))
    assert len(ds) == 24 and (labels[0::2] == labels[1::2]).all()
    prompt, completion = ({i: r[k] for i, r in enumerate(records[:12])} for k in ("prompt", "completion"))
    seen = []
    for row in range(0, 24, 2):
        own, kl = (tok.decode(tokens[r][: int(np.flatnonzero(mask[r])[-1]) + 2]) for r in (row, row + 1))
        i = int(own.split(":")[0].split()[1])
        seen.append(i)
        assert own == f"{prompt[i]}{completion[i]}<|endoftext|>" and labels[row] == (i % 3 > 0)
        expected_kl = f"{prompt[i]}{completion[(i + 1) % 12]}<|endoftext|>"
        assert kl == expected_kl if i != 4 else expected_kl.startswith(kl) and len(tok.encode(kl)) == 17
        assert mask[row + 1, : len(tok.encode(prompt[i])) - 1].sum() == 0 and mask[row + 1].sum() > 0
    assert sorted(seen) == list(range(12)) and seen != sorted(seen)
    loader = Loader(ds, 4, seed=1, accumulation=2)
    batch = next(loader)
    loader.close()
    assert batch["labels"].shape == (2, 4, 1)
    for rows, row_labels in zip(batch["tokens"], batch["labels"][..., 0]):
        for row, label in zip(rows, row_labels):
            assert label == (int(tok.decode(row).split(":")[0].split()[1]) % 3 > 0)


def test_unpair_makes_trls_unpaired_examples_of_pairs_with_kl_rows_of_other_prompts(tmp_path):
    """--unpair: each pair is two unpaired examples, as TRL's `unpair_preference_dataset` makes them
    (the same rows and labels as building its output); both of a pair share a prompt, so their KL
    rows take the completion after them with another prompt: the next pair's chosen one (the last
    pair's: the first pair's)."""
    import datasets

    import create_finetune_dataset
    theirs = trl.unpair_preference_dataset(datasets.Dataset.from_list(TEXT_PAIRS)).to_list()
    assert create_finetune_dataset.main([str(write_jsonl(tmp_path / "pairs.jsonl", TEXT_PAIRS)), "pairs", "--output-dir",
                                         str(tmp_path / "a"), "--seq", str(SEQ), "--preserve-data-order", "--unpair"]) == 0
    ours = Dataset.open(str(tmp_path / "a" / "pairs.index.json"))
    expected = build(write_jsonl(tmp_path / "unpaired.jsonl", theirs), tmp_path / "b")
    assert ours.labels and len(ours) == len(expected) == 4 * len(TEXT_PAIRS)
    rows = [(ds.read(np.arange(len(ds)))[0], ds.read_labels(np.arange(len(ds)))) for ds in (ours, expected)]
    assert sorted((r.tobytes(), l) for r, l in zip(rows[0][0][0::2], rows[0][1][0::2])) == \
        sorted((r.tobytes(), l) for r, l in zip(rows[1][0][0::2], rows[1][1][0::2]))
    tok = load_tokenizer("gpt2")
    tokens, mask = ours.read(np.arange(len(ours)))
    n = len(TEXT_PAIRS)
    for i in range(2 * n):
        pair, next_pair = TEXT_PAIRS[i // 2], TEXT_PAIRS[(i // 2 + 1) % n]
        kl = tok.decode(tokens[2 * i + 1][: int(np.flatnonzero(mask[2 * i + 1])[-1]) + 2])
        assert kl == pair["prompt"] + next_pair["chosen"].removesuffix("<|endoftext|>") + "<|endoftext|>"


@pytest.mark.parametrize("records, message", [
    ([{"prompt": "q", "completion": " a", "label": True}, {"prompt": "r", "completion": " b" * 40, "label": False}],
     "one unpaired example left, once 1 longer than the row were dropped: KTO's KL estimate"),
    ([{"prompt": "q", "completion": " a", "label": True}, {"prompt": "q", "completion": " b", "label": False}],
     r"every unpaired example \(2\) has the same prompt: KTO's KL estimate pairs each prompt with another "
     r"prompt's completion, so it needs two prompts at least"),
    ([{"prompt": "q", "completion": " b" * 40, "label": True}, {"prompt": "", "completion": "", "label": False}],
     r"no unpaired example left to train on: of 2 read, 1 longer than the row and 1 with nothing to train on "
     r"\(seq\+1 = 17 tokens\)"),
])
def test_unpaired_data_left_too_small_says_what_was_dropped(records, message, tmp_path):
    with pytest.raises(DatasetError, match=message):
        build(write_jsonl(tmp_path / "u.jsonl", records), tmp_path / "out", seq=16)
    assert not (tmp_path / "out").exists()


def test_min_unique_tokens_judges_an_unpaired_example_by_its_own_row(tmp_path):
    """A repetitive completion drops its own example, not the one whose KL row borrows it."""
    records = [{"prompt": "Q0:", "completion": " one two three four", "label": True},
               {"prompt": "Q1:", "completion": " no" * 6, "label": False},
               {"prompt": "Q2:", "completion": " five six seven eight", "label": True}]
    ds = build(write_jsonl(tmp_path / "u.jsonl", records), tmp_path / "out", seq=16, min_unique_tokens=6)
    tok = load_tokenizer("gpt2")
    tokens, _ = ds.read(np.arange(len(ds)))
    assert [tok.decode(row).split(":")[0] for row in tokens[0::2]] == ["Q0", "Q2"]
    assert " no no" in tok.decode(tokens[1])  # Q0's KL row: Q1's completion, as it was built


@pytest.mark.parametrize("form", ["conversational", "text"])
def test_implicit_prompt_and_dropped_pairs(form, tmp_path):
    """Without 'prompt', what chosen and rejected share is the prompt, split as TRL's own
    `extract_prompt` splits it (messages; text, a space before they differ going with the
    completions); a pair with a side longer than the row, or with a side that trains on no token
    (an empty prompt and completion: its EOS is the row's first token, never predicted), is
    dropped whole and counted."""
    if form == "text":
        implicit = [{"chosen": "Human: sky colour?\n\nAssistant: It is blue.",
                     "rejected": "Human: sky colour?\n\nAssistant: It is green, I think."}]
    else:
        prompt = [{"role": "user", "content": "Hi?"}]
        implicit = [{"chosen": prompt + [{"role": "assistant", "content": "Hello."}],
                     "rejected": prompt + [{"role": "assistant", "content": "Go away."}]}]
    explicit = [trl.extract_prompt(implicit[0])]
    assert explicit[0]["prompt"] and explicit[0]["chosen"] != implicit[0]["chosen"]
    dropped = [{"prompt": "x", "chosen": " y" * 40, "rejected": " z"}, {"prompt": "", "chosen": "", "rejected": "No."}]
    a = build(write_jsonl(tmp_path / "a.jsonl", explicit + dropped), tmp_path / "a", seq=32)
    b = build(write_jsonl(tmp_path / "b.jsonl", implicit + dropped), tmp_path / "b", seq=32)
    assert len(a) == len(b) == 2
    for x, y in zip(a.read(np.arange(2)), b.read(np.arange(2))):
        np.testing.assert_array_equal(x, y)
    index = json.loads((tmp_path / "a" / "pairs.index.json").read_text())
    assert index["stats"]["pairs_dropped_too_long"] == index["stats"]["pairs_dropped_untrained"] == 1


@pytest.mark.parametrize("record, message", [
    ({"prompt": 5, "chosen": "a", "rejected": "b"}, "line 1: field 'prompt' must be a string, .* got int"),
    ({"chosen": "a", "rejected": "b"}, "line 1: no field 'prompt', and 'chosen' and 'rejected' do not start with shared text"),
    ({"prompt": "p", "chosen": [], "rejected": "b"}, "line 1: field 'chosen' must be a string"),
    ({"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]},
     "line 1: field 'prompt' must be a non-empty list of messages"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "user", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, "line 1: field 'chosen' has no assistant message"),
    ({"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
     "line 1: no field 'prompt', and 'chosen' and 'rejected' do not start with shared messages"),
    ({"chosen": "same", "rejected": "same"}, "line 1: no field 'prompt', and 'chosen' and 'rejected' do not start "
                                             "with shared text followed by different text"),
    ({"prompt": "q", "chosen": "a", "rejected": None}, "line 1: field 'rejected' must be a string as 'chosen' is, "
                                                       "got NoneType"),
    ({"prompt": "q", "completion": " a", "label": "yes"}, "line 1: field 'label' must be true .* or false, got 'yes'"),
    ({"prompt": "q", "completion": " a", "label": 1}, "line 1: field 'label' must be true"),
    ({"completion": " a", "label": True}, "line 1: field 'prompt' must be a string, the text 'completion' completes"),
    ({"prompt": "q", "completion": [], "label": True}, "line 1: field 'completion' must be a string or a non-empty list"),
    ({"prompt": "q", "completion": [{"role": "assistant", "content": "a"}], "label": True},
     "line 1: field 'prompt' must be a non-empty list of messages, as 'completion' is a list"),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "a"}], "label": False},
     "line 1: field 'completion' has no assistant message"),
    ({"prompt": "q", "completion": " a", "label": True}, "one unpaired example: KTO's KL estimate pairs each prompt "
                                                         "with another prompt's completion"),
])
def test_bad_preference_records_name_the_line_and_field(record, message, tmp_path):
    with pytest.raises(DatasetError, match=message):
        build(write_jsonl(tmp_path / "bad.jsonl", [record]), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_pair_dataset_with_an_odd_row_count_is_refused():
    with pytest.raises(DatasetError, match="odd number of rows"):
        Dataset.from_arrays(np.zeros((3, 9), np.int32), np.ones((3, 8), np.float32), pairs=True)


@pytest.mark.parametrize("other, message", [
    ({"text": "a document"}, "preference pairs .* mixed with documents"),
    ({"completion": " a", "label": True}, "preference pairs .* mixed with unpaired examples"),
])
def test_pairs_and_other_records_do_not_mix(other, message, tmp_path):
    others = [{"prompt": f"p{i}", **other} if "label" in other else other for i in range(2)]
    src = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "p", "chosen": " a", "rejected": " b"}, *others])
    with pytest.raises(DatasetError, match=message):
        build(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    unpaired = [{"prompt": f"p{i}", "completion": " a", "label": True} for i in range(2)] + [{"in_text": "q", "out_text": " r"}]
    with pytest.raises(DatasetError, match="unpaired examples .* mixed with examples; KTO trains on a dataset"):
        build(write_jsonl(tmp_path / "u.jsonl", unpaired), tmp_path / "out")


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("overrides, message", [
    (dict(dpo={"beta": 0}), "'dpo.beta' must be a positive number"),
    (dict(dpo={"beta": True}), "'dpo.beta' must be a positive number"),
    (dict(dpo={"beta": 0.1, "loss": "ipo"}), "'dpo.loss' is unknown"),
    (dict(dpo={"loss_type": "dpo"}), "'dpo.loss_type': unknown loss 'dpo'"),
    (dict(dpo={"loss_type": []}), "'dpo.loss_type' must be a loss name or a non-empty list"),
    (dict(dpo={"loss_type": ["ipo", "ipo"]}), "'dpo.loss_type' names a loss twice"),
    (dict(dpo={"loss_type": "aot"}), "'aot' is not supported"),
    (dict(dpo={"loss_type": ["ipo", "sft"], "loss_weights": [1]}), "'dpo.loss_weights' must be a list of 2 numbers"),
    (dict(dpo={"loss_type": "robust", "label_smoothing": 0.5}), r"must be in \[0, 0.5\) for the 'robust' loss"),
    (dict(dpo={"loss_type": "exo_pair"}), "must be above 0 for the 'exo_pair' loss"),
    (dict(dpo={"label_smoothing": 0.1}), "applies to the 'robust' and 'exo_pair' losses only"),
    (dict(dpo={"loss_type": "bco_pair", "f_divergence_type": "forward_kl"}), "does not apply to the loss 'bco_pair'"),
    (dict(dpo={"f_divergence_type": "kl"}), "'dpo.f_divergence_type' must be one of reverse_kl"),
    (dict(dpo={"ld_alpha": 2}), r"'dpo.ld_alpha' must be a number in \[0, 1\]"),
    (dict(dpo={"use_weighting": "yes"}), "'dpo.use_weighting' must be true or false"),
    (dict(dpo={"loss_type": ["sigmoid", "sft"], "use_weighting": True}), "'dpo.use_weighting' weights pairs"),
    (dict(dpo={}, orpo={}), "one preference objective at most: dpo and orpo are both set"),
    (dict(dpo={"beta": float("inf")}), "'dpo.beta' must be a positive number, got Infinity"),
    (dict(dpo={"loss_type": ["ipo", "sft"], "loss_weights": [1, float("nan")]}), "'dpo.loss_weights' must be a list"),
    (dict(dpo={"discopop_tau": 0.1}), "'dpo.discopop_tau' applies to the 'discopop' loss only"),
    (dict(dpo={"f_alpha_divergence_coef": 0.3}), "applies to f_divergence_type 'alpha_divergence' only"),
    (dict(dpo={"loss_type": "sft", "f_divergence_type": "forward_kl"}), "does nothing to the 'sft' loss alone"),
    (dict(cpo={"loss_type": "alphapo", "cpo_alpha": 1.0}), "'cpo.cpo_alpha' must be 0 under 'alphapo'"),
    (dict(cpo={"loss_type": "sigmoid", "simpo_gamma": 1.0}), "'cpo.simpo_gamma' applies to the 'simpo' loss only"),
    (dict(cpo={"loss_type": "kto_pair"}), "'cpo.loss_type' must be one of sigmoid, hinge, ipo, simpo"),
    (dict(cpo={"loss_type": "hinge", "label_smoothing": 0.1}), "applies to the 'sigmoid' and 'simpo' losses only"),
    (dict(cpo={"cpo_alpha": -1}), "'cpo.cpo_alpha' must be a number >= 0"),
    (dict(orpo={"beta": 0}), "'orpo.beta' must be a positive number"),
    (dict(orpo={"lambda": 0.1}), "'orpo.lambda' is unknown"),
    (dict(orpo={}, z_loss=1e-4), "'z_loss': applies to the language-model loss only; with 'orpo' set it to 0"),
    (dict(dpo=0.1), "'dpo' must be dict or null"),
    (dict(dpo={}, fcm_max_ratio=0.2), "'fcm_max_ratio': applies to the language-model loss only"),
    (dict(dpo={}, z_loss=1e-4), "'z_loss': applies to the language-model loss only"),
    (dict(kto={"beta": 0}), "'kto.beta' must be a positive number"),
    (dict(kto={"desirable_weight": -1}), "'kto.desirable_weight' must be a positive number"),
    (dict(kto={"loss_type": "bco"}), "'kto.loss_type' must be one of kto, apo_zero_unpaired"),
    (dict(kto={"kl": 0.1}), "'kto.kl' is unknown"),
    (dict(kto={}, dpo={}), "one preference objective at most: dpo and kto are both set"),
    (dict(kto={}, neftune_noise_alpha=5), "'neftune_noise_alpha': applies to the language-model loss only; with 'kto'"),
])
def test_bad_dpo_config_is_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"layers": 1, "d_model": 8, "n_heads": 1, "n_vocab": 16, "seq": 8, **overrides})


def test_alphapo_is_simpo_without_the_nll_term():
    """TRL's shorthand: loss_type "alphapo" is "simpo" with cpo_alpha 0 (AlphaPO's reward shape is `alpha`)."""
    config = config_from_dict({"layers": 1, "d_model": 8, "n_heads": 1, "n_vocab": 16, "seq": 8,
                               "cpo": {"loss_type": "alphapo", "alpha": 0.25}})
    assert preference.objective(config.train) == preference.CpoConfig(loss_type="simpo", cpo_alpha=0.0, alpha=0.25)


def test_per_replica_batch_counts_pairs():
    config = config_from_dict({"layers": 1, "d_model": 8, "n_heads": 1, "n_vocab": 16, "seq": 8, "per_replica_batch": 3,
                               "dpo": {}})
    assert config.train.rows_per_replica == 6 and preference.DpoConfig.from_dict(config.train.dpo).beta == 0.1


# ----------------------------------------------------------------------------- a run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = dict(layers=2, d_model=32, n_heads=4, n_vocab=50257, seq=32, pe_rotary_dims=4, compute_dtype="float32",
           remat="none", cores_per_replica=2, tpu_size=8, per_replica_batch=2, warmup_steps=0, anneal_steps=8,
           lr=3e-3, end_lr=3e-4, total_steps=6, ckpt_every=2, val_every=3, name="dpo", dpo={"beta": 0.5})
SNOW = [{"prompt": f"Q{i}: is snow cold?\nA:", "chosen": " Yes, it is cold.", "rejected": f" No{'!' * (i % 3)} It is hot."}
        for i in range(20)]


def device_train(config_path, *args):
    out = subprocess.run([sys.executable, "device_train.py", "--config", str(config_path), "--cpu-devices", "8",
                          "--no-tensorboard", "--log-dir", str(config_path.parent / "logs"), *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    return out.returncode, out.stdout + out.stderr


def run_config(path, data, **overrides):
    path.mkdir()
    config = {**RUN, "train_set": str(data / "pairs.index.json"), "val_set": {"held": str(data / "val.index.json")},
              "model_dir": str(path / "ckpt"), **overrides}
    (path / "config.json").write_text(json.dumps(config))
    return path / "config.json"


def logged(config_path) -> list[dict]:
    return [json.loads(line) for line in (config_path.parent / "logs" / "metrics.jsonl").read_text().splitlines()]


def snow_run_inputs(tmp_path):
    """(a tiny HF GPT-J directory, a data directory with the SNOW pairs: pairs.index.json and val.index.json)."""
    hf_dir = tmp_path / "hf"
    make_hf_gptj(hf_dir, vocab_size=50257, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64,
                 initializer_range=0.2)
    data = tmp_path / "data"
    build(write_jsonl(tmp_path / "pairs.jsonl", SNOW[:16]), data, seq=32)
    build(write_jsonl(tmp_path / "val.jsonl", SNOW[16:]), data, seq=32, name="val")
    return hf_dir, data


def test_a_dpo_run_learns_the_preference_validates_and_resumes_exactly(tmp_path):
    """device_train.py fine-tunes an HF model with DPO: the first step's loss is log 2 (the policy
    is its reference), the rewards separate, validation reports the pair metrics, and a run stopped
    at step 2 and resumed (its reference read back from the HF directory the checkpoint names)
    ends with exactly the uninterrupted run's weights, optimizer state and losses."""
    hf_dir, data = snow_run_inputs(tmp_path)
    straight, stopped = run_config(tmp_path / "straight", data), run_config(tmp_path / "stopped", data)
    code, out = device_train(straight, "--hf", str(hf_dir))
    assert code == 0, out[-3000:]
    code, out = device_train(stopped, "--hf", str(hf_dir), "--stop-after", "2")
    assert code == 0, out[-3000:]
    code, out = device_train(stopped, "--hf", str(hf_dir))
    assert code == 0 and "step 2 of 6" in out, out[-3000:]

    rows = {r["step"]: r for r in logged(straight)}
    assert abs(rows[1]["train/loss"] - np.log(2)) < 1e-4
    assert rows[6]["train/loss"] < 0.5 and rows[6]["train/rewards/accuracies"] == 1.0
    assert rows[6]["train/rewards/margins"] == pytest.approx(rows[6]["train/rewards/chosen"] - rows[6]["train/rewards/rejected"],
                                                             abs=1e-5)
    assert rows[6]["val/loss_held"] < np.log(2) and rows[6]["val/rewards/accuracies_held"] == 1.0
    resumed = {r["step"]: r["train/loss"] for r in logged(stopped)}
    assert resumed == {s: r["train/loss"] for s, r in rows.items()}

    manager = CheckpointManager(str(tmp_path / "stopped" / "ckpt"), read_only=True)
    extras = manager.extras(6)
    assert extras[preference.REFERENCE_KEY] == {"hf": str(hf_dir.resolve())} and preference.REFERENCE_FINGERPRINT_KEY in extras
    config = config_from_dict(json.loads(straight.read_text()))
    tr = Trainer(config, mesh(1, 1))
    a, b = (CheckpointManager(str(p / "ckpt"), read_only=True).restore(
        6, abstract_state=tr.abstract_state, target_shardings=tr.state_shardings)[0] for p in (tmp_path / "straight", tmp_path / "stopped"))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    # a plain-text dataset in a DPO run, and pairs in a run without 'dpo', are one clear line each
    build(write_jsonl(tmp_path / "docs.jsonl", [{"text": "snow " * 80}]), data, seq=32, name="docs")
    wrong = run_config(tmp_path / "wrong", data, train_set=str(data / "docs.index.json"))
    code, out = device_train(wrong)
    assert code == 2 and "config key 'dpo': " + str(data / "docs.index.json") + " holds no preference pairs" in out, out
    plain = run_config(tmp_path / "plain", data, dpo=None)
    code, out = device_train(plain)
    assert code == 2 and "holds preference pairs: set the config key 'dpo'" in out, out


def test_an_orpo_run_needs_no_reference(tmp_path):
    """device_train.py with ORPO: no reference is made or recorded (the checkpoint names none), the
    odds-ratio metrics and the chosen NLL are logged for training and validation, and the pairs
    separate."""
    hf_dir, data = snow_run_inputs(tmp_path)
    config = run_config(tmp_path / "orpo", data, dpo=None, orpo={"beta": 1.0}, ckpt_every=6)
    code, out = device_train(config, "--hf", str(hf_dir))
    assert code == 0, out[-3000:]
    rows = {r["step"]: r for r in logged(config)}
    assert rows[6]["train/log_odds_chosen"] > rows[1]["train/log_odds_chosen"]
    assert rows[6]["train/rewards/accuracies"] == 1.0 and rows[6]["val/rewards/accuracies_held"] == 1.0
    assert rows[6]["train/nll_loss"] < rows[1]["train/nll_loss"] and 0 < rows[6]["val/nll_loss_held"]
    assert rows[6]["val/log_odds_ratio_held"] < 0  # a log-sigmoid
    extras = CheckpointManager(str(tmp_path / "orpo" / "ckpt"), read_only=True).extras(6)
    assert preference.REFERENCE_KEY not in extras and extras["objective"] == "orpo"
    raw = json.loads(config.read_text())  # the same model_dir, resumed with another objective: refused
    config.write_text(json.dumps({**raw, "orpo": None, "dpo": {"beta": 0.1}, "total_steps": 8}))
    code, out = device_train(config, "--hf", str(hf_dir))
    assert code != 0 and "its step 6 trained with objective 'orpo', this config with 'dpo'" in out, out[-3000:]


@pytest.mark.parametrize("how", ["full", "lora"])
def test_a_reward_model_run_starts_from_a_language_model_learns_and_exports_to_transformers(how, tmp_path):
    """device_train.py trains a reward model from a causal LM's HF checkpoint (`--hf`, num_labels 1:
    the head is dropped and a score head drawn, with a warning): the chosen completions' rewards
    rise above the rejected ones' in training and validation, and to_hf_weights.py writes a
    GPTJForSequenceClassification that transformers loads and that ranks the held-out pairs as the
    run's validation did. With LoRA (the head trained whole beside the adapters) the same, and its
    `--peft` export is a SEQ_CLS adapter that PEFT loads on the base with the same numbers."""
    import torch
    import transformers
    hf_dir, data = snow_run_inputs(tmp_path)
    extra = {} if how == "full" else {"lora": {"rank": 4, "alpha": 8}}
    config = run_config(tmp_path / "rm", data, dpo=None, reward={}, num_labels=1, ckpt_every=6, lr=1e-2, **extra)
    code, out = device_train(config, "--hf", str(hf_dir))
    assert code == 0, out[-3000:]
    assert "a language model's checkpoint read as a classifier of 1 label(s)" in out
    rows = {r["step"]: r for r in logged(config)}
    assert rows[6]["train/loss"] < rows[1]["train/loss"] and rows[6]["train/accuracy"] == 1.0
    assert rows[6]["train/margin"] > rows[1]["train/margin"] and rows[6]["val/accuracy_held"] == 1.0
    extras = CheckpointManager(str(tmp_path / "rm" / "ckpt"), read_only=True).extras(6)
    assert extras["objective"] == "reward" and preference.REFERENCE_KEY not in extras

    export = subprocess.run([sys.executable, "to_hf_weights.py", "--input-ckpt", str(tmp_path / "rm" / "ckpt"),
                             "--output-path", str(tmp_path / "export"), "--dtype", "fp32", "--cpu"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stdout[-2000:] + export.stderr[-2000:]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    assert type(model).__name__ == "GPTJForSequenceClassification" and model.config.num_labels == 1
    tokenizer = load_tokenizer("gpt2")
    with torch.no_grad():  # one text at a time: its last token is the one read (EOS, as the rows end)
        reward = lambda text: model(torch.tensor([tokenizer.encode(text + "<|endoftext|>")])).logits.item()  # noqa: E731
        margins = [reward(p["prompt"] + p["chosen"]) - reward(p["prompt"] + p["rejected"]) for p in SNOW[16:]]
    assert min(margins) > 0
    assert np.mean(margins) == pytest.approx(rows[6]["val/margin_held"], rel=1e-3)
    if how == "lora":
        import peft
        export = subprocess.run([sys.executable, "to_hf_weights.py", "--input-ckpt", str(tmp_path / "rm" / "ckpt"),
                                 "--output-path", str(tmp_path / "adapter"), "--peft", "--cpu"],
                                cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert export.returncode == 0, export.stdout[-2000:] + export.stderr[-2000:]
        saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
        assert saved["task_type"] == "SEQ_CLS" and "score" in saved["modules_to_save"]
        base = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, num_labels=1)
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        with torch.no_grad():
            again = [adapted(torch.tensor([tokenizer.encode(p["prompt"] + p[side] + "<|endoftext|>")])).logits.item()
                     for p in SNOW[16:] for side in ("chosen", "rejected")]
        np.testing.assert_allclose(np.subtract(again[::2], again[1::2]), margins, rtol=1e-4, atol=1e-5)


def test_a_kto_run_learns_from_unpaired_labels_and_validates(tmp_path):
    """device_train.py fine-tunes an HF model with KTO on unpaired examples: the first step's loss is
    1/2 (the policy is its reference: every log-ratio and the KL estimate are 0), then desirable
    completions gain reward and undesirable ones lose it, in training and validation; the checkpoint
    names its reference. A KTO dataset without 'kto', and 'kto' without one, are one clear line each."""
    from mesh_transformer.train.loop import open_datasets
    hf_dir, data = snow_run_inputs(tmp_path)
    unpaired = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
                for r in SNOW for side in (("chosen", "rejected") if int(r["prompt"][1:].split(":")[0]) % 2 else
                                           ("rejected", "chosen"))]
    build(write_jsonl(tmp_path / "u.jsonl", unpaired[:32]), data, seq=32, name="unpaired")
    build(write_jsonl(tmp_path / "uv.jsonl", unpaired[32:]), data, seq=32, name="unpaired_val")
    config = run_config(tmp_path / "kto", data, dpo=None, kto={"beta": 0.5}, ckpt_every=6,
                        train_set=str(data / "unpaired.index.json"),
                        val_set={"held": str(data / "unpaired_val.index.json")})
    code, out = device_train(config, "--hf", str(hf_dir))
    assert code == 0, out[-3000:]
    rows = {r["step"]: r for r in logged(config)}
    assert abs(rows[1]["train/loss"] - 0.5) < 1e-6 and rows[1]["train/kl"] == 0.0
    assert rows[6]["train/loss"] < 0.45 and rows[6]["train/rewards/chosen"] > 0 > rows[6]["train/rewards/rejected"]
    assert rows[6]["train/rewards/margins"] == pytest.approx(rows[6]["train/rewards/chosen"] - rows[6]["train/rewards/rejected"],
                                                             abs=1e-5)
    assert rows[6]["val/loss_held"] < 0.5 and rows[6]["val/rewards/margins_held"] > 0
    assert rows[6]["val/logps/chosen_held"] > rows[6]["val/logps/rejected_held"]
    extras = CheckpointManager(str(tmp_path / "kto" / "ckpt"), read_only=True).extras(6)
    assert extras[preference.REFERENCE_KEY] == {"hf": str(hf_dir.resolve())} and extras["objective"] == "kto"

    kto, dpo = (config_from_dict({**json.loads(config.read_text()), **keys})
                for keys in ({"train_set": str(data / "pairs.index.json")},
                             {"kto": None, "dpo": {"beta": 0.1}}))
    with pytest.raises(ConfigError, match="config key 'kto': .*pairs.index.json holds no unpaired examples .*: it holds "
                                          "preference pairs, for 'dpo', 'cpo', 'orpo' or 'reward'"):
        open_datasets(kto)
    with pytest.raises(ConfigError, match="unpaired.index.json holds unpaired examples .*: set the config key 'kto' "
                                          ".* to train on them, not 'dpo'"):
        open_datasets(dpo)


@pytest.mark.parametrize("objective", [{"dpo": {"beta": 0.2}}, {"dpo": {"beta": 0.2, "loss_type": ["sigmoid", "sft"]}},
                                       {"dpo": {"beta": 0.2, "use_weighting": True}},
                                       {"cpo": {"loss_type": "simpo", "cpo_alpha": 0.5}}, {"orpo": {"beta": 0.5}}],
                         ids=["dpo", "dpo+sft", "dpo-wpo", "cpo-simpo", "orpo"])
def test_zero_accumulation_and_meshes_give_one_devices_step(objective):
    """A preference step (full fine-tuning; DPO against a random reference) on dp2 x mp2 with ZeRO and
    two microbatches of two pairs each gives the single device's one step on all four pairs: loss,
    metrics and weights. The microbatches hold different token counts, so an NLL term (DPO's "sft",
    CPO's, ORPO's) is the mean over the whole step's chosen tokens, not a mean of per-microbatch means.
    The sharded side also runs the head and log-probabilities 24 tokens at a time (`loss_chunk`; 32
    per device: the last chunk padded), the policy's, the reference's and WPO's log sum p^2 alike."""
    from helpers import tiny_config
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 250, (8, 17)).astype(np.int32)
    tokens[1::2, :9] = tokens[0::2, :9]  # each pair's prompt
    mask = np.zeros((8, 16), np.float32)
    mask[:, 8:] = 1
    mask[6:, 12:] = 0  # pairs of other lengths
    results = []
    for dp, mp, extra, shape in ((1, 1, {}, (1, 8)),
                                 (2, 2, dict(zero=True, gradient_accumulation_steps=2, loss_chunk=24), (2, 4))):
        config = tiny_config(**objective, per_replica_batch=4 // dp // (2 if extra else 1), cores_per_replica=mp,
                             **extra)
        tr = Trainer(config, mesh(dp, mp))
        state = tr.init_state(0)
        if tr.needs_reference:
            tr.base = tr.init_base(1)  # a reference other than the policy
        batch = tr.shard_batch({"tokens": tokens.reshape(*shape, 17), "mask": mask.reshape(*shape, 16)})
        grads = jax.device_get(tr.loss_and_grads(state.params, batch)[1])
        state, metrics = tr.step(state, batch)
        results.append((jax.device_get(metrics), grads))
    (m1, g1), (m2, g2) = results
    assert m1["loss"] > 0.1 and abs(m1["rewards/margins"]) > 1e-3
    for name in tr.metric_names:
        assert abs(float(m1[name]) - float(m2[name])) < 1e-5 * max(1.0, abs(float(m1[name]))), name
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(g1))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-5 * scale)


@pytest.mark.parametrize("how", ["full", "lora-int8"])
def test_a_stopped_run_resumes_with_its_reference(how, tmp_path):
    """A DPO run stopped after 2 steps and resumed in a new TrainRun reads its reference back (the
    same weights: its fingerprint equal) and logs the uninterrupted run's losses. Full fine-tuning
    from a seeded random init (the reference: a copy of those weights, re-made from the seed); LoRA
    with an int8 base from `--tune-model-path` of our checkpoint (the base, re-read from it and
    quantized again), on dp4 x mp2."""
    from helpers import tiny_config, word_tokenizer
    from mesh_transformer.train.loop import RunOptions, TrainRun
    rng = np.random.default_rng(0)
    words = lambda n: " ".join(f"w{i}" for i in rng.integers(1, 200, n))  # noqa: E731
    records = [{"prompt": words(6), "chosen": " " + words(4), "rejected": " " + words(5)} for _ in range(12)]
    build(write_jsonl(tmp_path / "p.jsonl", records), tmp_path / "data", tokenizer=word_tokenizer(tmp_path / "tok"), seq=16)
    extra, start = {}, {}
    if how != "full":
        extra = {"lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"], "quantize_base": "int8"}}
        make_hf_gptj(tmp_path / "hf", vocab_size=250, n_embd=64, n_layer=3, n_head=8, rotary_dim=4, n_inner=128)
        hf.hf_to_checkpoint(str(tmp_path / "hf"), str(tmp_path / "base"))
        start = {"tune_model_path": str(tmp_path / "base")}
    losses = {}
    for name, stops in (("straight", [None]), ("stopped", [2, None])):
        config = tiny_config(dpo={"beta": 0.5}, train_set=str(tmp_path / "data" / "pairs.index.json"), total_steps=4,
                             ckpt_every=2, model_dir=str(tmp_path / name), cores_per_replica=2, per_replica_batch=1,
                             **extra)
        for stop in stops:
            TrainRun(config, RunOptions(log_dir=str(tmp_path / f"{name}-logs"), tensorboard=False, stop_after=stop,
                                        **start)).train()
        rows = (json.loads(line) for line in (tmp_path / f"{name}-logs" / "metrics.jsonl").read_text().splitlines())
        losses[name] = {r["step"]: r["train/loss"] for r in rows}
    assert losses["stopped"] == losses["straight"] and len(losses["straight"]) == 4
    assert abs(losses["straight"][1] - np.log(2)) < 1e-4


@pytest.mark.parametrize("case", ONE_CASE_PER_FAMILY)
def test_every_family_scores_pairs_with_transformers_log_probs(case, tmp_path):
    """For every family (full fine-tuning, dp=2): each completion's log-probability under the policy
    and the reference is transformers' (two HF models of the family), and the rewards and loss follow
    from them as DPO defines them."""
    policy = make_hf_model(tmp_path / "policy", case, seed=0)
    reference = make_hf_model(tmp_path / "reference", case, seed=1)
    config, params = hf.load_hf(str(tmp_path / "policy"))
    config = dataclasses.replace(config, compute_dtype="float32", remat="none")
    tr = Trainer(Config(config, TrainConfig(per_replica_batch=2, dpo={"beta": 0.3})), mesh(2, 1))
    tr.set_base(hf.load_hf(str(tmp_path / "reference"))[1])
    tokens = np.random.RandomState(3).randint(0, config.n_vocab, (8, 13)).astype(np.int32)
    tokens[1::2, :7] = tokens[0::2, :7]  # each pair's prompt
    mask = np.zeros((8, 12), np.float32)
    mask[:, 6:] = 1
    mask[4:6, 10:] = 0  # a pair with shorter completions
    sums, count = tr.eval_values(jax.device_put(params, tr.state_shardings.params),
                                 tr.shard_batch({"tokens": tokens[None], "mask": mask[None]}))
    ours = {k: float(v) / float(count) for k, v in sums.items()}

    def log_probs(model):
        t = torch.tensor(tokens, dtype=torch.long)
        with torch.no_grad():
            per_token = torch.log_softmax(model(t[:, :-1]).logits.double(), -1).gather(-1, t[:, 1:, None])[..., 0]
        return (per_token * torch.tensor(mask, dtype=torch.float64)).sum(-1)
    pol, ref = log_probs(policy), log_probs(reference)
    rewards = 0.3 * (pol - ref)
    margin = rewards[0::2] - rewards[1::2]
    expected = {"logps/chosen": pol[0::2].mean(), "logps/rejected": pol[1::2].mean(),
                "rewards/chosen": rewards[0::2].mean(), "rewards/rejected": rewards[1::2].mean(),
                "rewards/margins": margin.mean(), "loss": -torch.nn.functional.logsigmoid(margin).mean()}
    assert float(count) == 4 and abs(float(margin.mean())) > 1e-3
    for name, value in expected.items():
        assert abs(ours[name] - float(value)) < 1e-4 * max(1.0, abs(float(value))), (name, ours[name], float(value))
    assert ours["rewards/accuracies"] == float((margin > 0).double().mean())
