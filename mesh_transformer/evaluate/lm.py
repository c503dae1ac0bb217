"""Our model as an lm-evaluation-harness model: `MeshLM`, an `lm_eval.api.model.TemplateLM`.

    lm = MeshLM.from_loaded(loading.load(hf="./gpt-j-6b", mp=8))
    lm_eval.simple_evaluate(model=lm, tasks=["lambada_openai"])

Requests are handled as lm-eval's `--model hf` (HFLM) handles them, so the numbers are the ones a
user of the harness expects: the same tokenization (the tokenizer's special tokens by default,
trailing spaces of a context moved to the continuation, an empty context scored after the prefix
token), the same left truncation to `max_length` (the model's context), the same rolling windows
for perplexity, greedy generation stopped and cut at the task's `until` strings (and EOS). The
work runs on the mesh: loglikelihoods through `scoring.Scorer` (sorted by length, bucketed,
batched), generations through `generate.Generator` (batched by generation settings).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (_add_special_kwargs, handle_stop_sequences, has_bos_prefix,
                                  normalize_gen_kwargs, postprocess_generated_text)

from mesh_transformer.config import ConfigError
from mesh_transformer.evaluate.scoring import Scorer, scorer_for
from mesh_transformer.generate import MAX_STOPS, SamplingOptions

DEFAULT_MAX_GEN_TOKS = 256  # HFLM's


class MeshLM(TemplateLM):
    """lm-eval's model interface over a `Scorer` (loglikelihoods) and a `Generator` factory
    (generate_until; called only when a task generates, so scoring-only runs build none).

    `generator`: a Generator, or a function that makes one. `batch_size`: prompts per forward pass / generation batch (default: as many as fit
    `scoring.DEFAULT_BATCH_TOKENS` positions for scoring, 16 for generation). `adapter`: a LoRA
    adapter of the generator's bank (`lora.ServedAdapter`) every request runs with, unmerged
    (`under`); None: the base. `eos_token_ids`: what ends a generation (default: the tokenizer's
    EOS; `loading.LoadedModel.eos_token_ids` adds a generation config's, as HF `generate` stops)."""

    def __init__(self, scorer: Scorer, tokenizer, generator=None, batch_size: Optional[int] = None,
                 max_length: Optional[int] = None, add_bos_token: Optional[bool] = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, adapter=None, eos_token_ids: Optional[tuple] = None):
        super().__init__()
        self.scorer, self.tokenizer, self._generator, self.adapter = scorer, tokenizer, generator, adapter
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else () if eos is None else (eos,)
        self.batch_size = batch_size
        self.max_length = max_length or scorer.seq
        if self.max_length > scorer.seq:
            raise ValueError(f"max_length {self.max_length} is longer than the model's context ({scorer.seq})")
        self.add_bos_token = add_bos_token
        self.max_gen_toks = max_gen_toks

    @classmethod
    def from_loaded(cls, model, batch_size: Optional[int] = None, adapters=(), **kw) -> "MeshLM":
        """Over a `loading.LoadedModel`: its weights move into one Generator, which both scoring and
        generation use (held once on the devices). `adapters`: [(name, PEFT adapter directory)]
        served beside the base in a bank of one entry, for `under(name)`."""
        gen = model.generator(adapters=list(adapters), slots=1) if adapters else model.generator()
        return cls.from_generator(gen, model.tokenizer, batch_size=batch_size,
                                  **{"eos_token_ids": model.eos_token_ids or None, **kw})

    def under(self, name: Optional[str]) -> "MeshLM":
        """This model with the LoRA adapter called `name` from the generator's bank (None: the base):
        the same weights and compiled programs, every request under that adapter."""
        found = None
        if name is not None:
            gen = self._generator
            known = {a.name: a for a in gen.adapters.adapters} if getattr(gen, "adapters", None) else {}
            if name not in known:
                raise ValueError(f"adapter {name!r} is not one of this model's ({', '.join(known) or 'none'})")
            found = known[name]
        return MeshLM(self.scorer, self.tokenizer, self._generator, self.batch_size, self.max_length,
                      self.add_bos_token, self.max_gen_toks, adapter=found, eos_token_ids=self.eos_token_ids)

    @classmethod
    def from_generator(cls, gen, tokenizer, batch_size: Optional[int] = None, **kw) -> "MeshLM":
        """Over a `generate.Generator` (a server's, say): scoring shares its weights and compiled programs."""
        if gen.config.classifier:
            raise ConfigError(f"a classifier (num_labels {gen.config.num_labels}) neither generates nor scores "
                              f"text: lm-eval's tasks need a language model")
        return cls(scorer_for(gen), tokenizer, generator=gen, batch_size=batch_size, **kw)

    # ---- what lm-eval asks of a model ----------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: BOS if the tokenizer has one, else EOS (as HFLM)."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "tokenizer").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, left_truncate_len=None,
                   **kwargs) -> list[int]:
        kw = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            kw["add_special_tokens"] = False  # the string brings its own BOS
        ids = self.tokenizer.encode(string, **kw)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: [(cache key, context ids, continuation ids)] -> [(log p(continuation), greedy?)].

        Each input is context + continuation cut from the left to max_length + 1 tokens (HFLM's
        window); the continuation is its last len(continuation) tokens."""
        windows, conts = [], []
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("lm-eval sent an empty context or continuation")
            windows.append((context + continuation)[-(self.max_length + 1):])
            conts.append(continuation)
        results = []
        tails = [min(len(c), len(w) - 1) for w, c in zip(windows, conts)]
        for window, n, scores in zip(windows, tails, self.scorer.score(windows, top=1, rows=self.batch_size,
                                                                       tail=tails, adapter=self.adapter)):
            results.append((float(scores.logprobs.astype("float64").sum()),
                            bool((scores.top_ids[:, 0] == window[-n:]).all())))
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Perplexity: each text in disjoint windows of max_length tokens (lm-eval's rolling windows),
        all windows of all texts scored together."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            rolling = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(text),
                                                         prefix_token=self.prefix_token_id,
                                                         max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(lm_utils.make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Generate for each (context, generation kwargs); requests with the same kwargs share batches.
        Greedy unless the task samples (do_sample / temperature > 0)."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[repr(sorted(req.args[1].items()))].append(i)
        out: list[Optional[str]] = [None] * len(requests)
        eos = None if self.eot_token_id is None else self.tokenizer.decode([self.eot_token_id])
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            options = self._sampling_options(kwargs, until)
            prompts = [self.tok_encode(requests[i].args[0]) for i in indices]
            for i, text in zip(indices, self._generate(prompts, options)):
                out[i] = postprocess_generated_text(text, until, None)
                self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out

    def _sampling_options(self, kwargs: dict, until: list[str]) -> SamplingOptions:
        max_new = int(kwargs.pop("max_gen_toks"))
        if max_new >= self.max_length:
            raise ValueError(f"the task asks for {max_new} new tokens but the model's context is "
                             f"{self.max_length} tokens")
        temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
        # stop strings end rows early on the device (at most MAX_STOPS); the text is cut at every one after
        stops = tuple(s for s in until if s)[:MAX_STOPS]
        return SamplingOptions(max_new_tokens=max_new, temperature=temperature, top_p=float(kwargs.get("top_p", 1.0)),
                               top_k=int(kwargs.get("top_k", 0) or 0), min_p=float(kwargs.get("min_p", 0.0) or 0.0),
                               stop=stops, eos_token_id=self.eos_token_ids or None,
                               seed=int(kwargs.get("seed", 1234)))

    def _generate(self, prompts: list[list[int]], options: SamplingOptions) -> list[str]:
        """Texts of the generated tokens (special tokens skipped, as HFLM decodes), in prompt order,
        in batches of similar length."""
        if self._generator is None:
            raise ValueError("this model was built without a generator; generate_until tasks need one")
        gen = self._generator if hasattr(self._generator, "generate") else self._generator()  # or a factory
        names = None
        if self.adapter is not None:  # its entry: the bank's one, rewritten when another adapter held it
            if gen.residents[1] is not self.adapter:
                gen.write_adapter(1, self.adapter)
            names = [self.adapter.name] * len(prompts)
        size = self.batch_size or 16
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        texts: list[Optional[str]] = [None] * len(prompts)
        for start in range(0, len(order), size):
            group = order[start:start + size]
            seqs = gen.generate([prompts[i] or [self.prefix_token_id] for i in group], options, self.tokenizer,
                                adapters=names[:len(group)] if names else None)
            for i, seq in zip(group, seqs):
                texts[i] = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        return texts
