"""Evaluation: score prompts on the mesh, and run lm-evaluation-harness tasks on our models.

    scoring.py   one forward pass -> per-position log p(next token) and top tokens (`Scorer`);
                 what the evaluator and the server's `echo` share
    lm.py        `MeshLM`, an `lm_eval` model (loglikelihood, loglikelihood_rolling, generate_until)
    harness.py   tasks by name (lm-eval's, or local YAMLs from an include path) -> results; one
                 clear error for an unknown task or data that cannot be loaded

`lm.py` and `harness.py` need lm-eval (`pip install mesh-transformer[eval]`); `scoring.py` does not.
"""
from mesh_transformer.evaluate.scoring import PromptScores, Scorer  # noqa: F401
