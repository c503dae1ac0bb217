"""lm-eval tasks during training (`eval_harness_tasks`, every `eval_every` steps, default `val_every`).

    evaluator = TrainingEvaluator(config, trainer)       # checks the tasks and their data now
    evaluator(state.params, tokenizer_spec)             # -> {"eval/<task>/<metric>": value, ...}

Runs on the parameters as training holds them (sharded float32 master weights, stacked layers,
ZeRO or LoRA as configured): loglikelihoods through `scoring.Scorer.for_trainer`, compiled once
and reused at every evaluation. Tasks that generate get a `Generator` over a copy of the current
weights in the compute dtype, made for the evaluation and released after it (not with LoRA: run
eval_harness.py on the checkpoint). Local tasks come from `eval_include_path` (a folder of task
YAMLs, see README "Evaluate").
"""
from __future__ import annotations

from typing import Optional

from mesh_transformer.config import Config
from mesh_transformer.evaluate import harness
from mesh_transformer.evaluate.scoring import Scorer


class TrainingEvaluator:
    def __init__(self, config: Config, trainer):
        t = config.train
        self.config, self.trainer = config, trainer
        self.names = harness.task_names(t.eval_harness_tasks)
        self.manager = harness.task_manager(t.eval_include_path, self.names)
        harness.load_tasks(self.names, self.manager)  # an unknown task fails the run now, not hours in
        self.scorer: Optional[Scorer] = None
        self._generator = None
        self._tokenizers: dict = {}

    def __call__(self, params, tokenizer_spec: str) -> dict[str, float]:
        from mesh_transformer.evaluate.lm import MeshLM
        from mesh_transformer.io.checkpoint import checkpoint_dir
        from mesh_transformer.io.tokenizer import load_tokenizer
        from mesh_transformer.loading import end_of_text_ids

        if self.scorer is None:
            self.scorer = Scorer.for_trainer(self.trainer, params)
        self.scorer.use(params)
        if tokenizer_spec not in self._tokenizers:
            self._tokenizers[tokenizer_spec] = load_tokenizer(tokenizer_spec)
        tokenizer = self._tokenizers[tokenizer_spec]
        lm = MeshLM(self.scorer, tokenizer, generator=lambda: self._generator_for(params),
                    eos_token_ids=end_of_text_ids(tokenizer, checkpoint_dir(self.config.train)) or None)
        try:
            results = harness.run(lm, self.names, self.manager, bootstrap_iters=0, seed=self.config.train.seed)
        finally:
            if self._generator is not None:
                self._generator.params = None  # the copy lives for one evaluation only
        return harness.metrics(results)

    def _generator_for(self, params):
        """A Generator over a compute-dtype copy of `params` (the same compiled programs each time)."""
        from mesh_transformer.generate import Generator

        if self.trainer.lora is not None:
            raise harness.EvalError("tasks that generate text do not run during a LoRA run "
                                    "(eval_harness_tasks); evaluate its checkpoint with eval_harness.py")
        if self._generator is None:
            self._generator = Generator(self.config.model, params, self.trainer.mesh)
        else:
            self._generator.params = self._generator._place(params, donate=False)
        return self._generator
