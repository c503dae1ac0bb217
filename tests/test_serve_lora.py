"""Several LoRA adapters served at once over one base (unmerged, chosen per request), PEFT the oracle.

Adapters are made by peft on random tiny HF models with B random (so each changes the output) and
rank, alpha and targets differing between them; each row of one batch runs with its own.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import FAMILY_CASES, NEW, make_hf_model, rounded_like_int8, save_peft_adapters
from mesh_transformer import loading, lora
from mesh_transformer.config import ConfigError
from mesh_transformer.evaluate.scoring import scorer_for
from mesh_transformer.generate import Batch, Generator, SamplingOptions
from mesh_transformer.generate.prefix import PrefixCache

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

# (family case, {adapter: (rank, alpha, PEFT target_modules)}); GPT-2's c_attn and Phi-3's qkv_proj are
# our q/k/v (their B split, A shared), the head's B padded to the vocabulary split over mp
ADAPTERS = {
    "llama_gqa2_llama3_rope": {"a": (4, 8, ["q_proj", "v_proj"]),
                               "b": (2, 3, ["k_proj", "o_proj", "gate_proj", "down_proj", "lm_head"])},
    "phi3_window_partial": {"a": (4, 8, ["qkv_proj"]), "b": (2, 3, ["o_proj", "gate_up_proj", "down_proj"])},
    "gpt2": {"a": (4, 8, ["c_attn"]), "b": (2, 3, ["c_proj", "c_fc"])},
}
PROMPTS = [[5, 17, 3, 9, 44], [60, 2, 2, 81, 7, 13, 29, 30, 31], [11, 12, 13, 14, 15, 16, 17], [8] * 12]
ROWS = [None, "a", "b", "a"]  # each prompt's adapter (None: the base)


def hf_class(case: str):
    import transformers
    return getattr(transformers, FAMILY_CASES[case][1])


@pytest.fixture(scope="module", params=sorted(ADAPTERS))
def served(request, tmp_path_factory):
    case = request.param
    root = tmp_path_factory.mktemp(f"lora_{case}")
    make_hf_model(root / "base", case)
    return case, root / "base", save_peft_adapters(root / "base", hf_class(case), ADAPTERS[case], root, case == "gpt2")


@pytest.fixture
def no_tokenizer(monkeypatch):
    monkeypatch.setattr(loading, "resolve_tokenizer", lambda *a: None)  # the tiny vocabularies have none


def oracle(cls, base_dir, adapter_dir, int8: bool = False):
    """transformers' model, with PEFT's adapter (its base rounded as int8 keeps it, for an int8 generator)."""
    model = cls.from_pretrained(base_dir).eval()
    model = rounded_like_int8(model) if int8 else model
    if adapter_dir is None:
        return model
    rounded = {k: v.clone() for k, v in model.state_dict().items()}
    model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():  # PEFT loads a targeted head's saved (float) weight over the rounded one: round it again
        for key, p in model.named_parameters():
            if key.endswith("base_layer.weight"):
                p.copy_(rounded[key.removeprefix("base_model.model.").replace(".base_layer", "")])
    return model


def assert_peft_continuations(case, base_dir, dirs, prompts, names, seqs, int8=False, tol=2e-5, cls=None):
    """Each sequence's greedy tokens are its adapter's argmax under PeftModel (teacher-forced on
    prompt + tokens), and its log-probabilities PeftModel's."""
    for name in set(names):
        model = oracle(cls or hf_class(case), base_dir, dirs.get(name), int8)
        for prompt, seq in [(p, s) for p, n, s in zip(prompts, names, seqs) if n == name]:
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([prompt + seq.tokens])).logits[0].float(), -1).numpy()
            at = np.arange(len(prompt) - 1, len(prompt) + len(seq.tokens) - 1)
            np.testing.assert_allclose(seq.logprobs, logp[at, seq.tokens], atol=tol, err_msg=f"adapter {name}")
            assert np.all(logp[at, seq.tokens] >= logp[at].max(-1) - tol), f"adapter {name}: not the argmax"


@pytest.mark.parametrize("dp, mp, quantize, matvec", [(1, 1, None, None), (2, 2, None, None), (1, 4, None, True),
                                                     (1, 4, "int8", None)])
def test_rows_of_one_batch_run_with_their_own_adapters(served, dp, mp, quantize, matvec, no_tokenizer):
    """One batch, rows under the base, adapter a, adapter b and a again: every row's greedy tokens
    and log-probabilities are PeftModel's with that adapter. mp 4 (LLaMA's 2 kv heads replicated:
    each shard's kv head of B) with inputs-last weights and with an int8 base (inputs-first); dp 2
    (each shard's rows their own entries)."""
    case, base_dir, dirs = served
    loaded = loading.load(hf=str(base_dir), dtype="float32", mp=mp, dp=dp)
    loaded.quantize = quantize
    gen = loaded.generator(matvec=matvec, adapters=sorted(dirs.items()))
    assert gen.adapter_names == ("a", "b") and not gen.layout.fused
    assert gen.inputs_last or matvec is None
    seqs = gen.generate(PROMPTS, SamplingOptions(max_new_tokens=6, temperature=0.0, logprobs=0), adapters=ROWS)
    assert_peft_continuations(case, base_dir, dirs, PROMPTS, ROWS, seqs, int8=quantize == "int8")
    assert len({tuple(s.tokens) for s in seqs[:3]}) == 3


# The other families (adapters a, b), each on mp 2 against PeftModel: fused modules (NeoX's
# query_key_value), OPT's project_in/out, Gemma's scaled embeddings and soft-caps, a mixture's attention.
EVERY_FAMILY = {
    "gptj": (["q_proj", "v_proj"], ["fc_in", "fc_out", "out_proj"]),
    "gpt_neox": (["query_key_value"], ["dense", "dense_h_to_4h", "dense_4h_to_h"]),
    "qwen2": (["q_proj", "v_proj", "lm_head"], ["k_proj", "gate_proj"]),
    "gemma_mqa": (["q_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]),
    "gemma2_softcap_window": (["q_proj", "k_proj"], ["down_proj", "o_proj"]),
    "opt_projected": (["q_proj", "v_proj", "out_proj"], ["fc1", "fc2", "project_in", "project_out"]),
    "mixtral_window": (["q_proj", "v_proj"], ["k_proj", "o_proj"]),
    "olmo2_gqa": (["q_proj", "k_proj", "o_proj"], ["gate_proj", "down_proj"]),
    "phi_gqa_yarn": (["q_proj", "v_proj", "dense"], ["k_proj", "fc1", "fc2"]),
    "starcoder2_window": (["q_proj", "c_fc"], ["v_proj", "o_proj", "c_proj"]),
    "gpt_oss_window_yarn": (["q_proj", "v_proj"], ["k_proj", "o_proj"]),
}


@pytest.mark.parametrize("case", sorted(EVERY_FAMILY))
def test_every_family_serves_its_adapters_as_peft(case, tmp_path, no_tokenizer):
    make_hf_model(tmp_path / "base", case)
    targets_a, targets_b = EVERY_FAMILY[case]
    dirs = save_peft_adapters(tmp_path / "base", hf_class(case), {"a": (4, 8, targets_a), "b": (2, 3, targets_b)},
                              tmp_path)
    gen = loading.load(hf=str(tmp_path / "base"), dtype="float32", mp=2, dp=1).generator(adapters=sorted(dirs.items()))
    seqs = gen.generate(PROMPTS, SamplingOptions(max_new_tokens=6, temperature=0.0, logprobs=0), adapters=ROWS)
    assert_peft_continuations(case, tmp_path / "base", dirs, PROMPTS, ROWS, seqs)
    assert len({tuple(s.tokens) for s in seqs[:3]}) == 3


def test_a_bank_entry_pads_ranks_and_folds_scales(served, no_tokenizer):
    """An entry of the bank (A [(L,) *inputs, r], B [(L,) r, *outputs] of every weight it holds):
    the adapter's B times its alpha / r, its rank padded with zeros to the bank's, zeros where it
    leaves a weight alone; the empty entry all zeros."""
    case, base_dir, dirs = served
    config = loading.load(hf=str(base_dir), dtype="float32", mp=1, dp=1).config
    bank = lora.adapter_set(sorted(dirs.items()), config)
    assert (bank.plan.adapters, bank.plan.rank, bank.slots) == (3, 4, 2)
    shapes = lora.entry_shapes(config, bank.plan)
    assert not any(np.any(x) for own in lora.bank_entry(None, shapes).values() for x in own.values())
    for adapter in bank.adapters:
        rank, alpha, _ = ADAPTERS[case][adapter.name]
        entry = lora.bank_entry(adapter, shapes)
        leaves = lora.load_peft(dirs[adapter.name], config)[1]
        for module, own in leaves.items():
            lead = 1 if "/layers/" in module else 0  # the stacked layers' axis
            for leaf, x in own.items():
                got = entry[module][leaf]
                if leaf.endswith(lora.parallel.LORA_A):
                    np.testing.assert_array_equal(got[..., :rank], x)
                    assert not np.any(got[..., rank:])
                else:
                    got, x = np.moveaxis(got, lead, 0), np.moveaxis(x, lead, 0)
                    np.testing.assert_allclose(got[:rank], x * alpha / rank, rtol=1e-6)
                    assert not np.any(got[rank:])
        untouched = [(m, leaf) for m, own in entry.items() for leaf in own if leaf not in leaves.get(m, {})]
        assert untouched and not any(np.any(entry[m][leaf]) for m, leaf in untouched)


def test_prefix_cache_blocks_belong_to_one_adapter(served, no_tokenizer):
    """The same 40-token prompt under adapter a, then b, then a: b finds none of a's blocks (its
    keys and values differ), the second a finds them; every answer equals its adapter's alone."""
    case, base_dir, dirs = served
    gen = loading.load(hf=str(base_dir), dtype="float32", mp=1, dp=1).generator(adapters=sorted(dirs.items()))
    prompt = [int(t) for t in np.random.RandomState(3).randint(90, size=40)]
    options = SamplingOptions(max_new_tokens=4, temperature=0.0, logprobs=0)
    alone = {name: gen.generate([prompt], options, adapters=[name])[0].tokens for name in ("a", "b")}
    batch = Batch(gen, 2, 64, 4, PrefixCache(gen, 256, 16))
    hits = []
    for name in ("a", "b", "a"):
        before = batch.prefix.hits
        [seq] = gen.sequences([prompt], options, adapters=[name])
        batch.admit([seq])
        while batch.active():
            batch.step()
        hits.append(batch.prefix.hits - before)
        assert seq.tokens == alone[name], name
    assert hits == [0, 0, 32]


def test_adapters_that_cannot_be_served_are_refused_by_name(served, tmp_path, no_tokenizer):
    case, base_dir, dirs = served
    loaded = loading.load(hf=str(base_dir), dtype="float32", mp=1, dp=1)
    with pytest.raises(ConfigError, match="adapter names must differ"):
        lora.adapter_set([("a", dirs["a"]), ("a", dirs["b"])], loaded.config)
    with pytest.raises(ConfigError, match=r"adapter 'a' \(.*\): .*no adapter_config.json .* to_hf_weights.py --peft"):
        lora.adapter_set([("a", str(tmp_path))], loaded.config)
    import dataclasses
    wider = dataclasses.replace(loaded.config, d_model=2 * loaded.config.d_model)  # another base's adapter
    with pytest.raises(ConfigError, match=r"adapter 'b' \(.*adapter_b\): "):
        lora.adapter_set([("b", dirs["b"])], wider)
    with pytest.raises(ConfigError, match="--lora-modules takes NAME=PATH items, got 'a'"):
        lora.parse_named(["a"], "--lora-modules")
    gen = Generator(loaded.config, loaded.params, loaded.mesh, adapters=lora.adapter_set([("a", dirs["a"])],
                                                                                          loaded.config))
    with pytest.raises(ValueError, match=r"adapter 'b' is not loaded \(this generator's adapters: a\)"):
        gen.sequences([[1, 2]], SamplingOptions(), adapters=["b"])


def test_parts_of_an_adapter_that_would_be_lost_are_refused(served, tmp_path, no_tokenizer):
    """modules_to_save (whole trained modules beside the adapter), or tensors no target reads: one
    error naming the file, for serving and merging alike (nothing silently dropped)."""
    import json
    import shutil
    from safetensors.numpy import load_file, save_file
    case, base_dir, dirs = served
    config = loading.load(hf=str(base_dir), dtype="float32", mp=1, dp=1).config
    saved = shutil.copytree(dirs["a"], tmp_path / "saved")
    cfg = json.loads((saved / lora.ADAPTER_CONFIG).read_text())
    (saved / lora.ADAPTER_CONFIG).write_text(json.dumps({**cfg, "modules_to_save": ["lm_head"]}))
    with pytest.raises(ConfigError, match="modules_to_save \\['lm_head'\\] .* merge_and_unload"):
        lora.load_peft(str(saved), config)
    extra = shutil.copytree(dirs["a"], tmp_path / "extra")
    tensors = load_file(str(extra / lora.ADAPTER_WEIGHTS))
    save_file({**tensors, "base_model.model.lm_head.weight": np.zeros((2, 2), np.float32)},
              str(extra / lora.ADAPTER_WEIGHTS))
    with pytest.raises(ConfigError, match="1 tensors are not LoRA factors .*lm_head.weight"):
        lora.adapter_set([("a", str(extra))], config)


def test_expert_adapters_are_refused_for_serving(tmp_path, no_tokenizer):
    """A mixture's expert adapters (PEFT's target_parameters) merge (--lora-adapter) but are not served unmerged."""
    make_hf_model(tmp_path / "base", "mixtral_window")
    torch.manual_seed(1)
    model = peft.get_peft_model(hf_class("mixtral_window").from_pretrained(tmp_path / "base"), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"]))
    model.save_pretrained(tmp_path / "experts")
    config = loading.load(hf=str(tmp_path / "base"), dtype="float32", mp=1, dp=1).config
    with pytest.raises(ConfigError, match="adapter 'x' adapts a mixture's experts .* --lora-adapter"):
        lora.adapter_set([("x", str(tmp_path / "experts"))], config)


# --------------------------------------------------------------------------------------------
# Over HTTP: the request's `model` picks the adapter (vLLM's --lora-modules)
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_server(tiny, tmp_path_factory):
    """The serving tests' tiny GPT-J (its tokenizer beside it) with adapters 'chat' and 'code' (rsLoRA:
    alpha / sqrt(r)), served as 'tiny' on loopback -> (generator, url, adapter directories)."""
    from mesh_transformer.serve import Engine, create_app
    from tests.serving import KEY, start_server
    root = tmp_path_factory.mktemp("lora_http")
    dirs = save_peft_adapters(tiny.path, type(tiny.torch), {"chat": (4, 8, ["q_proj", "v_proj"]),
                                                       "code": (2, 4, ["fc_in", "fc_out"], True)}, root, scale_b=6.0)
    gen = loading.load(hf=str(tiny.path), dtype="float32", mp=1, dp=1).generator(adapters=sorted(dirs.items()))
    engine = Engine(gen, tiny.tokenizer, max_batch=4, chunk=4, batch_invariant=True).start()
    server, url = start_server(create_app(engine, model_name="tiny", api_key=KEY))
    yield gen, url, dirs
    server.should_exit = True
    engine.stop()


def test_requests_choose_their_adapter_by_model(lora_server, tiny):
    """Concurrent requests naming the base, 'chat' and 'code' (the official openai client), decoded
    in one batch: each answer is the library's with that adapter, which is PeftModel's; streamed
    chat too. /v1/models lists the adapters with the base as their parent."""
    import concurrent.futures

    from openai import OpenAI
    from tests.serving import KEY
    gen, url, dirs = lora_server
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    prompt = "The quick brown fox"
    ids = tiny.tokenizer.encode(prompt)
    models = [None, "chat", "code", "chat", "tiny"]
    options = SamplingOptions(max_new_tokens=NEW, temperature=0.0, logprobs=0)
    library = gen.generate([ids] * 5, options, tiny.tokenizer, adapters=[m if m != "tiny" else None for m in models])
    assert_peft_continuations("gptj", tiny.path, dirs, [ids] * 3, models[:3], library[:3],
                              cls=type(tiny.torch))
    assert len({s.text for s in library[:3]}) == 3

    def complete(model):
        return client.completions.create(model=model or "tiny", prompt=prompt, max_tokens=NEW, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(complete, models))
    assert [a.choices[0].text for a in answers] == [s.text for s in library]
    assert [a.model for a in answers] == ["tiny", "chat", "code", "chat", "tiny"]

    stream = client.chat.completions.create(model="code", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=4, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    chat = client.chat.completions.create(model="code", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=4, temperature=0)
    assert streamed == chat.choices[0].message.content
    listed = {m.id: m.model_extra.get("parent") for m in client.models.list().data}
    assert listed == {"tiny": None, "chat": "tiny", "code": "tiny"}


def test_an_unknown_model_is_a_404_naming_the_served_ones(lora_server):
    import openai
    from tests.serving import KEY
    _, url, _ = lora_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError, match=r"model: the model 'chatt' does not exist \(served: tiny, chat, code\)"):
        client.completions.create(model="chatt", prompt="The", max_tokens=2)


def test_models_are_listed_and_retrieved_by_both_sdks(lora_server):
    """/v1/models and /v1/models/{id} through the official openai and anthropic clients: the same
    cards (base, then adapters), Anthropic's pages by limit / after_id / before_id, and an unknown
    id a 404 naming the served ones in both; a page past a model not served is a 400 naming the field."""
    import anthropic
    import httpx
    import openai
    from tests.serving import KEY
    _, url, _ = lora_server
    oa_client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    an_client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)
    card = oa_client.models.retrieve("chat")
    assert (card.id, card.object, card.owned_by, card.model_extra["parent"]) == ("chat", "model", "mesh-transformer", "tiny")
    info = an_client.models.retrieve("code")
    assert (info.id, info.type, info.display_name, info.lifecycle, info.max_input_tokens) == \
        ("code", "model", "code", "active", card.model_extra["max_model_len"])
    assert info.created_at.timestamp() == card.created
    first = an_client.models.list(limit=2)
    assert ([m.id for m in first.data], first.first_id, first.last_id, first.has_more) == (["tiny", "chat"], "tiny", "chat", True)
    assert [m.id for m in an_client.models.list(limit=1)] == ["tiny", "chat", "code"]  # the SDK follows after_id
    before = an_client.models.list(before_id="code", limit=1)
    assert ([m.id for m in before.data], before.has_more) == (["chat"], True)
    assert [m.id for m in an_client.models.list().data] == [m.id for m in oa_client.models.list().data]
    for call, error in ((lambda: oa_client.models.retrieve("chatt"), openai.NotFoundError),
                        (lambda: an_client.models.retrieve("chatt"), anthropic.NotFoundError)):
        with pytest.raises(error, match=r"model_id: the model 'chatt' does not exist \(served: tiny, chat, code\)"):
            call()
    http = httpx.Client(base_url=url, headers={"x-api-key": KEY}, timeout=60)
    for query, empty in (("after_id=code", True), ("before_id=tiny", True), ("before_id=code", False)):
        page = http.get(f"/v1/models?{query}").json()
        assert (page["data"] == [], page["has_more"]) == (empty, False)
        assert page["first_id"] == (None if empty else "tiny") and page["last_id"] == (None if empty else "chat")
    for query, message in (("after_id=nope", "after_id: no model 'nope'"), ("limit=0", "limit: a whole number"),
                           ("limit=%C2%B2", "limit: a whole number"),
                           ("after_id=tiny&before_id=code", "after_id: give after_id or before_id, not both")):
        r = http.get(f"/v1/models?{query}")
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text


def test_echo_scores_the_prompt_with_the_adapter_named(lora_server, tiny):
    """echo + logprobs (how lm-eval scores through a server) under 'chat' and 'code': every prompt
    token's log p and top-5 are PeftModel's with that adapter, and the base's its own; with
    max_tokens the completion is the adapter's too."""
    from openai import OpenAI
    from tests.serving import KEY
    gen, url, dirs = lora_server
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    prompts = ["The quick brown fox jumps over", "Hello there"]
    for model in ("chat", "code", "tiny"):
        answer = client.completions.create(model=model, prompt=prompts, max_tokens=0, echo=True, logprobs=5)
        peft_model = oracle(type(tiny.torch), tiny.path, dirs.get(model))
        for prompt, choice in zip(prompts, answer.choices):
            ids = tiny.tokenizer.encode(prompt)
            with torch.no_grad():
                logp = torch.log_softmax(peft_model(torch.tensor([ids])).logits[0].float(), -1).numpy()
            got = choice.logprobs
            assert got.token_logprobs[0] is None and len(got.token_logprobs) == len(ids)
            np.testing.assert_allclose(got.token_logprobs[1:], logp[np.arange(len(ids) - 1), ids[1:]], atol=2e-5,
                                       err_msg=model)
            for at, top in enumerate(got.top_logprobs[1:]):  # keyed by text: tokens alike in text share a key
                best = np.sort(logp[at])[::-1][:5]
                assert abs(max(top.values()) - best[0]) < 2e-5
                assert all(np.abs(best - v).min() < 2e-5 for v in top.values())
    echoed = client.completions.create(model="code", prompt=prompts[1], max_tokens=3, echo=True, logprobs=0,
                                       temperature=0)
    plain = client.completions.create(model="code", prompt=prompts[1], max_tokens=3, temperature=0)
    assert echoed.choices[0].text == prompts[1] + plain.choices[0].text


def test_embeddings_run_with_the_adapter_named(lora_server, tiny):
    """/v1/embeddings under 'chat' and 'code' (the official client): the last token's state of
    PeftModel's base model with that adapter, normalised; the base's its own."""
    import openai
    from tests.serving import KEY
    _, url, dirs = lora_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    prompts = ["The quick brown fox jumps over", "Hello there"]
    for model in ("chat", "code", "tiny"):
        answer = client.embeddings.create(model=model, input=prompts)
        adapted = oracle(type(tiny.torch), tiny.path, dirs.get(model))
        adapted = adapted.get_base_model() if model in dirs else adapted
        for prompt, d in zip(prompts, answer.data):
            with torch.no_grad():
                state = adapted.base_model(torch.tensor([tiny.tokenizer.encode(prompt)])).last_hidden_state[0, -1]
            np.testing.assert_allclose(d.embedding, (state / state.norm()).numpy(), atol=2e-6, err_msg=model)
    with pytest.raises(openai.NotFoundError, match="the model 'nope' does not exist"):
        client.embeddings.create(model="nope", input="hi")


def test_an_adapter_named_like_the_base_is_refused(lora_server, tiny):
    from mesh_transformer.serve import Engine, create_app
    gen, _, _ = lora_server
    with pytest.raises(ValueError, match="adapter name 'chat' is the served model's name"):
        create_app(Engine(gen, tiny.tokenizer), model_name="chat")


def _decode_all_reduces(gen) -> int:
    import re
    state = gen.new_state(4, 32)
    text = gen._decode.lower(gen.params, state, np.int32(0), np.int32(2), 2, 32, 4).compile().as_text()
    return len(re.findall(r"= \S+ all-reduce(?:-start)?\(", text))


def test_adapters_add_no_collectives_under_mp(served, no_tokenizer):
    """On mp 2 the low-rank paths shard like their weights: a column-parallel weight's B splits its
    outputs, a row-parallel weight's A its inputs and the partial products join the weight's own
    all-reduce. The decode program holds as many all-reduces as without adapters (unfused too)."""
    case, base_dir, dirs = served
    load = lambda: loading.load(hf=str(base_dir), dtype="float32", mp=2, dp=1)  # noqa: E731
    plain = Generator(*(lambda m: (m.config, m.params, m.mesh))(load()), fuse=False)
    banked = load().generator(adapters=sorted(dirs.items()))
    assert _decode_all_reduces(banked) == _decode_all_reduces(plain) > 0


# --------------------------------------------------------------------------------------------
# More adapters than the bank's entries, and adapters loaded at runtime (vLLM's --max-loras,
# /v1/load_lora_adapter): entries rewritten in place between device calls
# --------------------------------------------------------------------------------------------

def test_an_entry_is_rewritten_in_place_without_compiling(served, no_tokenizer):
    """A bank of one entry on mp 2 holding a, then b, then nothing, then a again: the rows under b
    are PeftModel's, a's come back as they were, the base's rows and the prompt scorer's scores
    never change, and no program compiles again (the bank is the programs' argument; the writer
    compiles once)."""
    case, base_dir, dirs = served
    gen = loading.load(hf=str(base_dir), dtype="float32", mp=2, dp=1).generator(adapters=sorted(dirs.items()), slots=1)
    a, b = gen.adapters.adapters
    assert gen.adapter_names == ("a",) and gen.adapters.slots == 1
    options = SamplingOptions(max_new_tokens=6, temperature=0.0, logprobs=0)
    first = gen.generate(PROMPTS[:2], options, adapters=["a", None])
    compiled = gen._admit._cache_size(), gen._decode._cache_size()
    scorer = scorer_for(gen)  # the prompt scorer (echo with logprobs) reads the base alone, never the bank
    scored = scorer.score(PROMPTS[:2])
    assert not any(lora.parallel.is_adapter(leaf) for own in scorer.params.values() for leaf in own)
    gen.write_adapter(1, b)
    assert gen.adapter_names == ("b",)
    for was, now in zip(scored, scorer.score(PROMPTS[:2])):
        np.testing.assert_array_equal(was.logprobs, now.logprobs)
    seqs = gen.generate(PROMPTS[:2], options, adapters=["b", None])
    assert_peft_continuations(case, base_dir, dirs, PROMPTS[:2], ["b", None], seqs)
    assert seqs[1].tokens == first[1].tokens and seqs[0].tokens != first[0].tokens
    gen.write_adapter(1, None)
    with pytest.raises(ValueError, match=r"adapter 'b' is not loaded \(this generator's adapters: none\)"):
        gen.sequences([PROMPTS[0]], options, adapters=["b"])
    assert gen.generate(PROMPTS[:2], options, adapters=[None, None])[1].tokens == first[1].tokens
    gen.write_adapter(1, a)
    again = gen.generate(PROMPTS[:2], options, adapters=["a", None])
    assert [s.tokens for s in again] == [s.tokens for s in first]
    assert (gen._admit._cache_size(), gen._decode._cache_size()) == compiled
    assert gen._write_bank._cache_size() == 1
    with pytest.raises(ValueError, match=r"adapter entry 2 is not one of this generator's bank \(1 .. 1\)"):
        gen.write_adapter(2, a)


def test_prompts_scored_with_an_adapter_are_peft_models(served, no_tokenizer):
    """The prompt scorer under adapter a, then b (a bank of one entry on mp 2, which holds a
    throughout): every position's log p, and the last positions' (tail) top-5, are PeftModel's with
    that adapter; the base's scores and the bank are unchanged, and b compiles nothing a did not."""
    case, base_dir, dirs = served
    gen = loading.load(hf=str(base_dir), dtype="float32", mp=2, dp=1).generator(adapters=sorted(dirs.items()), slots=1)
    a, b = gen.adapters.adapters
    scorer = scorer_for(gen)
    base = scorer.score(PROMPTS)
    bank = jax.device_get({m: {n: x for n, x in own.items() if lora.parallel.is_adapter(n)}
                           for m, own in gen.params.items()})
    compiled = []  # the adapter scoring programs' cache sizes after each adapter
    for adapter in (a, b, None):
        compiled.append([p._cache_size() for key, p in scorer._programs.items() if key[0] != "embed" and key[-1]])
        model = oracle(hf_class(case), base_dir, dirs[adapter.name] if adapter else None)
        scores = scorer.score(PROMPTS, top=5, adapter=adapter)
        last = scorer.score(PROMPTS, top=5, tail=[3] * len(PROMPTS), adapter=adapter)
        for prompt, s, t in zip(PROMPTS, scores, last):
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1).numpy()[:-1]
            np.testing.assert_allclose(s.logprobs, logp[np.arange(len(prompt) - 1), prompt[1:]], atol=2e-5)
            np.testing.assert_allclose(t.top_logprobs, -np.sort(-logp[-3:], axis=-1)[:, :5], atol=2e-5)
            np.testing.assert_array_equal(t.top_ids[:, 0], logp[-3:].argmax(-1))
    for was, now in zip(base, scores):
        np.testing.assert_array_equal(was.logprobs, now.logprobs)
    assert gen.adapter_names == ("a",)
    jax.tree.map(np.testing.assert_array_equal, bank, jax.device_get(
        {m: {n: x for n, x in own.items() if lora.parallel.is_adapter(n)} for m, own in gen.params.items()}))
    assert compiled[0] == [0, 0] and compiled[1] == compiled[2] and max(compiled[1]) > 0
    from mesh_transformer.serve.adapters import AdapterSlots
    slots = AdapterSlots(gen)  # unloading (or replacing) an adapter drops the scorer's device copy of it
    assert list(scorer._kept) == [a.serial, b.serial]
    slots.remove("a")
    slots.add(b._replace(serial=b.serial + 1000), replace=True)
    assert not scorer._kept
    scorer.score(PROMPTS[:1], adapter=a)  # a pass queued under a before its unload: it runs, nothing is kept
    assert not scorer._kept
    with pytest.raises(ValueError, match="adapter 'a': this scorer has no served adapters"):
        scorer_for(loading.load(hf=str(base_dir), dtype="float32", mp=1, dp=1).generator()).score(PROMPTS, adapter=a)


def test_adapters_that_do_not_fit_the_bank_are_refused(served, no_tokenizer):
    """A rank above the bank's (--max-lora-rank), or a weight the bank does not hold: one error naming the adapter."""
    case, base_dir, dirs = served
    config = loading.load(hf=str(base_dir), dtype="float32", mp=1, dp=1).config
    with pytest.raises(ConfigError, match=r"adapter 'a' \(.*\): rank 4 is above the served adapters' largest rank, "
                                          r"2 \(--max-lora-rank\)"):
        lora.adapter_set(sorted(dirs.items()), config, rank=2)
    a = lora.served_adapter("a", dirs["a"], config)
    only_b = lora.adapter_set([("b", dirs["b"])], config, rank=4).plan
    with pytest.raises(ConfigError, match=r"adapter 'a' \(.*\): it adapts attn\.\w+, .*which the served bank does not hold"):
        lora.check_fits(a, only_b)
    every = lora.adapter_set([("b", dirs["b"])], config, rank=4, every_linear=True).plan
    assert only_b.targets < every.targets
    lora.check_fits(a, every)  # every linear layer: a's q/k/v too
    with pytest.raises(ConfigError, match="--max-loras: the bank needs at least one entry for adapters, got 0"):
        lora.adapter_set([], config, slots=0)


def test_more_adapters_than_entries_take_turns(lora_server, tiny):
    """One entry, adapters chat and code: three chat requests, one code, three chat and one base,
    submitted together. The first chats run (the base beside them), code waits for the entry and
    the later chats wait behind it (so traffic for one adapter cannot starve another): the entry
    is written twice (code, chat). Every answer is the library's with both adapters in entries."""
    from mesh_transformer.serve import Engine
    gen, _, dirs = lora_server
    one = loading.load(hf=str(tiny.path), dtype="float32", mp=1, dp=1).generator(adapters=sorted(dirs.items()), slots=1)
    engine = Engine(one, tiny.tokenizer, max_batch=8, chunk=4, batch_invariant=True)
    ids = tiny.tokenizer.encode("The quick brown fox")
    names = ["chat"] * 3 + ["code"] + ["chat"] * 3 + [None]
    options = SamplingOptions(max_new_tokens=6, temperature=0.0)
    seqs = [engine.sequence(ids, options, None, adapter=name) for name in names]
    request = engine.submit(seqs)  # all waiting before the engine takes any
    engine.start()
    try:
        assert request.updated.wait(120)
        while not request.finished:
            request.updated.clear()
            request.updated.wait(60)
        stats = engine.stats()["adapters"]
    finally:
        engine.stop()
    assert one.adapter_names == ("chat",)
    expected = gen.generate([ids] * len(names), options, tiny.tokenizer, adapters=names)
    assert [s.tokens for s in seqs] == [s.tokens for s in expected]
    assert len({tuple(s.tokens) for s in seqs[2:5]}) == 2
    assert stats == {"known": 2, "held": 2, "reloads": 0, "slots": 1, "placed": 2, "running": [0]}


def test_adapters_beyond_the_host_cap_are_read_again(lora_server, tiny, tmp_path):
    """--max-cpu-loras 1 over one entry, adapters chat and code: code's leaves are dropped at start
    (checked, not kept) and read again from its directory when a request names it (the same load:
    its serial), dropping chat's. Over HTTP, requests alternating code, chat, the base and code get
    the library's answers with every adapter held, and echo scores under a dropped adapter. A
    dropped adapter whose directory is gone is a 400 naming it, and the others go on."""
    import shutil

    import openai

    from mesh_transformer.serve import Engine, create_app
    from tests.serving import KEY, start_server
    gen, _, dirs = lora_server
    copies = {name: str(shutil.copytree(d, tmp_path / name)) for name, d in dirs.items()}
    capped = loading.load(hf=str(tiny.path), dtype="float32", mp=1, dp=1).generator(
        adapters=sorted(copies.items()), slots=1, host=1)
    engine = Engine(capped, tiny.tokenizer, max_batch=8, chunk=4, batch_invariant=True, host_adapters=1)
    slots = engine.adapters
    assert slots.held("chat") and not slots.held("code") and slots.known["code"].leaves is None
    assert all(a.leaves is None for a in capped.adapters.adapters)  # the slots hold the leaves, not the set
    serial = slots.known["code"].serial
    code = engine.adapter("code")
    assert code.serial == serial and code.leaves is not None and slots.reloads == 1
    assert not slots.held("chat") and slots.stats()["held"] == 1

    server, url = start_server(create_app(engine.start(), model_name="tiny", api_key=KEY))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        prompt = "The quick brown fox"
        names = ["code", "chat", "tiny", "code"]
        texts = [client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
                 for name in names]
        expected = gen.generate([tiny.tokenizer.encode(prompt)] * 4, SamplingOptions(max_new_tokens=6, temperature=0.0),
                                tiny.tokenizer, adapters=[n if n != "tiny" else None for n in names])
        assert texts == [s.text for s in expected] and len(set(texts)) == 3
        echoed = client.completions.create(model="chat", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        assert slots.reloads == 4  # chat, code, chat again
        scored = scorer_for(gen).score([tiny.tokenizer.encode(prompt)], adapter=gen.adapters.adapters[0])[0]
        np.testing.assert_allclose(echoed.choices[0].logprobs.token_logprobs[1:], scored.logprobs, atol=1e-6)
        client.completions.create(model="code", prompt=prompt, max_tokens=1)  # chat dropped again
        shutil.rmtree(copies["chat"])
        with pytest.raises(openai.BadRequestError, match=r"model: adapter 'chat' \(.*chat\): .*no adapter_config.json"):
            client.completions.create(model="chat", prompt=prompt, max_tokens=2)
        assert client.completions.create(model="code", prompt=prompt, max_tokens=6, temperature=0).choices[0].text \
            == texts[0]
        assert engine.stats()["adapters"] == {"known": 2, "held": 1, "reloads": 4, "slots": 1, "placed": 3,
                                              "running": [0]}
    finally:
        server.should_exit = True
        engine.stop()
    with pytest.raises(ConfigError, match=r"--max-cpu-loras \(1\) must be at least the bank's entries, --max-loras \(2"):
        loading.load(hf=str(tiny.path), dtype="float32", mp=1, dp=1).generator(adapters=sorted(dirs.items()), host=1)


def test_concurrent_requests_for_a_dropped_adapter_read_it_once(lora_server, tiny, monkeypatch):
    """--max-cpu-loras 1: four threads ask for code (dropped) at once: its directory is read once,
    and all get that copy, with its leaves. That drops chat's, but chat is in the bank's entry:
    asked for again, the entry's copy serves (nothing read), and code's are dropped in turn."""
    import concurrent.futures
    import time

    from mesh_transformer.serve.adapters import AdapterSlots
    gen, _, dirs = lora_server
    capped = loading.load(hf=str(tiny.path), dtype="float32", mp=1, dp=1).generator(
        adapters=sorted(dirs.items()), slots=1, host=1)
    slots = AdapterSlots(capped, host=1)
    reads = []
    real = lora.served_adapter

    def slow_read(*args):
        reads.append(args[0])
        time.sleep(0.3)
        return real(*args)
    monkeypatch.setattr(lora, "served_adapter", slow_read)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: slots.get("code"), range(4)))
    assert reads == ["code"] and slots.reloads == 1
    assert all(a is got[0] and a.leaves is not None for a in got)
    assert capped.residents[1].name == "chat" and slots.known["chat"].leaves is None and slots.held("chat") is None
    assert slots.get("chat") is capped.residents[1] and reads == ["code"] and slots.reloads == 1
    assert slots.stats()["held"] == 1 and slots.known["code"].leaves is None  # code dropped for chat
    assert slots.held("code") is None and slots.held("chat") is capped.residents[1]


def test_a_waiting_adapter_drains_one_entry(runtime_server, tiny):
    """Two entries busy with chat and code; two requests for wide, which is in neither, drain one
    entry between them (the least recently used: chat's), and a later chat request waits for it
    without draining code's, so code's later requests still join."""
    from mesh_transformer.serve import Engine
    _, dirs = runtime_server
    gen = loading.load(hf=str(tiny.path), dtype="float32", mp=1, dp=1).generator(
        adapters=[(n, dirs[n]) for n in ("chat", "code", "wide")], slots=2)
    engine = Engine(gen, tiny.tokenizer, max_batch=8, chunk=4)  # not started: one admission decided by hand
    names = ["chat", "chat", "code", "code", "wide", "wide", "chat", "code"]
    engine.submit([engine.sequence([5, 6, 7], SamplingOptions(max_new_tokens=4), None, adapter=n) for n in names])
    with engine._cv:
        group = engine._take_admissible()
    assert [(s.lora.name, s.adapter) for s, _ in group] == [("chat", 1)] * 2 + [("code", 2)] * 3
    assert [s.lora.name for s, _ in engine._pending] == ["wide", "wide", "chat"]  # in their order


def test_an_unloaded_adapter_finishes_what_was_submitted(lora_server, tiny):
    """Requests submitted under chat, then chat unloaded before the engine admits them: they run
    with chat (the library's answer), while a new request naming it is refused."""
    from mesh_transformer.serve import Engine
    gen, _, dirs = lora_server
    one = loading.load(hf=str(tiny.path), dtype="float32", mp=1, dp=1).generator(adapters=sorted(dirs.items()), slots=1)
    engine = Engine(one, tiny.tokenizer, max_batch=4, chunk=4, batch_invariant=True)
    ids, options = tiny.tokenizer.encode("The quick brown fox"), SamplingOptions(max_new_tokens=6, temperature=0.0)
    seqs = [engine.sequence(ids, options, None, adapter=n) for n in ("code", "chat")]
    request = engine.submit(seqs)
    engine.adapters.remove("chat")
    with pytest.raises(ValueError, match=r"adapter 'chat' is not loaded \(this server's adapters: code\)"):
        engine.sequence(ids, options, None, adapter="chat")
    engine.start()
    try:
        while not request.finished:
            assert request.updated.wait(120)
            request.updated.clear()
    finally:
        engine.stop()
    expected = gen.generate([ids, ids], options, tiny.tokenizer, adapters=["code", "chat"])
    assert [s.tokens for s in seqs] == [s.tokens for s in expected]


def test_prefix_cache_keys_an_adapter_not_its_entry(served, no_tokenizer):
    """One entry: a 40-token prompt under a (its blocks cached), then b written over a in the
    entry finds none of them (0 hits, b's own answer), then a written back finds its blocks again."""
    case, base_dir, dirs = served
    gen = loading.load(hf=str(base_dir), dtype="float32", mp=1, dp=1).generator(adapters=sorted(dirs.items()), slots=1)
    a, b = gen.adapters.adapters
    prompt = [int(t) for t in np.random.RandomState(3).randint(90, size=40)]
    options = SamplingOptions(max_new_tokens=4, temperature=0.0, logprobs=0)
    batch = Batch(gen, 2, 64, 4, PrefixCache(gen, 256, 16))
    hits, answers = [], {}
    for adapter in (a, b, a):
        gen.write_adapter(1, adapter)
        before = batch.prefix.hits
        [seq] = gen.sequences([prompt], options, adapters=[adapter.name])
        batch.admit([seq])
        while batch.active():
            batch.step()
        hits.append(batch.prefix.hits - before)
        answers.setdefault(adapter.name, []).append(seq)
    assert hits == [0, 0, 32]
    assert answers["a"][0].tokens == answers["a"][1].tokens
    assert_peft_continuations(case, base_dir, dirs, [prompt], ["b"], answers["b"])


@pytest.fixture(scope="module")
def runtime_server(tiny, tmp_path_factory):
    """The tiny GPT-J served with runtime loading: no adapter at start, one entry of rank 4 over
    every linear layer -> (url, adapter directories: chat, code (rsLoRA, as `lora_server`'s) and wide,
    of rank 8)."""
    from mesh_transformer.serve import Engine, create_app
    from tests.serving import KEY, start_server
    root = tmp_path_factory.mktemp("lora_runtime")
    dirs = save_peft_adapters(tiny.path, type(tiny.torch), {"chat": (4, 8, ["q_proj", "v_proj"]),
                                                       "code": (2, 4, ["fc_in", "fc_out"], True),
                                                       "wide": (8, 8, ["q_proj"])}, root, scale_b=6.0)
    gen = loading.load(hf=str(tiny.path), dtype="float32", mp=1, dp=1).generator(slots=1, rank=4, every_linear=True)
    engine = Engine(gen, tiny.tokenizer, max_batch=4, chunk=4, batch_invariant=True).start()
    server, url = start_server(create_app(engine, model_name="tiny", api_key=KEY, runtime_lora=True))
    yield url, dirs
    server.should_exit = True
    engine.stop()


def test_adapters_load_and_unload_at_runtime(runtime_server, lora_server, tiny, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (the official openai client for the
    completions): an adapter is unknown (404) until loaded, then served by name; two adapters
    share the one entry by turns; a name in use, a directory that is no adapter and a rank above
    the bank's are 400s naming the fault; unloaded, its name is a 404 again. Answers equal the
    library's with both adapters in entries of their own (`lora_server`'s)."""
    import concurrent.futures
    import json
    import shutil

    import httpx
    import openai
    from tests.serving import KEY
    url, dirs = runtime_server
    gen = lora_server[0]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    load = lambda name, path: http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})  # noqa: E731
    broken = tmp_path / "broken"  # a config without its rank "r"
    shutil.copytree(dirs["code"], broken)
    cfg = json.loads((broken / lora.ADAPTER_CONFIG).read_text())
    (broken / lora.ADAPTER_CONFIG).write_text(json.dumps({k: v for k, v in cfg.items() if k != "r"}))
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError, match=r"the model 'chat' does not exist \(served: tiny\)"):
        client.completions.create(model="chat", prompt="The", max_tokens=2)
    r = load("chat", dirs["chat"])
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'chat' added successfully.")
    assert load("code", dirs["code"]).status_code == 200
    for name, path, message in (("chat", dirs["code"], "lora_name: the adapter 'chat' has already been loaded"),
                                ("x", "/nowhere", "adapter 'x' (/nowhere): /nowhere: no adapter_config.json"),
                                ("wide", dirs["wide"], "rank 8 is above the served adapters' largest rank, 4"),
                                ("tiny", dirs["chat"], "lora_name: 'tiny' cannot name an adapter (it is the base)"),
                                ("broken", broken, "lora_path: adapter 'broken' (" + str(broken) + "): cannot be read: "
                                                   "KeyError: 'r'")):
        r = load(name, path)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert [m.id for m in client.models.list().data] == ["tiny", "chat", "code"]
    assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": "z"}).status_code == 401

    prompt, models = "The quick brown fox", [None, "chat", "code", "chat"]
    expected = gen.generate([tiny.tokenizer.encode(prompt)] * 4, SamplingOptions(max_new_tokens=NEW, temperature=0.0),
                            tiny.tokenizer, adapters=models)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda m: client.completions.create(model=m or "tiny", prompt=prompt, max_tokens=NEW,
                                                                    temperature=0), models))
    assert [a.choices[0].text for a in answers] == [s.text for s in expected]
    assert http.get("/health").json()["adapters"]["placed"] >= 2

    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'chat' removed successfully.")
    with pytest.raises(openai.NotFoundError, match=r"the model 'chat' does not exist \(served: tiny, code\)"):
        client.completions.create(model="chat", prompt="The", max_tokens=2)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert r.status_code == 404 and "the adapter 'chat' cannot be found" in r.json()["error"]["message"]
    assert client.completions.create(model="code", prompt=prompt, max_tokens=NEW, temperature=0).choices[0].text \
        == expected[2].text
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "code", "lora_path": str(dirs["chat"]), "load_inplace": True})
    assert r.status_code == 200, r.text  # 'code' now names chat's weights
    assert client.completions.create(model="code", prompt=prompt, max_tokens=NEW, temperature=0).choices[0].text \
        == expected[1].text


def test_runtime_routes_are_off_unless_asked_for(lora_server):
    import httpx
    from tests.serving import KEY
    _, url, dirs = lora_server
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(dirs["chat"])},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "no such endpoint: POST /v1/load_lora_adapter" in r.json()["error"]["message"]
