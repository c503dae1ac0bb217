"""Every model family against its reference implementation, HF transformers (torch, fp32).

Random tiny models (tests/helpers.py FAMILY_CASES) at initializer_range 0.2, so attention and
activations are far from their near-linear regime; the measured float32 error of our logits is
1-4e-6 on logits of magnitude ~4, hence TOL. Each case: logits on one device and on dp2 x mp4,
export -> `from_pretrained` bit-identical, greedy generation token for token (dp1 x mp2), the compiled
forward's all-reduce count (one per layer with a parallel residual, two with a sequential one).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mesh_transformer import kernels, models, parallel
from mesh_transformer.config import ConfigError, config_from_dict
from mesh_transformer.generate import Generator, SamplingOptions
from mesh_transformer.evaluate.scoring import Scorer
from mesh_transformer.io import hf
from mesh_transformer.train.step import Trainer
from tests.helpers import (FAMILY_CASES, ONE_CASE_PER_FAMILY, PARITY_TOL, config_for, hf_classifier, hf_greedy,
                           hf_logits, layer_loop_bodies, make_hf_model, max_abs_diff, mesh, parity_error, random_tokens,
                           rounded_like_int8)

TOL = PARITY_TOL
FAMILY_OF = {"gptj": "gptj", "gpt_neox": "gpt_neox", "gpt_neox_sequential": "gpt_neox", "qwen2": "llama",
             "qwen3_tied": "llama", "mistral_window": "llama", "granite_tied_bias": "llama", "olmo2_gqa": "olmo2", "olmo3_window_yarn": "olmo2", "phi3_window_partial": "phi3",
             "phi_gqa_yarn": "phi", "starcoder2_window": "starcoder2",
             "llama_gqa2_llama3_rope": "llama", "llama_mqa_tied_bias_linear_rope": "llama", "gpt2": "gpt2",
             "opt_projected": "opt", "opt_post_norm": "opt", "gemma_mqa": "gemma",
             "gemma2_softcap_window": "gemma", "gemma3_local_rope": "gemma", "mixtral_window": "mixtral",
             "qwen3_moe_tied": "mixtral", "qwen2_moe_shared": "mixtral", "gpt_oss_window_yarn": "gpt_oss"}


@pytest.fixture(scope="module", params=sorted(FAMILY_CASES))
def case(request, tmp_path_factory):
    """(name, HF directory, torch model, our config, our float32 params) of one family case."""
    path = tmp_path_factory.mktemp(request.param)
    torch_model = make_hf_model(path, request.param)
    config, params = hf.load_hf(path, compute_dtype="float32", remat="none")
    return request.param, path, torch_model, config, params


def test_neftune_noise_goes_where_hfs_hook_adds_it(case, monkeypatch):
    """NEFTune's noise is added to what HF's hook sees, `get_input_embeddings()`'s output: the raw rows
    (GPT-J, GPT-2 and OPT before positions or projections, Granite before its multiplier), Gemma's
    scaled ones (its embedding module scales)."""
    import torch
    from mesh_transformer.models import layers
    _, _, torch_model, config, params = case
    seen, real = [], layers.neftune
    monkeypatch.setattr(layers, "neftune", lambda x, alpha, key: seen.append(x) or real(x, alpha, key))
    tokens = random_tokens((2, 7), config.n_vocab, seed=6)
    models.build(config).apply(params, tokens, rng=jax.random.key(0), embed_noise=5.0)
    with torch.no_grad():
        expected = torch_model.get_input_embeddings()(torch.tensor(tokens, dtype=torch.long)).numpy()
    [x] = seen
    np.testing.assert_allclose(np.asarray(x), expected, rtol=1e-6, atol=1e-6)


def test_import_picks_the_family(case):
    name, _, _, config, _ = case
    assert config.family == FAMILY_OF[name]


def test_logits_match_hf(case):
    _, _, torch_model, config, params = case
    assert parity_error(config, params, torch_model) < TOL
    ours = np.asarray(jax.jit(models.build(config).apply)(params, random_tokens((1, 5), config.n_vocab))[0])
    assert np.all(np.isneginf(ours[..., config.n_vocab:]))  # padded vocabulary is never chosen


def test_sharded_logits_match_hf(case):
    """dp2 x mp4: vocabularies not divisible by 4, kv heads split (2, 4) or replicated (1)."""
    _, _, torch_model, config, params = case
    trainer = Trainer(config_for(config, cores_per_replica=4), mesh(2, 4))
    state = trainer.state_from_params(hf.pad_vocab(params, config, config.padded_vocab(4)))
    tokens = random_tokens((4, 11), config.n_vocab, seed=2)
    np.testing.assert_allclose(np.asarray(trainer.logits(state.params, tokens)), hf_logits(torch_model, tokens),
                               atol=TOL, rtol=0)


def test_export_loads_in_transformers_with_identical_logits(case, tmp_path):
    from transformers import AutoModelForCausalLM
    _, path, torch_model, config, params = case
    hf.save_hf(params, config, tmp_path / "out", max_shard_bytes=30_000)  # several shards + an index
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded).__name__ == type(torch_model).__name__ or config.family == "llama"
    tokens = random_tokens((2, 9), config.n_vocab, seed=3)
    # against the original checkpoint as transformers loads it (a loaded Qwen2-MoE computes ~1e-6 apart
    # from the model it was saved from)
    original = AutoModelForCausalLM.from_pretrained(path).eval()
    np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(original, tokens))


def test_greedy_generation_matches_hf_in_the_fused_decode_layout(case):
    """Greedy generation (prefill, then the KV cache's decode steps) on dp1 x mp2 gives transformers'
    tokens, in the decode layout: q/k/v stored as one `qkv_proj` (with its `qkv_bias`), SwiGLU's
    gate and up as one `gate_fc_in`, each shard holding its part of each (kv heads replicated over
    mp, as the MQA case's one head is, stay apart). The layout apart is the one serving with LoRA
    adapters decodes with, tests/test_serve_lora.py; one device's, tests/test_generate.py."""
    from mesh_transformer.models.layers import FUSED
    name, _, torch_model, config, params = case
    fused, apart = (Generator(config, params, mesh(1, 2), fuse=fuse) for fuse in (True, False))
    leaves = {n for module in apart.params.values() for n in module}
    expected = {group for group, parts in FUSED.items() if set(parts) <= leaves
                and (group[0] != "q" or config.kv_split(2))}
    stored = {n for module in fused.params.values() for n in module}
    assert stored == (leaves - {p for group in expected for p in FUSED[group]}) | expected, name
    assert ("qkv_proj" in stored) == config.kv_split(2) and ("gate_fc_in" in stored) == ("gate" in leaves)
    assert parallel.bytes_of(fused.params) == parallel.bytes_of(apart.params)
    prompts = [random_tokens((1, n), config.n_vocab, seed=n)[0].tolist() for n in (3, 7)]
    outs = fused.generate(prompts, SamplingOptions(max_new_tokens=8, temperature=0))
    assert [o.tokens for o in outs] == [hf_greedy(torch_model, p, 8) for p in prompts], name


@pytest.mark.parametrize("case", ONE_CASE_PER_FAMILY, indirect=True)
def test_embeddings_pool_the_hidden_states_transformers_base_model_returns(case, tmp_path):
    """A base model's checkpoint (transformers' `base_model` saved: GPTJModel, MistralModel ..., what
    sentence-transformers saves and embedding models ship) loads with a head of zeros, and its
    embeddings (`Scorer.embed`, dp1 x mp2, right-padded rows of 3, 5, 7 and 12 tokens in one pass)
    are the mean of transformers' `last_hidden_state` over each prompt's tokens: the states after
    the final norm (and OPT's `project_out`), unnormalised."""
    import torch
    from mesh_transformer.evaluate.scoring import Scorer
    name, _, torch_model, config, _ = case
    torch_model.base_model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"a base model's checkpoint \(\w+Model\) has no language-model head"):
        base_config, params = hf.load_hf(tmp_path, compute_dtype="float32", remat="none")
    assert base_config == config, name
    heads = [x for module in params.values() for leaf, x in module.items() if leaf.startswith("lm_head")]
    assert len(heads) == (0 if config.stem().tied else 1 + config.stem().head_bias) and not any(np.any(h) for h in heads)
    scorer = Scorer.for_generator(Generator(config, params, mesh(1, 2)))
    prompts = [random_tokens((1, n), config.n_vocab, seed=n)[0].tolist() for n in (3, 5, 7, 12)]
    got = scorer.embed(prompts, pooling="mean", normalize=False)
    assert got.shape == (4, scorer.hidden_size) and scorer.shapes == {(4, 16, 0, 16)}
    with torch.no_grad():
        want = [torch_model.base_model(torch.tensor([p])).last_hidden_state[0].mean(0).numpy() for p in prompts]
    np.testing.assert_allclose(got, np.stack(want), atol=TOL, rtol=0, err_msg=name)


@pytest.mark.parametrize("case", ONE_CASE_PER_FAMILY, indirect=True)
def test_a_classifier_on_labelled_texts_has_transformers_loss(case, tmp_path):
    """Every family as a classifier trained on labelled texts (config key "classify", on mp 2): the
    loss and accuracy of texts of 1 to 14 tokens, read at each one's last token, are transformers'
    ForSequenceClassification's given `labels` (its cross-entropy; tests/test_classify.py holds
    the gradients of three families to torch's), and as a multi-label classifier its binary
    cross-entropy and the accuracy of its yes/no decisions."""
    import torch
    from mesh_transformer.config import Config, TrainConfig
    name, _, torch_model, _, _ = case
    theirs = hf_classifier(torch_model, 3, tmp_path / "hf")
    config, params = hf.load_hf(tmp_path / "hf", mp=2, compute_dtype="float32", remat="none")
    rng = np.random.default_rng(4)
    tokens, mask = np.zeros((4, config.seq + 1), np.int32), np.zeros((4, config.seq), np.float32)
    for i, n in enumerate([3, 9, 1, 14]):  # ids from 1: transformers reads the last token that is not its pad (0)
        tokens[i, :n], mask[i, :n] = rng.integers(1, torch_model.config.vocab_size, n), 1
    labels = np.array([0, 2, 1, 2], np.float32)
    with torch.no_grad():
        out = theirs(input_ids=torch.tensor(tokens[:, :16], dtype=torch.long), attention_mask=torch.tensor(mask[:, :16]),
                     labels=torch.tensor(labels, dtype=torch.long))
    tr = Trainer(Config(config, TrainConfig(per_replica_batch=4, cores_per_replica=2, classify={})), mesh(1, 2))
    batch = tr.shard_batch({"tokens": tokens[None], "mask": mask[None], "labels": labels[None, :, None]})
    ours = tr.means(*tr.eval_values(jax.device_put(params, tr.state_shardings.params), batch))
    assert float(ours["loss"]) == pytest.approx(out.loss.item(), rel=1e-5, abs=1e-6), name
    assert float(ours["accuracy"]) == pytest.approx((out.logits.argmax(-1).numpy() == labels).mean()), name
    tags = np.array([[1, 0, 1], [0, 0, 0], [0, 1, 1], [1, 1, 1]], np.float32)  # multi-label: any of the classes
    theirs.config.problem_type = "multi_label_classification"
    with torch.no_grad():
        multi = theirs(input_ids=torch.tensor(tokens[:, :16], dtype=torch.long),
                       attention_mask=torch.tensor(mask[:, :16]), labels=torch.tensor(tags))
    config = dataclasses.replace(config, problem_type="multi_label_classification")
    tr = Trainer(Config(config, TrainConfig(per_replica_batch=4, cores_per_replica=2, classify={})), mesh(1, 2))
    batch = tr.shard_batch({"tokens": tokens[None], "mask": mask[None], "labels": tags[None]})
    ours = tr.means(*tr.eval_values(jax.device_put(params, tr.state_shardings.params), batch))
    assert float(ours["loss"]) == pytest.approx(multi.loss.item(), rel=1e-5, abs=1e-6), name
    assert float(ours["accuracy"]) == pytest.approx(((multi.logits.numpy() > 0) == (tags > 0.5)).mean()), name


@pytest.mark.parametrize("case", ONE_CASE_PER_FAMILY, indirect=True)
def test_a_classifier_scores_as_transformers_sequence_classifier_and_exports_as_one(case, tmp_path):
    """Every family's ForSequenceClassification checkpoint loads as a classifier (`num_labels`, HF's
    `score` in place of the language-model head), and its scores at each right-padded row's last
    token are transformers' (which reads the last token that is not padding); exported, transformers
    loads it back as the same class with the same numbers."""
    import torch
    import transformers
    from mesh_transformer.models.core import last_token_scores
    name, _, torch_model, lm_config, _ = case
    theirs = hf_classifier(torch_model, 3, tmp_path / "hf")
    config, params = hf.load_hf(tmp_path / "hf", compute_dtype="float32", remat="none")
    assert config == dataclasses.replace(lm_config, num_labels=3) and config.classifier, name
    assert set(params) == set(models.build(config).abstract_params) and f"{config.family}/score" in params
    assert not any(leaf.startswith("lm_head") for module in params.values() for leaf in module)
    lengths = np.array([4, 9, 13])
    tokens = random_tokens((3, 13), config.n_vocab, seed=2) % (config.n_vocab - 1) + 1  # (0 is padding)
    tokens[np.arange(13)[None, :] >= lengths[:, None]] = 0
    with torch.no_grad():
        want = theirs(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(tokens != 0)).logits.numpy()
    scores = jax.jit(lambda p, t: models.build(config).apply(p, t)[0])(params, tokens)
    got = np.asarray(last_token_scores(scores, jax.numpy.asarray(lengths - 1)))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0, err_msg=name)
    hf.save_hf(params, config, tmp_path / "out")
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(theirs) and back.config.id2label == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}
    back.config.pad_token_id = 0
    with torch.no_grad():
        again = back(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(again, want, atol=TOL, rtol=0, err_msg=name)
    gen = Generator(config, params, mesh(1, 1))  # the serving layout (inputs-last, fused), the server's passes
    served = Scorer.for_generator(gen).classify([list(row[:n]) for row, n in zip(tokens, lengths)])
    np.testing.assert_allclose(served, want, atol=TOL, rtol=0, err_msg=name)
    with pytest.raises(ConfigError, match=r"num_labels 3: a score head, no language-model head\) does not generate"):
        gen.generate([[1, 2]], SamplingOptions(max_new_tokens=2))


INT8_CASES = [("llama_mqa_tied_bias_linear_rope" if c == "llama_gqa2_llama3_rope" else c) for c in ONE_CASE_PER_FAMILY]


@pytest.mark.parametrize("case", INT8_CASES, indirect=True)
def test_int8_weights_generate_as_transformers_does_on_the_same_rounded_weights(case):
    """Generator(quantize="int8") on dp1 x mp2, a case of each family (one kv head replicated over mp in LLaMA's, MQA):
    greedy tokens equal transformers' `generate` on the weights rounded the same way, and every
    matmul weight is held as one byte per value (plus a float32 scale per output)."""
    name, _, torch_model, config, params = case
    gen = Generator(config, params, mesh(1, 2), quantize="int8")
    # 3 prompts padded to 40 positions: a prefill of more rows than the int8 kernel takes (XLA's
    # product of the converted weight), then decode steps of 3 rows (the kernel)
    prompts = [random_tokens((1, n), config.n_vocab, seed=n)[0].tolist() for n in (3, 7, 40)]
    rounded = rounded_like_int8(torch_model)
    for prompt, out in zip(prompts, gen.generate(prompts, SamplingOptions(max_new_tokens=8, temperature=0))):
        assert out.tokens == hf_greedy(rounded, prompt, 8), name
    scales = [(m, n[:-len(parallel.SCALE)]) for m, leaves in gen.params.items() for n in leaves
              if n.endswith(parallel.SCALE)]
    assert scales and all(gen.params[m][n].dtype == np.int8 for m, n in scales)
    experts = [(m, n) for m, leaves in gen.params.items() for n in leaves
               if n.startswith("experts_") and not n.endswith((parallel.SCALE, "_bias"))]
    assert set(experts) <= set(scales) and bool(experts) == hasattr(config, "n_experts")  # a mixture's too


def test_int8_weights_score_as_transformers_does_on_the_same_rounded_weights(tmp_path):
    """Evaluation (`Scorer.for_generator`, what eval_harness.py --quantize int8 runs) reads the
    quantized weights too: log p of every next token equals transformers' log-softmax on the
    rounded weights (MQA LLaMA with a tied head, kv head replicated over mp=2)."""
    import torch
    from mesh_transformer.evaluate.scoring import Scorer
    torch_model = make_hf_model(tmp_path, "llama_mqa_tied_bias_linear_rope")
    config, params = hf.load_hf(tmp_path, compute_dtype="float32")
    prompt = random_tokens((1, 20), config.n_vocab, seed=3)[0].tolist()
    scores = Scorer.for_generator(Generator(config, params, mesh(1, 2), quantize="int8")).score([prompt])[0]
    logits = torch.tensor(hf_logits(rounded_like_int8(torch_model), np.array([prompt]))[0], dtype=torch.float64)
    expected = torch.log_softmax(logits, -1).numpy()[np.arange(19), prompt[1:]]
    np.testing.assert_allclose(np.asarray(scores.logprobs)[-19:], expected, atol=1e-5)


def test_fused_attention_matches_hf(case):
    """attention_impl="cudnn" (jax.nn.dot_product_attention: cuDNN flash attention on a GPU, XLA's own
    implementation on this CPU) is held to the same HF parity as the einsum path."""
    import dataclasses
    _, _, torch_model, config, params = case
    assert parity_error(dataclasses.replace(config, attention_impl="cudnn"), params, torch_model) < TOL


@pytest.mark.parametrize("family, extra", [("gptj", {}), ("llama", {}), ("llama", {"sliding_window": 3})],
                         ids=["gptj", "llama", "llama_window"])
def test_fused_attention_equals_einsum_path_with_packing_and_fcm(family, extra):
    """The fused path under dp2 x mp4 (llama: 2 kv heads replicated over 4 shards) with packed
    segments and forgetful causal masking (a mask it must take as given, not is_causal; with a
    sliding window, cut to it) gives the einsum path's loss and gradients."""
    from tests.helpers import max_abs_diff
    tokens = random_tokens((ACCUM, BATCH, 17), 250, seed=4)
    segments = np.repeat(np.arange(3), [5, 7, 5])[None, None].repeat(ACCUM, 0).repeat(BATCH, 1)
    results = []
    for impl in ("xla", "cudnn"):
        trainer = _trainer(family, 2, 4, False, attention_impl=impl, fcm_max_ratio=0.5, **extra)
        state = trainer.state_from_params(jax.device_get(_trainer(family, 1, 1, False, **extra).init_state(0).params))
        loss, grads = trainer.loss_and_grads(state.params, trainer.shard_batch({"tokens": tokens, "segments": segments}))
        results.append((float(loss), jax.device_get(grads)))
    (xla_loss, xla_grads), (fused_loss, fused_grads) = results
    assert abs(xla_loss - fused_loss) < 1e-5
    assert max_abs_diff(xla_grads, fused_grads) < 2e-6


@pytest.mark.parametrize("family", ["gptj", "llama_alibi_window"])
def test_causal_blocks_give_one_blocks_loss_and_grads_with_packing_and_fcm(family, monkeypatch):
    """Attention in causal blocks of 5 query positions (`layers.CAUSAL_BLOCK`) over packed segments
    with forgetful causal masking (each block's mask cut from the whole one) gives the loss and
    gradients of one block (dp2 x mp4, ZeRO)."""
    from tests.helpers import max_abs_diff
    tokens = random_tokens((ACCUM, BATCH, 17), 250, seed=4)
    segments = np.repeat(np.arange(3), [5, 7, 5])[None, None].repeat(ACCUM, 0).repeat(BATCH, 1)
    params = jax.device_get(_trainer(family, 1, 1, False).init_state(0).params)
    results = []
    for block in (models.layers.CAUSAL_BLOCK, 5):
        monkeypatch.setattr(models.layers, "CAUSAL_BLOCK", block)
        trainer = _trainer(family, 2, 4, True, fcm_max_ratio=0.5)
        state = trainer.state_from_params(params)
        loss, grads = trainer.loss_and_grads(state.params, trainer.shard_batch({"tokens": tokens, "segments": segments}))
        results.append((float(loss), jax.device_get(grads)))
    (whole_loss, whole_grads), (blocked_loss, blocked_grads) = results
    assert abs(whole_loss - blocked_loss) < 1e-5
    assert max_abs_diff(whole_grads, blocked_grads) < 2e-6


def test_fused_attention_picks_each_scanned_layers_window():
    """Plain causal rows through Gemma's scanned sliding (6-token window) and full layers on dp2 x mp4:
    the fused path passes each layer's window to dot_product_attention by the layer's kind, chosen
    at run time, and gives the einsum path's loss and gradients (attn_softcap off: soft-capped
    scores take the einsum path)."""
    from tests.helpers import max_abs_diff
    tokens = random_tokens((ACCUM, BATCH, 17), 250, seed=4)
    params = jax.device_get(_trainer("gemma", 1, 1, False, attn_softcap=None).init_state(0).params)
    results = []
    for impl in ("xla", "cudnn"):
        trainer = _trainer("gemma", 2, 4, False, attention_impl=impl, attn_softcap=None)
        state = trainer.state_from_params(params)
        loss, grads = trainer.loss_and_grads(state.params, trainer.shard_batch({"tokens": tokens}))
        results.append((float(loss), jax.device_get(grads)))
    (xla_loss, xla_grads), (fused_loss, fused_grads) = results
    assert abs(xla_loss - fused_loss) < 1e-5
    assert max_abs_diff(xla_grads, fused_grads) < 2e-6


def test_attention_implementation_is_checked():
    with pytest.raises(ConfigError, match="attention_impl"):
        config_from_dict({**TRAIN_BASE, "attention_impl": "flash"})


def _all_reduces_per_layer(trainer) -> tuple[int, int]:
    tokens = jax.ShapeDtypeStruct((2, 16), np.int32, sharding=NamedSharding(trainer.mesh, P("dp", None)))
    hlo = trainer.logits.lower(trainer.abstract_state.params, tokens).compile().as_text()
    [body] = layer_loop_bodies(hlo, trainer.config.model.layers)
    types = [m.group(1) for m in re.finditer(r"= (\S+|\(.*?\)) all-reduce(?:-start)?\(", body)]
    statistics = [t for t in types if all(shape.endswith(",1,1") for shape in re.findall(r"\[([\d,]*)\]", t))]
    return len(types) - len(statistics), len(statistics)  # (activation-sized, per-position statistics)


def test_all_reduces_per_layer(case):
    """Parallel residual (GPT-J, Phi, NeoX's default): attention and MLP share one; sequential: two. OLMo 2
    adds its q/k norms' sums of squares ([B, T, 1, 1] each), which XLA sends in one all-reduce."""
    _, _, _, config, _ = case
    trainer = Trainer(config_for(config, cores_per_replica=4), mesh(1, 4))
    parallel_residual = config.family in ("gptj", "phi") or (config.family == "gpt_neox" and config.parallel_residual)
    activations, statistics = _all_reduces_per_layer(trainer)
    assert activations == (1 if parallel_residual else 2)
    assert statistics == (1 if config.family == "olmo2" else 0)


@pytest.mark.parametrize("name", ["mixtral_window", "qwen2_moe_shared", "gpt_oss_window_yarn"])
def test_expert_parallel_holds_whole_experts_and_computes_what_transformers_does(name, tmp_path):
    """`expert_parallel`: each mp shard holds n_experts / mp whole experts (4 over mp 4: one each)
    and multiplies only the token copies routed to them; dp2 x mp4 logits equal transformers', the
    layer keeps its two all-reduces (attention's; the experts' with Qwen2-MoE's shared expert),
    and decoding on mp 2 (float and int8 experts, a scale per expert split with them) gives
    transformers' greedy tokens. GPT-OSS's expert biases go with their experts (each shard adds
    its own experts' down-projection biases, which without expert parallelism the first shard adds)."""
    torch_model = make_hf_model(tmp_path, name)
    config, params = hf.load_hf(tmp_path, compute_dtype="float32", remat="none")
    config = dataclasses.replace(config, expert_parallel=True)
    trainer = Trainer(config_for(config, cores_per_replica=4), mesh(2, 4))
    moe = {n: tuple(spec) + (None,) * (4 - len(spec))
           for n, spec in trainer.param_specs[f"{config.family}/layers/moe"].items()}
    assert moe["experts_gate"] == moe["experts_out"] == (None, "mp", None, None)  # [L, E, ...]: experts over mp
    assert all(moe[n] == (None, "mp", None, None) for n in moe if n.startswith("experts_") and n.endswith("_bias"))
    assert moe["router"] == (None,) * 4  # replicated: every shard routes alike
    state = trainer.state_from_params(hf.pad_vocab(params, config, config.padded_vocab(4)))
    tokens = random_tokens((4, 11), config.n_vocab, seed=2)
    np.testing.assert_allclose(np.asarray(trainer.logits(state.params, tokens)), hf_logits(torch_model, tokens),
                               atol=TOL, rtol=0)
    assert _all_reduces_per_layer(trainer) == (2, 0)
    prompts = [random_tokens((1, n), config.n_vocab, seed=n)[0].tolist() for n in (3, 7, 40)]
    for quantize, reference in ((None, torch_model), ("int8", rounded_like_int8(torch_model))):
        gen = Generator(config, params, mesh(1, 2), quantize=quantize)
        assert gen.params[f"{config.family}/layer_0/moe"]["experts_in"].sharding.spec[0] == "mp"
        outs = gen.generate(prompts, SamplingOptions(max_new_tokens=8, temperature=0))
        assert [o.tokens for o in outs] == [hf_greedy(reference, p, 8) for p in prompts], quantize


def test_a_checkpoint_restores_with_or_without_expert_parallelism(tmp_path):
    """expert_parallel changes how the experts are split, not what the weights mean: a checkpoint
    saved with each expert's d_ff split (mp 2) restores with the experts split whole (mp 4) and
    gives the same logits; n_experts that mp does not divide is one error naming the key."""
    from mesh_transformer.io.checkpoint import CheckpointManager
    saved = _trainer("mixtral_ep", 1, 2, False, expert_parallel=False)
    state = saved.init_state(0)
    with CheckpointManager(str(tmp_path), config=saved.config, async_save=False) as ckpt:
        ckpt.save(1, state, wait=True)
    other = _trainer("mixtral_ep", 1, 4, False)
    restored, _ = CheckpointManager(str(tmp_path), read_only=True).restore(
        abstract_state=other.abstract_state, target_shardings=other.state_shardings)
    assert restored.params["mixtral/layers/moe"]["experts_gate"].sharding.spec[1] == "mp"
    tokens = random_tokens((2, 16), 250, seed=9)
    np.testing.assert_allclose(np.asarray(other.logits(restored.params, tokens)),
                               np.asarray(saved.logits(state.params, tokens)), atol=1e-5)
    with pytest.raises(ConfigError, match="n_experts"):
        _trainer("mixtral_ep", 1, 4, False, n_experts=6)


def test_attention_matmuls_have_one_row_dimension(case, monkeypatch):
    """Every matmul of a decode step is [batch..] x rows x columns: a kv head's query heads and
    positions are one row dimension (with them apart, [4 heads] x [1 position], XLA:CPU ran a GQA
    model's attention scores 17x slower). XLA's products (on CPU with the kernels built, a GQA
    model's are the fused attention kernel's or the grouped kernel's, which take them so:
    tests/test_kernels.py)."""
    monkeypatch.setattr(kernels, "grouped_applies", lambda x, w: False)
    monkeypatch.setattr(models.layers.Attention, "_fused_on_cpu", lambda *args: False)
    _, _, _, config, params = case
    gen = Generator(config, params, mesh(1, 1))
    text = gen._decode.lower(gen.params, gen.new_state(2, 32), np.int32(0), np.int32(1), 1, 32).as_text()
    dots = re.findall(r"stablehlo.dot_general .*batching_dims = \[([\d, ]*)\].*-> tensor<([\dx]+)x\w+>", text)
    assert len(dots) >= 2 * config.layers, "the pattern should see every layer's attention matmuls"
    free = [len(shape.split("x")) - len([d for d in batch.split(",") if d.strip()]) for batch, shape in dots]
    assert max(free) <= 2, [d for d, f in zip(dots, free) if f > 2]


# --------------------------------------------------------------------------------------------
# GQA layout, configs, planner counts
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv, mp, split", [(2, 4, False), (4, 4, True), (1, 8, False), (8, 2, True)])
def test_kv_heads_split_or_replicate_and_size_the_cache(kv, mp, split):
    config = config_from_dict(dict(family="llama", layers=1, d_model=64, n_heads=8, n_kv_heads=kv, n_vocab=300,
                                   seq=16, d_ff=96, compute_dtype="float32")).model
    model = models.build(config, mp)
    spec = model.param_specs(model.rules(False, mp))["llama/layers/attn"]["k_proj"]
    assert spec == P(None, None, "mp" if split else None, None)
    assert config.kv_split(mp) == split and config.cache_heads(mp) == (kv if split else mp)


def test_kv_heads_that_neither_split_nor_divide_mp_are_a_config_error():
    config = config_from_dict(dict(family="llama", layers=1, d_model=96, n_heads=12, n_kv_heads=3, n_vocab=300,
                                   seq=16, cores_per_replica=4))
    with pytest.raises(ConfigError, match="config key 'n_kv_heads': 3 kv heads neither split over nor divide"):
        Trainer(config, mesh(1, 4))


def test_unsupported_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ConfigError, match=r"model_type 't5' is not supported \(supported: gemma, gemma2, gemma3_text, gpt2"):
        hf.load_hf(tmp_path)


@pytest.mark.parametrize("shipped", ["llama3_8b", "qwen3_8b", "phi3_mini_4k", "phi2", "starcoder2_3b", "gemma3_1b", "gemma2_2b", "pythia_6.9b",
                                     "gpt2_xl", "6B_roto_256", "mixtral_8x7b", "qwen3_30b_a3b",
                                     "qwen1.5_moe_a2.7b", "gpt_oss_20b"])
def test_planner_param_count_equals_hf(shipped):
    """n_params of each shipped config equals HF's count of the same model, built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    from mesh_transformer.config import load_config
    config = load_config(f"configs/{shipped}.json").model
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(_as_hf_config(config))
    assert config.n_params() == reference.num_parameters()


def test_a_mixtures_load_balancing_loss_is_read_and_written_as_transformers_has_it():
    """transformers adds router_aux_loss_coef x the loss only with output_router_logits; so do we."""
    hf_config = {**_as_hf_config(config_from_dict(dict(TRAIN_BASE, **TRAIN_CASES["mixtral"])).model).to_dict()}
    assert hf_config["output_router_logits"] and hf_config["router_aux_loss_coef"] == 0.1
    assert hf.config_from_hf(hf_config).router_aux_loss_coef == 0.1
    assert hf.config_from_hf({**hf_config, "output_router_logits": False}).router_aux_loss_coef == 0.0


@pytest.mark.parametrize("window", [None, 64])
def test_gpt_oss_without_a_window_exports_what_transformers_runs(window):
    """transformers' GPT-OSS builds its sliding-window mask whatever layer_types say: a config with
    no window (or one no shorter than the context) still exports one, the model runs, and the
    export reads back as full attention in every layer."""
    import torch
    from transformers import GptOssForCausalLM
    config = config_from_dict(dict(TRAIN_BASE, family="gpt_oss", n_kv_heads=2, n_experts=4, experts_per_token=2,
                                   sliding_window=window)).model
    hf_config = _as_hf_config(config)
    assert config.window is None and hf_config.sliding_window == (window or config.seq)
    torch.manual_seed(0)
    logits = GptOssForCausalLM(hf_config).eval()(torch.tensor(random_tokens((1, 9), 250))).logits
    assert logits.shape == (1, 9, 250) and bool(torch.isfinite(logits).all())
    assert hf.config_from_hf(hf_config.to_dict()).window is None


def _as_hf_config(config):
    from transformers import AutoConfig
    hf_config = config.to_hf_config()
    return AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)


# --------------------------------------------------------------------------------------------
# Training: every family splits over every layout the same way, and restores onto another mesh
# --------------------------------------------------------------------------------------------

# Adam's eps 1e-4: near-zero gradients (float noise apart) would otherwise take lr-sized steps in
# arbitrary directions, and layouts that sum in another order would differ by up to lr.
TRAIN_BASE = dict(layers=2, d_model=64, n_heads=8, n_vocab=250, seq=16, d_ff=96, compute_dtype="float32",
                  remat="full", lr=1e-2, warmup_steps=0, anneal_steps=10, total_steps=10, weight_decay=0.1, eps=1e-4)
TRAIN_CASES = {
    "gptj": dict(family="gptj", pe_rotary_dims=4),
    "gpt_neox": dict(family="gpt_neox", parallel_residual=False, rotary_pct=0.5),
    "llama": dict(family="llama", n_kv_heads=2, tie_embeddings=True, qkv_bias=True, qk_norm=True),
    "gpt2": dict(family="gpt2"),
    "opt": dict(family="opt", word_embed_proj_dim=32, pre_norm=False),
    "llama_alibi_window": dict(family="llama", pe="alibi", sliding_window=6),
    "phi3": dict(family="phi3", n_kv_heads=2, rotary_pct=0.5, sliding_window=6),
    "gemma": dict(family="gemma", n_kv_heads=2, sandwich_norms=True, qk_norm=True, sliding_window=6,
                  layer_types=["sliding_attention", "full_attention"], rope_theta=1e6, rope_local_theta=1e4,
                  query_pre_attn_scalar=12, attn_softcap=5.0, logit_softcap=10.0),  # every Gemma key at once
    "mixtral": dict(family="mixtral", n_kv_heads=2, n_experts=4, experts_per_token=2, norm_topk_prob=False,
                    qk_norm=True, sliding_window=6, router_aux_loss_coef=0.1),  # routers pooled over dp
    "mixtral_ep": dict(family="mixtral", n_kv_heads=2, n_experts=8, experts_per_token=2, expert_parallel=True,
                       router_aux_loss_coef=0.1),  # 8 experts whole over mp 8 / 4 / 2
    "gpt_oss": dict(family="gpt_oss", n_kv_heads=2, n_experts=4, experts_per_token=2, sliding_window=6,
                    layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.0,
                    router_aux_loss_coef=0.1),  # sinks and expert biases from zero: their gradients, then steps
}
ACCUM, BATCH = 2, 8


def _trainer(family: str, dp: int, mp: int, zero: bool, **extra) -> Trainer:
    raw = {**TRAIN_BASE, **TRAIN_CASES[family], "per_replica_batch": BATCH // dp,
           "gradient_accumulation_steps": ACCUM, "cores_per_replica": mp, "zero": zero, **extra}
    return Trainer(config_from_dict(raw), mesh(dp, mp))


@pytest.fixture(scope="module", params=sorted(TRAIN_CASES))
def reference(request):
    trainer = _trainer(request.param, 1, 1, False)
    state = trainer.init_state(0)
    batch = {"tokens": random_tokens((ACCUM, BATCH, 17), 250)}
    loss, grads = trainer.loss_and_grads(state.params, trainer.shard_batch(batch))
    return request.param, jax.device_get(state.params), batch, float(loss), jax.device_get(grads)


@pytest.mark.parametrize("dp,mp,zero,scan,chunk,block", [(8, 1, True, True, 0, None), (1, 8, False, True, 48, None),
                                                         (2, 4, True, False, 0, None), (2, 4, True, True, 0, 5)],
                         ids=["dp8-zero", "mp8-loss-chunks", "dp2xmp4-zero-unscanned", "dp2xmp4-zero-causal-blocks"])
def test_loss_and_grads_match_single_device(reference, dp, mp, zero, scan, chunk, block, monkeypatch):
    """Every family's loss and gradients on a mesh equal one device's; with `scan_layers: false`
    (the layers unrolled, a mixture's routers and per-layer windows included) too, with the head
    and loss run 48 tokens at a time (`loss_chunk`; 128 a device: the last chunk padded), tied heads,
    GPT-J's head bias, OPT's projection out and Gemma 2's soft cap included, and with attention in
    causal blocks of 5 query positions (`layers.CAUSAL_BLOCK`: 16 tokens in blocks of 5, 5, 5 and 1,
    each over the keys up to its end; ALiBi, sliding windows and soft-capped scores included).
    dp2 x mp4 with ZeRO runs unrolled and in causal blocks; scanned over whole sequences it is
    dp8's and mp8's path, and 3 of its steps are one device's below."""
    from tests.helpers import max_abs_diff
    family, params, batch, loss, grads = reference
    blocked = []
    if block is not None:
        real = models.layers.Attention._attend_causal_blocks
        monkeypatch.setattr(models.layers, "CAUSAL_BLOCK", block)
        monkeypatch.setattr(models.layers.Attention, "_attend_causal_blocks",
                            staticmethod(lambda *args: blocked.append(args[-1]) or real(*args)))
    trainer = _trainer(family, dp, mp, zero, scan_layers=scan, loss_chunk=chunk)
    state = trainer.state_from_params(params)
    ours_loss, ours_grads = trainer.loss_and_grads(state.params, trainer.shard_batch(batch))
    assert abs(float(ours_loss) - loss) < 1e-5
    assert max_abs_diff(jax.device_get(ours_grads), grads) < 2e-6
    assert set(blocked) == ({block} if block is not None else set())


def test_steps_match_single_device_and_restore_onto_another_mesh(reference, tmp_path):
    """3 AdamW steps (lr 1e-2, weight decay 0.1: each moves weights by up to 3e-2) on dp2 x mp4 with
    ZeRO equal one device's; the checkpoint then restores onto dp1 x mp2 with the same logits."""
    from mesh_transformer.io.checkpoint import CheckpointManager
    from tests.helpers import max_abs_diff
    family, params, batch, _, _ = reference
    results = []
    for dp, mp, zero in [(1, 1, False), (2, 4, True)]:
        trainer = _trainer(family, dp, mp, zero)
        state = trainer.state_from_params(params)
        for _ in range(3):
            state, _ = trainer.step(state, trainer.shard_batch(batch))
        results.append((trainer, state))
    (_, single), (sharded_trainer, sharded) = results
    assert max_abs_diff(jax.device_get(single.params), jax.device_get(sharded.params)) < 2e-6
    with CheckpointManager(str(tmp_path), config=sharded_trainer.config, async_save=False) as ckpt:
        ckpt.save(3, sharded, wait=True)
    other = _trainer(family, 1, 2, False)
    restored, _ = CheckpointManager(str(tmp_path), read_only=True).restore(
        abstract_state=other.abstract_state, target_shardings=other.state_shardings)
    tokens = random_tokens((2, 16), 250, seed=9)
    np.testing.assert_allclose(np.asarray(other.logits(restored.params, tokens)),
                               np.asarray(sharded_trainer.logits(sharded.params, tokens)), atol=1e-5)


@pytest.mark.parametrize("name", ["gptj", "llama_gqa2_llama3_rope"])
def test_served_model_holds_its_weights_once(name, tmp_path):
    """loading.load + LoadedModel.generator(): the device holds the bf16 per-layer weights alone (not
    also the loaded stacked copy): the live buffers grow by exactly the generator's parameters."""
    from mesh_transformer import loading, parallel
    make_hf_model(tmp_path, name, vocab_size=50257)  # the default GPT-2 tokenizer's size
    gc.collect()
    before = {id(x) for x in jax.live_arrays()}
    model = loading.load(hf=str(tmp_path), mp=2, dp=1, dtype="bfloat16")
    gen = model.generator()
    gc.collect()
    grown = sum(x.nbytes for x in jax.live_arrays() if id(x) not in before)
    assert model.params is None and not any(x.is_deleted() for x in jax.tree.leaves(gen.params))
    assert grown == parallel.bytes_of(gen.params) == 2 * sum(x.size for x in jax.tree.leaves(gen.params))


@pytest.mark.parametrize("case, overrides, seq, window", [
    ("mistral_window", dict(sliding_window=64), 64, None),  # no shorter than the context: full attention
    ("mistral_window", dict(sliding_window=8), 64, 8),  # every layer slides (the family case's own window is 5)
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), 64, 8),  # layer 1 slides
    ("qwen3_tied", dict(use_sliding_window=True, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
     64, 6),
])
def test_sliding_windows_import_as_hf_computes_them(case, overrides, seq, window, tmp_path):
    """HF's sliding-window keys: a window in every layer is `sliding_window`; some layers sliding and
    some not (Qwen2's max_window_layers, Qwen3's layer_types) are `layer_types`, run per layer in the
    scanned stack. Logits equal HF's over 20 tokens, and so does the export's."""
    torch_model = make_hf_model(tmp_path, case, **overrides)
    config, params = hf.load_hf(tmp_path, compute_dtype="float32", remat="none")
    assert (config.seq, config.window) == (seq, window)
    tokens = random_tokens((2, 20), config.n_vocab, seed=5)
    ours = jax.jit(lambda p, t: models.build(config).apply(p, t)[0])(params, tokens)
    np.testing.assert_allclose(np.asarray(ours)[..., :config.n_vocab], hf_logits(torch_model, tokens), atol=TOL, rtol=0)
    if config.windowed_layers():  # per-layer windows: decoding (layers unrolled) and the export keep them
        from transformers import AutoModelForCausalLM
        prompts = [random_tokens((1, n), config.n_vocab, seed=n)[0].tolist() for n in (3, 9)]
        outs = Generator(config, params, mesh(1, 1)).generate(prompts, SamplingOptions(max_new_tokens=10, temperature=0))
        assert [o.tokens for o in outs] == [hf_greedy(torch_model, p, 10) for p in prompts]
        hf.save_hf(params, config, tmp_path / "out")
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(torch_model, tokens))


def test_gemma3_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """Gemma 3 4B-27B ship as Gemma3ForConditionalGeneration (`gemma3`, a text_config, the text
    weights under language_model.): the import reads the text model alone, whose logits equal the
    multimodal model's on text, and exports it as Gemma3ForCausalLM."""
    import torch
    import transformers
    text = transformers.Gemma3TextConfig(**FAMILY_CASES["gemma3_local_rope"][2])
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(0)
    multimodal = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4, image_token_index=98,
        boi_token_index=96, eoi_token_index=97)).eval()
    multimodal.save_pretrained(tmp_path / "mm")
    config, params = hf.load_hf(tmp_path / "mm", compute_dtype="float32", remat="none")
    assert (config.family, config.layers, config.rope_local_theta, config.qk_norm) == ("gemma", 3, 1e4, True)
    tokens = random_tokens((2, 13), 96, seed=1)  # no image tokens
    ours = jax.jit(lambda p, t: models.build(config).apply(p, t)[0])(params, tokens)
    np.testing.assert_allclose(np.asarray(ours)[..., :config.n_vocab], hf_logits(multimodal, tokens), atol=TOL, rtol=0)
    hf.save_hf(params, config, tmp_path / "text")
    assert json.loads((tmp_path / "text" / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_gemma_keys_a_config_json_leaves_out_mean_what_transformers_assumes(model_type):
    import transformers
    keys = ("query_pre_attn_scalar", "sliding_window", "attn_logit_softcapping", "final_logit_softcapping")
    short = {k: v for k, v in FAMILY_CASES[{"gemma2": "gemma2_softcap_window", "gemma3_text": "gemma3_local_rope"}[
        model_type]][2].items() if k not in keys}
    theirs = transformers.AutoConfig.for_model(model_type, **short)
    ours = hf.config_from_hf({"model_type": model_type, **short})
    assert (ours.query_pre_attn_scalar, ours.sliding_window, ours.attn_softcap, ours.logit_softcap) == tuple(
        getattr(theirs, k) for k in keys)


@pytest.mark.parametrize("scaling, partial", [
    (dict(factor=4.0, original_max_position_embeddings=32), 1.0),  # the defaults: beta 32 / 1, 0.1 ln(4) + 1
    (dict(factor=8.0, original_max_position_embeddings=64, beta_fast=8.0, beta_slow=2.0, truncate=False), 1.0),
    (dict(factor=40.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.5), 1.0),  # DeepSeek's
    (dict(factor=2.0, original_max_position_embeddings=16, attention_factor=1.3), 0.5),  # on half of each head
])
def test_yarn_frequencies_and_magnitude_equal_transformers(scaling, partial):
    """YaRN's per-dimension blend of interpolated and kept frequencies, and the magnitude it gives the
    rotated features, against transformers' `_compute_yarn_parameters` on the same keys."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from mesh_transformer.models.layers import Rotary
    rope = {"rope_type": "yarn", "rope_theta": 5e5, "partial_rotary_factor": partial, **scaling}
    theirs = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=256,
                                      rope_parameters=rope)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](theirs)
    ours = Rotary(int(128 * partial), "half", 5e5, tuple(sorted({"rope_type": "yarn", **scaling}.items())))
    np.testing.assert_allclose(np.asarray(ours.inv_freq()), inv_freq.numpy(), rtol=1e-6)
    assert ours.magnitude() == pytest.approx(attention_factor, rel=1e-12) and ours.magnitude() != 1.0


@pytest.mark.parametrize("case, overrides", [
    ("phi_gqa_yarn", {}),
    ("starcoder2_window", dict(use_bias=False, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5})),
])
def test_older_rope_keys_import_and_export_as_transformers_reads_them(case, overrides, tmp_path):
    """A config.json written the older way, as released Phi and StarCoder2 checkpoints are: rope_theta
    and partial_rotary_factor at the top level, `rope_scaling` naming its kind under "type". Our
    logits equal transformers' on it, and our export (the kind under rope_type) reloads in
    transformers with identical logits."""
    from transformers import AutoModelForCausalLM
    torch_model = make_hf_model(tmp_path / "hf", case, **overrides)
    path = tmp_path / "hf" / "config.json"
    older = json.loads(path.read_text())
    rope = older.pop("rope_parameters")
    older.update({k: rope.pop(k) for k in ("rope_theta", "partial_rotary_factor") if k in rope})
    older["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    path.write_text(json.dumps(older))
    tokens = random_tokens((2, 13), 90, seed=2)
    assert np.array_equal(hf_logits(AutoModelForCausalLM.from_pretrained(path.parent).eval(), tokens),
                          hf_logits(torch_model, tokens))  # transformers reads the older keys as it wrote the new
    config, params = hf.load_hf(path.parent, compute_dtype="float32", remat="none")
    assert config.rope_scaling["rope_type"] in ("yarn", "linear") and parity_error(config, params, torch_model) < TOL
    hf.save_hf(params, config, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(torch_model, tokens))


@pytest.mark.parametrize("scaling, error", [
    ({"rope_type": "yarn", "factor": "4", "original_max_position_embeddings": 16}, "factor must be a positive number"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
     "original_max_position_embeddings must be a positive number"),
    ({"rope_type": "yarn", "factor": 4.0}, r"'yarn' needs \['original_max_position_embeddings'\]"),
    ({"type": "dynamic", "factor": 2.0}, "rope_type must be one of"),
])
def test_bad_rope_scaling_is_a_config_error_naming_it(scaling, error):
    with pytest.raises(ConfigError, match="config key 'rope_scaling': " + error):
        config_from_dict({**TRAIN_BASE, "family": "llama", "rope_scaling": scaling})


@pytest.mark.parametrize("keys", [
    {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},  # no original context: max_position_embeddings
    {"rope_scaling": {"type": "yarn", "factor": 8.0}},  # the older key for the kind
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6},  # both: rope_scaling replaces the other whole
     "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
    {"original_max_position_embeddings": 8,  # a top-level original context wins over the dict's
     "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
])
def test_yarn_keys_mean_what_transformers_reads_them_as(keys):
    """YaRN keys a config.json leaves out, writes the older way, or writes twice: our rotary's base,
    frequencies and magnitude are those transformers computes from the same file."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    base = {k: v for k, v in FAMILY_CASES["qwen2"][2].items() if k != "rope_parameters"}
    theirs = transformers.AutoConfig.for_model("qwen2", **base, **json.loads(json.dumps(keys)))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](theirs)
    rotary = hf.config_from_hf({"model_type": "qwen2", **base, **keys}).attention().rotary
    assert rotary.theta == theirs.rope_parameters["rope_theta"]
    np.testing.assert_allclose(np.asarray(rotary.inv_freq()), inv_freq.numpy(), rtol=1e-6)
    assert rotary.magnitude() == pytest.approx(attention_factor) and attention_factor > 1


def test_rope_scaling_written_with_type_or_rope_type_is_one_architecture():
    """A config or checkpoint written before session 51 keeps HF's older {"type": ...} (or both keys,
    as transformers 4 saved them, with nulls); today's import puts the kind under rope_type. They
    name one rotary, so their architectures are equal: `device_train.py --hf` and a LoRA run's
    resume or merged export accept the older one."""
    from mesh_transformer.train.loop import _check_same_architecture
    older = config_from_dict({**TRAIN_BASE, "family": "llama", "n_kv_heads": 2, "rope_scaling": {"type": "linear", "factor": 2.0}})
    both = {"type": "linear", "rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": None}
    imported = hf.config_from_hf({**older.model.to_hf_config(), "rope_scaling": both})
    assert imported.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert imported.architecture() == older.model.architecture()
    _check_same_architecture(imported, older, "./hf")
    with pytest.raises(ConfigError, match="rope_scaling is"):
        _check_same_architecture(dataclasses.replace(imported, rope_scaling={"type": "linear", "factor": 4.0}),
                                 older, "./hf")


@pytest.mark.parametrize("family", ["llama", "gemma", "mixtral", "olmo2", "phi3", "phi", "starcoder2"])
def test_a_config_that_leaves_out_n_kv_heads_is_the_import_that_names_it(family):
    """n_kv_heads left out (null) means one kv head per query head in every family; a config.json
    without num_key_value_heads reads that way too. Either way the architecture names the number, so
    `device_train.py --hf` and a checkpoint's config check accept the pair and still catch GQA."""
    from mesh_transformer.io.checkpoint import config_differences
    from mesh_transformer.train.loop import _check_same_architecture
    ours = config_from_dict({**TRAIN_BASE, "family": family, "n_heads": 4, "n_kv_heads": None})
    explicit = dataclasses.replace(ours.model, n_kv_heads=4)
    assert ours.model.architecture()["n_kv_heads"] == 4 and ours.model.architecture() == explicit.architecture()
    _check_same_architecture(explicit, ours, "./hf")
    assert config_differences(ours.to_json_dict(), explicit) == []
    with pytest.raises(ConfigError, match="n_kv_heads is 2 but the config says 4"):
        _check_same_architecture(dataclasses.replace(explicit, n_kv_heads=2), ours, "./hf")


def test_olmo3_keys_a_config_json_leaves_out_or_writes_the_old_way_mean_what_transformers_assumes(tmp_path):
    """A config.json without sliding_window / layer_types / rope_theta gets Olmo3Config's defaults (4,096
    tokens, three sliding layers of four, base 5e5). The older flat rope_theta and rope_scaling are
    the full layers' only: transformers rotates the sliding layers at its default base 5e5 whatever
    rope_theta says, and so do we (a model so configured gives transformers' logits)."""
    import transformers
    short = {k: v for k, v in FAMILY_CASES["olmo3_window_yarn"][2].items()
             if k not in ("sliding_window", "layer_types", "rope_parameters")}
    short.update(num_hidden_layers=8, max_position_embeddings=8192)
    ours = hf.config_from_hf({"model_type": "olmo3", **short})
    theirs = transformers.AutoConfig.for_model("olmo3", **short)
    assert ours.sliding_window == theirs.sliding_window == 4096 and ours.rope_theta == 5e5
    assert ours.to_hf_config()["layer_types"] == theirs.layer_types
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024, "attention_factor": 1.2}
    ours = hf.config_from_hf({"model_type": "olmo3", **short, "rope_scaling": yarn, "rope_theta": 1e4})
    theirs = transformers.AutoConfig.for_model("olmo3", **short, rope_scaling=yarn, rope_theta=1e4)
    assert (ours.rope_theta, ours.rope_local_theta) == (1e4, 5e5)
    exported = ours.to_hf_config()["rope_parameters"]
    for kind in ("full_attention", "sliding_attention"):
        assert {k: v for k, v in theirs.rope_parameters[kind].items() if v is not None} == exported[kind]
    torch_model = make_hf_model(tmp_path, "olmo3_window_yarn", rope_parameters=None, rope_theta=1e3,
                                rope_scaling={"rope_type": "linear", "factor": 2.0})
    config, params = hf.load_hf(tmp_path, compute_dtype="float32", remat="none")
    assert (config.rope_theta, config.rope_local_theta) == (1e3, 5e5) and parity_error(config, params, torch_model) < TOL
    own = {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
    with pytest.raises(ConfigError, match="OLMo 3's sliding-attention layers with rope scaling"):
        hf.config_from_hf({"model_type": "olmo3", **short, "rope_parameters": own})
    with pytest.raises(ConfigError, match="config.json: transformers does not read it"):
        hf.config_from_hf({"model_type": "olmo3", **short, "layer_types": ["full_attention"]})  # 1 kind, 8 layers


def test_olmo3_yarn_truncate_is_read_where_transformers_reads_it():
    """transformers' YaRN reads `truncate` beside OLMo 3's two per-kind dicts (one inside the full
    layers' dict does nothing): our full layers' frequencies equal its, and the export keeps it there."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    short = {k: v for k, v in FAMILY_CASES["olmo3_window_yarn"][2].items() if k != "rope_parameters"}
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "rope_theta": 1e4}
    for truncate_beside, truncate_inside in ((False, None), (None, False)):
        rope = {"full_attention": {**yarn, **({} if truncate_inside is None else {"truncate": truncate_inside})},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                **({} if truncate_beside is None else {"truncate": truncate_beside})}
        theirs = transformers.AutoConfig.for_model("olmo3", **short, rope_parameters=json.loads(json.dumps(rope)))
        inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](theirs, layer_type="full_attention")
        ours = hf.config_from_hf({"model_type": "olmo3", **short, "rope_parameters": rope})
        np.testing.assert_allclose(np.asarray(ours.attention().rotary.inv_freq()), inv_freq.numpy(), rtol=1e-6)
        assert ours.to_hf_config()["rope_parameters"].get("truncate") == truncate_beside


def test_sliding_window_is_checked_and_exports_only_without_biases():
    with pytest.raises(ConfigError, match="config key 'sliding_window': must be a positive integer"):
        config_from_dict({**TRAIN_BASE, "family": "llama", "sliding_window": 0})
    windowed = config_from_dict({**TRAIN_BASE, "family": "llama", "sliding_window": 8, "qkv_bias": True,
                                 "out_bias": True}).model
    with pytest.raises(ConfigError, match="sliding window and biases"):
        windowed.to_hf_config()


@pytest.mark.parametrize("n_heads", [4, 6, 8, 12])
def test_alibi_slopes_equal_transformers_bloom(n_heads):
    """ALiBi's per-head slopes (pe="alibi") against transformers' BLOOM implementation of the paper's
    recipe (the interleaved extra slopes when n_heads is not a power of two included)."""
    import torch
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from mesh_transformer.models.layers import alibi_slopes
    bias = build_alibi_tensor(torch.ones(1, 2), n_heads, torch.float32)  # [heads, 1, 2]: slope x key position
    np.testing.assert_allclose(np.asarray(alibi_slopes(n_heads)), bias[:, 0, 1].numpy(), rtol=1e-6)


def test_alibi_generation_equals_the_full_forward_pass():
    """With ALiBi and a 6-token sliding window the cached decode path (left-padded rows, key positions
    from each row's start) gives the tokens a full forward pass picks greedily, step by step."""
    config = config_from_dict({**TRAIN_BASE, **TRAIN_CASES["llama_alibi_window"], "remat": "none"}).model
    params = jax.device_get(_trainer("llama_alibi_window", 1, 1, False).init_state(0).params)
    params = jax.tree.map(lambda x: x * 8 if x.ndim > 1 else x, params)  # peaked logits: no near-ties
    forward = jax.jit(lambda p, t: models.build(config).apply(p, t)[0])
    prompts = [random_tokens((1, n), config.n_vocab, seed=n)[0].tolist() for n in (3, 6)]
    outs = Generator(config, params, mesh(1, 1)).generate(prompts, SamplingOptions(max_new_tokens=5, temperature=0))
    for prompt, out in zip(prompts, outs):
        tokens = list(prompt)
        for _ in range(5):
            tokens.append(int(np.argmax(np.asarray(forward(params, np.asarray([tokens])))[0, -1, :config.n_vocab])))
        assert out.tokens == tokens[len(prompt):]


@pytest.mark.parametrize("family", ["gptj", "llama", "llama_alibi_window"])
def test_prefill_in_query_blocks_and_in_the_cpu_kernel_equals_one_block(family, monkeypatch):
    """A prefill's attention in blocks of one row and a few positions (XLA's path on a CPU without
    the kernels; here forced with a tiny budget: 13 positions in 2 blocks of 7, the last padded),
    and as the fused CPU kernel (`kernels.attention`, where it applies: not ALiBi), gives the
    logits and keys/values of one block, with left-padded rows, a shared prefix two rows read
    different parts of, grouped-query heads (llama), ALiBi's distances and a sliding window shorter
    than the shared prefix and the prompt."""
    from mesh_transformer.models import layers
    from mesh_transformer.models.core import KVCache, SharedPrefix, unstack_layers
    config = config_from_dict({**TRAIN_BASE, **TRAIN_CASES[family], "remat": "none", "seq": 32}).model
    model = models.build(config)
    params = unstack_layers(model.init(jax.random.key(0)), config.layers)
    params = jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x, params)  # attention far from uniform
    rng = np.random.RandomState(0)
    b, t, u, kv, hd = 2, 13, 8, config.cache_heads(1), config.head_dim
    shared = SharedPrefix(tuple(rng.randn(kv, hd, u).astype(np.float32) for _ in range(config.layers)),
                          tuple(rng.randn(kv, u, hd).astype(np.float32) for _ in range(config.layers)),
                          np.array([np.arange(u), np.where(np.arange(u) < 5, np.arange(u), -1)], np.int32))
    cache = KVCache.zeros(config, b, t, start=np.array([0, 3]))._replace(offset=np.array([u, 5], np.int32))
    tokens = random_tokens((b, t), config.n_vocab, seed=5)

    fused_on_cpu, kernel_used = layers.Attention._fused_on_cpu, []

    def prefill(budget, kernel=False):
        def fused(*args):  # XLA's path, or the kernel where it applies (noted per layer)
            if kernel:
                kernel_used.append(fused_on_cpu(*args))
            return kernel and kernel_used[-1]
        monkeypatch.setattr(layers, "SCORES_PER_BLOCK", budget)
        monkeypatch.setattr(layers.Attention, "_fused_on_cpu", fused)
        logits, new = jax.jit(lambda p: model.apply(p, tokens, cache, shared=shared))(params)
        return jax.device_get((logits[..., :config.n_vocab], new.k, new.v))

    assert layers.query_block(b, t, config.n_heads * (t + u)) is None  # these shapes fit one block ...
    monkeypatch.setattr(layers, "SCORES_PER_BLOCK", 16)
    assert layers.query_block(b, t, config.n_heads * (t + u)) == 7  # ... unless the budget is tiny
    whole, blocked, fused = prefill(1 << 40), prefill(16), prefill(1 << 40, kernel=True)
    scale = max(float(np.max(np.abs(whole[0]))), 1.0)
    assert max_abs_diff(whole, blocked) < 1e-5 * scale
    assert max_abs_diff(whole, fused) < 1e-5 * scale
    assert kernel_used and all(kernel_used) == (getattr(config, "pe", None) != "alibi" and kernels.available())


def test_loss_and_grads_match_hf_autograd(case, tmp_path):
    """The training loss and every parameter's gradient equal torch autograd's through the HF model.
    Our gradients go out through the export (its transforms are linear) and back in through
    transformers' own loader, which names them as the model's parameters. The tokens avoid the pad
    token: HF embeddings built with `padding_idx` (OPT's) never update that row, ours do (README)."""
    import torch
    from transformers import AutoModelForCausalLM
    _, _, torch_model, config, params = case
    balance = {}
    if config.family == "mixtral":  # the load-balancing loss trained too (transformers: output_router_logits)
        balance = {"output_router_logits": True}
        config = dataclasses.replace(config, router_aux_loss_coef=torch_model.config.router_aux_loss_coef)
    tokens = random_tokens((2, 12), config.n_vocab, seed=4)
    pad = torch_model.config.pad_token_id
    tokens[tokens == pad] = (pad + 1) % config.n_vocab if pad is not None else 0
    trainer = Trainer(config_for(config, per_replica_batch=2), mesh(1, 1))
    loss, grads = trainer.loss_and_grads(trainer.state_from_params(params).params,
                                         trainer.shard_batch({"tokens": tokens[None]}))
    torch_model.zero_grad()
    # the model reads the first 11 tokens and is scored on the next token at each (transformers' own
    # loss, `shift_labels` given), as ours: a mixture's routers then see the same tokens
    inputs, targets = (torch.tensor(t, dtype=torch.long) for t in (tokens[:, :-1], tokens[:, 1:]))
    out = torch_model(inputs, labels=targets, shift_labels=targets, **balance)
    out.loss.backward()
    # a mixture's load-balancing loss (output_router_logits) is in the objective, not in the loss we report
    hf_loss = out.loss - torch_model.config.router_aux_loss_coef * out.aux_loss if out.get("aux_loss") else out.loss
    hf.save_hf(jax.device_get(grads), config, tmp_path / "grads")
    ours = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "grads").named_parameters())
    expected = {name: p.grad.numpy() for name, p in torch_model.named_parameters()}
    assert abs(float(loss) - hf_loss.item()) < TOL
    errors = {name: float(np.max(np.abs(ours[name].detach().numpy() - g))) for name, g in expected.items()}
    scale = max(float(np.max(np.abs(g))) for g in expected.values())
    assert max(errors.values()) < 1e-5 * scale, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_granite_constants_left_out_export_as_what_they_mean(tmp_path):
    """A LLaMA config with only some of Granite's constants (here logits_scaling) exports as
    Granite with the others as ours mean them: attention_multiplier head_dim ** -0.5, not HF's
    default 1. transformers' model of the export gives our logits."""
    from transformers import AutoModelForCausalLM
    make_hf_model(tmp_path / "llama", "llama_gqa2_llama3_rope")
    config, params = hf.load_hf(tmp_path / "llama", compute_dtype="float32", remat="none")
    scaled = dataclasses.replace(config, logits_scaling=4.0)
    hf.save_hf(params, scaled, tmp_path / "granite")
    saved = json.loads((tmp_path / "granite" / "config.json").read_text())
    assert saved["model_type"] == "granite" and saved["attention_multiplier"] == config.head_dim ** -0.5
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "granite").eval()
    tokens = random_tokens((2, 9), config.n_vocab, seed=4)
    ours = np.asarray(jax.jit(models.build(scaled).apply)(params, tokens)[0])[..., :config.n_vocab]
    np.testing.assert_allclose(ours, hf_logits(reloaded, tokens), atol=TOL, rtol=0)
