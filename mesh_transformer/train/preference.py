"""Direct Preference Optimization (Rafailov et al. 2023, arXiv 2305.18290): training on pairs of
completions of one prompt, one preferred ("chosen") and one not ("rejected"), against a frozen
reference model, with no reward model and no sampling.

For a pair, with log pi(y|x) the summed log-probability of a completion's tokens under the policy
and log ref(y|x) under the reference, each completion's implicit reward is

    r(y) = beta * (log pi(y|x) - log ref(y|x))

and the loss is -log sigmoid(r(chosen) - r(rejected)) (the paper's eq. 7; TRL's "sigmoid" loss),
averaged over pairs.

Rows come in pairs: row 2i of a batch is pair i's chosen completion, row 2i+1 its rejected one
(the dataset and loader keep them so; `data.Loader` with a preference dataset). A pair whose
chosen row trains on no token (a padding pair of a validation pass) counts for nothing.

The config's `"dpo"` object: {"beta": 0.1} (TRL's default). The
reference is the model the run started from: with LoRA the base with the adapters off (no second
copy of the weights), otherwise a frozen copy in the compute dtype.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from mesh_transformer.config import ConfigError, check_object

KEYS = ("beta",)
# What a checkpoint of a DPO run without LoRA records about its reference (as LoRA's about its base):
# where it came from (`lora.base_reference`) and a fingerprint of its weights.
REFERENCE_KEY, REFERENCE_FINGERPRINT_KEY = "dpo_reference", "dpo_reference_fingerprint"
# The step's metrics, as TRL's DPOTrainer logs them (each a mean over the batch's pairs).
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class DpoConfig:
    beta: float = 0.1

    @classmethod
    def from_dict(cls, raw: Any) -> "DpoConfig":
        """Parse the config's "dpo" object; ConfigError naming `dpo.<key>`."""
        check_object(raw, "dpo", KEYS, '{"beta": number}')
        beta = raw.get("beta", cls.beta)
        if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not beta > 0:
            raise ConfigError(f"config key 'dpo.beta' must be a positive number, got {json.dumps(beta)}")
        return cls(float(beta))


def pair_sums(logps, ref_logps, trained, config: DpoConfig) -> tuple[jax.Array, dict, jax.Array]:
    """Per-device sums over the pairs of a block of rows.

    logps, ref_logps [2k] (each row's completion log-probability under the policy and the
    reference; rows alternate chosen, rejected), trained [2k] (tokens trained on per row)
    -> (loss sum, {metric: sum} for `METRICS`, number of pairs counted).
    """
    chosen, rejected = logps[0::2], logps[1::2]
    ref = jax.lax.stop_gradient(ref_logps)
    reward_chosen = config.beta * (chosen - ref[0::2])
    reward_rejected = config.beta * (rejected - ref[1::2])
    margin = reward_chosen - reward_rejected
    losses = -jax.nn.log_sigmoid(margin)
    counted = (trained[0::2] > 0).astype(jnp.float32)
    values = {"loss": losses, "rewards/chosen": reward_chosen, "rewards/rejected": reward_rejected,
              "rewards/accuracies": (margin > 0).astype(jnp.float32), "rewards/margins": margin,
              "logps/chosen": chosen, "logps/rejected": rejected}
    sums = {name: jnp.sum(jax.lax.stop_gradient(v) * counted) for name, v in values.items()}
    return jnp.sum(losses * counted), sums, jnp.sum(counted)
