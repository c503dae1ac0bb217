"""Evaluation against lm-evaluation-harness itself, with HF transformers as the oracle.

Local tasks (tests/eval_tasks.py: a LAMBADA-style last word, a one-shot multiple choice, short
greedy answers, rolling-window perplexity) on random tiny HF models of every family with a BPE
tokenizer trained on the task text. Per request, `eval_harness.py`'s model (`MeshLM`, sharded
dp2 x mp2), lm-eval's `local-completions` against our server, and lm-eval's own `--model hf`
(HFLM) on the same weights give the same log-likelihoods (1e-4, fp32), greedy flags, generations
and accuracies.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local task data only; before `datasets` is imported

import numpy as np
import pytest

from tests.eval_tasks import TASKS, train_tokenizer, write_tasks
from tests.helpers import make_hf_model, refusal

TOL = 1e-4
CASES = ("gptj", "gpt_neox", "llama_gqa2_llama3_rope", "gpt2", "opt_projected", "phi3_window_partial",
         "gemma3_local_rope", "mixtral_window", "olmo2_gqa", "phi_gqa_yarn", "starcoder2_window")  # a family each
SERVED = ("gptj", "llama_gqa2_llama3_rope", "mixtral_window")  # also checked through the OpenAI API
MESH = {"gptj": (2, 2)}  # (dp, mp); others (1, 2)
FAMILY_TASKS = {"gptj": TASKS}  # others skip the rolling-window task (the same code for every family)


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("eval_tasks"))


@pytest.fixture(scope="module")
def manager(tasks_dir):
    from mesh_transformer.evaluate import harness
    return harness.task_manager(tasks_dir, TASKS)


def evaluate(lm, manager, tasks=TASKS):
    from mesh_transformer.evaluate import harness
    return harness.run(lm, list(tasks), manager, bootstrap_iters=0, log_samples=True)


@pytest.fixture(scope="module", params=CASES)
def family(request, tmp_path_factory, manager):
    """(case, HF directory, HFLM's results) for one family's random tiny model."""
    from lm_eval.models.huggingface import HFLM

    path = tmp_path_factory.mktemp(request.param)
    tokenizer = train_tokenizer(path)
    make_hf_model(path, request.param, vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    hflm = HFLM(pretrained=str(path), dtype="float32", batch_size=8, device="cpu")
    return request.param, path, evaluate(hflm, manager, tasks_of(request.param))


def tasks_of(case):
    return FAMILY_TASKS.get(case, TASKS[:3])


@pytest.fixture(scope="module")
def ours(family):
    """Our model as eval_harness.py loads it, on dp2 x mp2."""
    from mesh_transformer import loading
    from mesh_transformer.evaluate.lm import MeshLM
    case, path, _ = family
    dp, mp = MESH.get(case, (1, 2))
    return MeshLM.from_loaded(loading.load(hf=str(path), mp=mp, dp=dp, dtype="float32"), batch_size=8)


def answers(results, task):
    """Per request, in document order: (log-likelihood, greedy) pairs, or generated texts, or rolling log-likelihoods."""
    out = []
    for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"]):
        out += [r[0] for r in sample["resps"]]
    return out


def assert_same_answers(ours, theirs, tasks=TASKS):
    for task in tasks:
        a, b = answers(ours, task), answers(theirs, task)
        assert len(a) == len(b) > 0, task
        for x, y in zip(a, b):
            if isinstance(y, str):
                assert x == y, task
            elif isinstance(y, (list, tuple)):  # (log-likelihood, is greedy)
                assert abs(float(x[0]) - float(y[0])) < TOL and bool(x[1]) == bool(y[1]), (task, x, y)
            else:  # a rolling log-likelihood (a sum over a whole document)
                assert abs(float(x) - float(y)) < TOL * 10, (task, x, y)
        for metric, value in theirs["results"][task].items():
            if metric.startswith(("acc", "exact_match")) and "stderr" not in metric:
                assert ours["results"][task][metric] == value, (task, metric)


def test_meshlm_matches_hflm(family, ours, manager):
    case, _, hf_results = family
    results = evaluate(ours, manager, tasks_of(case))
    assert_same_answers(results, hf_results, tasks_of(case))
    assert ours.scorer.shapes and len(ours.scorer.shapes) <= 8  # bucketed: a few compiled shapes for 4 tasks


@pytest.mark.parametrize("family", SERVED, indirect=True)
def test_scoring_only_the_tail_gives_the_full_passes_last_scores(family, ours):
    """`tail` computes the head at each prompt's last positions only: the same numbers as scoring
    every position, for rows of different lengths and tails in one pass (shorter rows than the
    pass's scored span included)."""
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 200, n).tolist() for n in (2, 5, 9, 17, 30, 3)]
    tails = [1, 4, 2, 7, 3, 2]
    full = ours.scorer.score(prompts, top=2)
    part = ours.scorer.score(prompts, top=2, tail=tails)
    for f, p, n in zip(full, part, tails):
        assert p.logprobs.shape == (n,) and p.top_ids.shape == (n, 2)
        np.testing.assert_allclose(p.logprobs, f.logprobs[-n:], atol=1e-5)
        np.testing.assert_array_equal(p.top_ids, f.top_ids[-n:])
        np.testing.assert_allclose(p.top_logprobs, f.top_logprobs[-n:], atol=1e-5)
    with pytest.raises(ValueError, match="tail 5 for a prompt of 5 tokens"):
        ours.scorer.score([prompts[1]], tail=[5])


@pytest.fixture(scope="module")
def served(family, ours):
    """device_serve.py's app over the same Generator (shared compiled programs), on 127.0.0.1."""
    from mesh_transformer.serve import Engine, create_app
    from tests.serving import KEY, start_server

    engine = Engine(ours._generator, ours.tokenizer, max_batch=8, chunk=8).start()
    server, url = start_server(create_app(engine, model_name="tiny", api_key=KEY))
    yield url
    server.should_exit = True
    engine.stop()


@pytest.mark.parametrize("family", SERVED, indirect=True)
def test_local_completions_against_our_server_matches_hflm(family, served, manager, monkeypatch):
    """lm-eval's `local-completions` (token ids, echo, logprobs 1, max_tokens 1; generation by text)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from tests.serving import KEY

    case, path, hf_results = family
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    seq = json.loads((path / "config.json").read_text()).get("n_positions") or 64
    api = LocalCompletionsAPI(base_url=f"{served}/v1/completions", model="tiny", tokenizer_backend="huggingface",
                              tokenizer=str(path), max_length=seq, batch_size=8, max_retries=1)
    # local-completions keeps one token of the context for the one it asks the server to generate, so
    # windows that HFLM cuts at 64 tokens it cuts at 62: compare the tasks whose requests fit both
    # (generation through the server once: for GPT-J)
    tasks = ("tiny_lambada", "tiny_qa") if case == "gptj" else ("tiny_lambada",)
    results = evaluate(api, manager, tasks)
    assert_same_answers(results, hf_results, tasks)


@pytest.mark.parametrize("family", SERVED[:1], indirect=True)
def test_a_lora_adapter_evaluates_as_hflm_with_peft(family, manager, tasks_dir, tmp_path, monkeypatch):
    """PEFT adapters evaluated four ways: lm-eval's `local-completions` naming one as the model of
    our server, which serves it unmerged beside the base (device_serve.py --lora-modules tuned=DIR);
    eval_harness.py --lora-adapter DIR (merged); eval_harness.py --lora-modules tuned=DIR other=DIR
    --with-base (the base and each adapter in turn over one load, unmerged, a generating task too);
    and lm-eval's HFLM with peft=DIR, the oracle. The same log-likelihoods, greedy flags,
    generations and accuracies; and each adapter changes them."""
    import transformers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    import eval_harness
    from mesh_transformer import loading
    from mesh_transformer.serve import Engine, create_app
    from tests.helpers import FAMILY_CASES, save_peft_adapters
    from tests.serving import KEY, start_server

    case, path, base_results = family
    tasks = ("tiny_lambada", "tiny_piqa", "tiny_qa")
    cls = getattr(transformers, FAMILY_CASES[case][1])
    dirs = save_peft_adapters(path, cls, {"tuned": (4, 8, ["q_proj", "v_proj", "fc_in"]),
                                          "other": (2, 4, ["k_proj", "out_proj", "fc_out"])}, tmp_path, scale_b=20.0)
    adapter = dirs["tuned"]
    oracles = {name: evaluate(HFLM(pretrained=str(path), peft=d, dtype="float32", batch_size=8, device="cpu"),
                              manager, tasks) for name, d in dirs.items()}
    oracle = oracles["tuned"]
    for name in dirs:
        assert answers(oracles[name], "tiny_lambada") != answers(base_results, "tiny_lambada"), name

    every = tmp_path / "every.json"
    assert eval_harness.main(["--hf", str(path), "--lora-modules", *(f"{n}={d}" for n, d in dirs.items()),
                              "--with-base", "--mp", "2", "--dp", "1", "--dtype", "float32", "--tasks", ",".join(tasks),
                              "--include-path", str(tasks_dir), "--log-samples", "--bootstrap-iters", "0",
                              "--output", str(every)]) == 0
    results = json.loads(every.read_text())
    assert list(results) == ["base", "tuned", "other"]
    assert_same_answers(results["base"], base_results, tasks)
    for name in dirs:
        assert_same_answers(results[name], oracles[name], tasks)

    out = tmp_path / "merged.json"
    assert eval_harness.main(["--hf", str(path), "--lora-adapter", adapter, "--mp", "2", "--dp", "1", "--dtype",
                              "float32", "--tasks", ",".join(tasks), "--include-path", str(tasks_dir),
                              "--log-samples", "--bootstrap-iters", "0", "--output", str(out)]) == 0
    assert_same_answers(json.loads(out.read_text()), oracle, tasks)

    loaded = loading.load(hf=str(path), mp=2, dp=1, dtype="float32")
    engine = Engine(loaded.generator(adapters=[("tuned", adapter)]), loaded.tokenizer, max_batch=8, chunk=8).start()
    server, url = start_server(create_app(engine, model_name="tiny", api_key=KEY))
    try:
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
        api = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model="tuned", tokenizer_backend="huggingface",
                                  tokenizer=str(path), max_length=loaded.config.seq, batch_size=8, max_retries=1)
        # (tiny_lambada alone: local-completions cuts tiny_piqa's long windows shorter than HFLM, as above)
        assert_same_answers(evaluate(api, manager, tasks[:1]), oracle, tasks[:1])
    finally:
        server.should_exit = True
        engine.stop()


@pytest.mark.parametrize("family", SERVED[:1], indirect=True)
def test_echo_through_the_openai_client(family, served, ours):
    """echo with max_tokens 0 and 3, string and token-id prompts, several per request, top 2
    alternatives: the prompt's tokens, offsets and log-probabilities (the first null) as OpenAI gives them."""
    from openai import OpenAI
    from tests.serving import KEY

    client = OpenAI(base_url=f"{served}/v1", api_key=KEY, max_retries=0, timeout=60)
    tok = ours.tokenizer
    texts = ["Q: What do bees make?\nA:", "The dog waited by the door"]
    ids = [tok.encode(t) for t in texts]
    expected = ours.scorer.score(ids, top=2)
    for prompt, max_tokens in ((texts, 0), (ids, 0), (texts, 3)):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, echo=True,
                                      logprobs=2, temperature=0)
        assert len(r.choices) == 2
        plain = client.completions.create(model="tiny", prompt=ids, max_tokens=max_tokens, temperature=0) \
            if max_tokens else None  # the same request without echo
        for choice, text, p, want in zip(r.choices, texts, ids, expected):
            lp = choice.logprobs
            assert choice.text.startswith(text) and (max_tokens or choice.text == text)
            assert lp.tokens[:len(p)] == [tok.decode([t]) for t in p]
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            np.testing.assert_allclose(lp.token_logprobs[1:len(p)], want.logprobs, atol=1e-6)
            for top, best in zip(lp.top_logprobs[1:len(p)], want.top_logprobs):  # (two ids may share a text)
                assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(float(best[0]), abs=1e-6)
            assert lp.text_offset[:len(p)] == [len(tok.decode(p[:i])) for i in range(len(p))]
            assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(p) + max_tokens \
                or choice.finish_reason == "stop"
            if max_tokens:  # the prompt, then what the same request without echo gives
                assert choice.text == text + plain.choices[choice.index].text
                assert lp.text_offset[len(p)] == len(text)
            else:
                assert choice.finish_reason == "length" and r.usage.completion_tokens == 0
    # n > 1: prompt i's choices are i*n .. i*n+n-1, each the prompt (same scores), then its own sample
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=3, echo=True, logprobs=1, n=2,
                                  temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for choice in r.choices:
        text, p, want = texts[choice.index // 2], ids[choice.index // 2], expected[choice.index // 2]
        assert choice.text.startswith(text)
        np.testing.assert_allclose(choice.logprobs.token_logprobs[1:len(p)], want.logprobs, atol=1e-6)
        assert len(choice.logprobs.tokens) == len(p) + 3 or choice.finish_reason == "stop"
    assert r.usage.prompt_tokens == sum(len(p) for p in ids)



@pytest.mark.parametrize("family", SERVED[:1], indirect=True)
def test_eval_harness_script_prints_the_table_and_writes_json(family, tasks_dir, tmp_path, capsys):
    import eval_harness

    _, path, hf_results = family
    out = tmp_path / "results.json"
    code = eval_harness.main(["--hf", str(path), "--mp", "2", "--dp", "2", "--dtype", "float32", "--tasks",
                              "tiny_lambada,tiny_piqa", "--include-path", str(tasks_dir), "--log-samples",
                              "--bootstrap-iters", "0", "--output", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "|tiny_lambada|" in printed.replace(" ", "") and "acc_norm" in printed
    assert_same_answers(json.loads(out.read_text()), hf_results, ("tiny_lambada", "tiny_piqa"))


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "tiny_lambda"], "unknown task 'tiny_lambda': not one of lm-eval's tasks nor in the include path "
                                 "(did you mean 'tiny_lambada'?)"),
    (["--tasks", "tiny_lambada", "--include-path", "EMPTY"], "holds no task YAML files"),
    (["--tasks", "tiny_lambada,tiny_broken"], "task 'tiny_broken': its data cannot be loaded (FileNotFoundError"),
    (["--tasks", "tiny_lambada", "--lora-modules", "a=x", "--lora-adapter", "y"],
     "--lora-adapter merges an adapter into the base and --lora-modules evaluates adapters made for the base"),
    (["--tasks", "tiny_lambada", "--lora-modules", "a"], "--lora-modules takes NAME=PATH items, got 'a'"),
])
def test_bad_tasks_are_one_clear_error(argv, message, tasks_dir, manager, tmp_path, capsys):
    """Checked before any weights load (--hf names a directory that does not exist)."""
    import eval_harness

    (tmp_path / "empty").mkdir()
    argv = [str(tmp_path / "empty") if a == "EMPTY" else a for a in argv]
    if "--include-path" not in argv:
        argv += ["--include-path", str(tasks_dir)]
    assert eval_harness.main(["--hf", str(tmp_path / "no-such-model"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.mark.parametrize("flags, message", [
    (("--limit", "-1"), "--limit must be above 0 (examples per task, or a fraction of them below 1); got -1"),
    (("--num-fewshot", "-1"), "--num-fewshot must be at least 0; got -1"),  # (lm-eval ran it, reporting -1 shots)
    (("--batch-size", "0"), "--batch-size must be at least 1; got 0"),
    (("--max-gen-toks", "0"), "--max-gen-toks must be at least 1; got 0"),
    (("--bootstrap-iters", "-1"), "--bootstrap-iters must be at least 0; got -1"),
])
def test_a_number_no_evaluation_can_use_is_one_error_naming_its_flag(flags, message, capsys):
    """At parse time, before lm-eval or the weights load (there is no model at this path); --limit -1
    was a ValueError traceback from inside lm-eval."""
    import eval_harness
    argv = ["--hf", "/no/such/model", "--tasks", "tiny_lambada", *flags]
    assert f"error: {message}\n" in refusal(eval_harness.main, argv, capsys)


def test_device_train_logs_eval_harness_tasks(tmp_path, tasks_dir, train_data):
    """eval_harness_tasks every eval_every steps on the training params (dp4 x mp2): eval/<task>/<metric>
    in metrics.jsonl, the same numbers eval_harness.py gives on the checkpoint saved at that step,
    and the plot's second panel."""
    from mesh_transformer import loading
    from mesh_transformer.evaluate import harness
    from mesh_transformer.evaluate.lm import MeshLM
    from mesh_transformer.train.metrics import read_metrics
    from tests.test_device_train import device_train, write_config

    config = write_config(tmp_path, train_data, total_steps=2, ckpt_every=2, val_set={},
                          eval_harness_tasks=["tiny_lambada"], eval_every=2,
                          eval_include_path=str(tasks_dir))
    code, out = device_train(config, "--plot", str(tmp_path / "loss.png"))
    assert code == 0, out
    rows = [r for r in read_metrics(tmp_path / "logs" / "metrics.jsonl") if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in rows] == [2]
    logged = {k: v for k, v in rows[0].items() if k.startswith("eval/")}
    assert set(logged) == {"eval/tiny_lambada/acc", "eval/tiny_lambada/perplexity"}
    lm = MeshLM.from_loaded(loading.load(ckpt=str(tmp_path / "ckpt"), mp=2, dp=4, dtype="float32"))
    again = harness.metrics(harness.run(lm, ["tiny_lambada"], harness.task_manager(tasks_dir, TASKS),
                                        bootstrap_iters=0))
    assert logged.keys() == again.keys()
    for key, value in again.items():
        assert logged[key] == pytest.approx(value, rel=1e-4), key
    assert (tmp_path / "loss.png").stat().st_size > 0


@pytest.fixture(scope="module")
def train_data(tmp_path_factory):
    from tests.test_device_train import ROOT
    out = tmp_path_factory.mktemp("data")
    subprocess.run([sys.executable, "create_finetune_dataset.py", "data/corpus/stories.txt", "train", "--output-dir",
                    str(out), "--seq", "32"], cwd=ROOT, check=True, capture_output=True)
    return out
