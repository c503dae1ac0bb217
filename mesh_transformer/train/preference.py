"""Training on preferences, with no sampling: on pairs, completions of one prompt, one preferred
("chosen") and one not ("rejected"), or (KTO) on unpaired completions each labelled desirable or
not. Five objectives, one config key each (at most one set), under TRL's names and meanings:

- `"dpo"`: Direct Preference Optimization (Rafailov et al. 2023, arXiv 2305.18290) and its
  variants, against a frozen reference model (`DpoConfig`);
- `"cpo"`: Contrastive Preference Optimization (arXiv 2401.08417) and SimPO (arXiv 2405.14734),
  with no reference (`CpoConfig`);
- `"orpo"`: Odds Ratio Preference Optimization (arXiv 2403.07691), with no reference (`OrpoConfig`);
- `"kto"`: Kahneman-Tversky Optimization (arXiv 2402.01306) on unpaired examples, against a frozen
  reference (`KtoConfig`);
- `"reward"`: a reward model (a classifier of one output) trained on the pairs, as TRL's
  RewardTrainer does (`RewardConfig`): what RLHF's policy optimisation then reads.

For a pair, with log pi(y|x) the summed log-probability of a completion's tokens under the policy
and log ref(y|x) under the reference, each completion's log-ratio is h(y) = log pi(y|x) - log ref(y|x),
its implicit reward beta * h(y), and DPO's loss is -log sigmoid(beta * (h(chosen) - h(rejected)))
(the paper's eq. 7; TRL's "sigmoid" loss), averaged over pairs.

The config's `"dpo"` object takes TRL's `DPOConfig` names and meanings:

- `beta` (0.1);
- `loss_type`: one name or a list, `loss_weights` their weights (default 1 each; MPO is
  ["sigmoid", "bco_pair", "sft"] with [0.8, 0.2, 1.0]). The names are the keys of `PAIR_LOSSES`,
  plus "sft": the chosen completions' mean negative log-likelihood per token, over the batch;
- `label_smoothing`: the flip probability of "robust" in [0, 0.5), EXO's epsilon in (0, 1);
- `f_divergence_type` (f-DPO, arXiv 2309.16240): the log-ratios h become f'(exp h) before the
  losses built on their difference; `f_alpha_divergence_coef` for "alpha_divergence";
- `discopop_tau` (0.05): DiscoPOP's temperature;
- `ld_alpha` (LD-DPO, arXiv 2409.06411): tokens past the shorter completion's length count alpha;
- `use_weighting` (WPO, arXiv 2406.11827): each pair's loss weighted by the policy's
  length-normalised probabilities of both completions (held constant in the gradient); not with "sft".

Rows come in pairs: row 2i of a batch is pair i's chosen completion, row 2i+1 its rejected one
(KTO: example i's row and its KL row; the dataset and loader keep them so; `data.Loader` with a
preference dataset). A pair whose chosen row trains on no token (a padding pair of a validation
pass) counts for nothing.

DPO's (and KTO's) reference is the model the run started from: with LoRA the base with the adapters off (no
second copy of the weights), otherwise a frozen copy in the compute dtype.

Every objective (an `Objective`) has `pair_sums(token_logps, reference_token_logps, mask,
log_sum_sq_probs, reduce, nll_scale, labels)`: it takes each position's log-probability of its next
token [2k, T] (and the reference's, for DPO and KTO), the completions' mask [2k, T] (and KTO's row
labels [2k]), and returns (loss sum, {name: sum} for its `sums`, pairs counted), `reduce`d; its
`means` turns sums added up over microbatches or batches into the logged metrics. An NLL term
(DPO's "sft", CPO's, ORPO's) is a mean over the chosen tokens of the whole step:
`nll_scale(objective, mask)` of all its microbatches' rows, pairs per token, turns each
microbatch's NLL sum into its share of that mean as a sum over pairs, so k microbatches equal one
k-times-larger batch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from mesh_transformer.config import PREFERENCE_KEYS, ConfigError, TrainConfig, check_object

# What a checkpoint of a DPO run without LoRA records about its reference (as LoRA's about its base):
# where it came from (`lora.base_reference`) and a fingerprint of its weights.
REFERENCE_KEY, REFERENCE_FINGERPRINT_KEY = "dpo_reference", "dpo_reference_fingerprint"
# The step's metrics, as TRL's DPOTrainer logs them (each a mean over the batch's pairs).
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class Pairs:
    """A block of pairs, one value per pair: the completions' log-ratios h (policy minus reference
    log-probability), their f-DPO scores f'(exp h) (h itself under reverse KL, plain DPO), and the
    completions' trained-token counts (at least 1)."""
    chosen_ratio: jax.Array
    rejected_ratio: jax.Array
    chosen_score: jax.Array
    rejected_score: jax.Array
    chosen_tokens: jax.Array
    rejected_tokens: jax.Array

    @property
    def margin(self):
        return self.chosen_score - self.rejected_score

    @property
    def mean_margin(self):
        """The scores' difference per token of each completion (IPO's and "sigmoid_norm"'s)."""
        return self.chosen_score / self.chosen_tokens - self.rejected_score / self.rejected_tokens


# Each loss of one pair, as the papers (and TRL) write it.
def _sigmoid(p: Pairs, c: "DpoConfig"):  # DPO, eq. 7
    return -jax.nn.log_sigmoid(c.beta * p.margin)


def _hinge(p: Pairs, c: "DpoConfig"):  # SLiC (arXiv 2305.10425)
    return jax.nn.relu(1 - c.beta * p.margin)


def _ipo(p: Pairs, c: "DpoConfig"):  # IPO (arXiv 2310.12036) eq. 17, beta as tau, per-token scores
    return jnp.square(p.mean_margin - 1 / (2 * c.beta))


def _exo_pair(p: Pairs, c: "DpoConfig"):  # EXO (arXiv 2402.00856) eq. 16 for two completions
    z, eps = c.beta * p.margin, c.label_smoothing
    return (jax.nn.sigmoid(z) * (jax.nn.log_sigmoid(z) - math.log1p(-eps))
            + jax.nn.sigmoid(-z) * (jax.nn.log_sigmoid(-z) - math.log(eps)))


def _nca_pair(p: Pairs, c: "DpoConfig"):  # NCA (arXiv 2402.05369)
    chosen, rejected = c.beta * p.chosen_ratio, c.beta * p.rejected_ratio
    return -jax.nn.log_sigmoid(chosen) - 0.5 * jax.nn.log_sigmoid(-chosen) - 0.5 * jax.nn.log_sigmoid(-rejected)


def _robust(p: Pairs, c: "DpoConfig"):  # robust DPO (arXiv 2403.00409): labels flipped with probability eps
    z, eps = c.beta * p.margin, c.label_smoothing
    return (-(1 - eps) * jax.nn.log_sigmoid(z) + eps * jax.nn.log_sigmoid(-z)) / (1 - 2 * eps)


def _bco_pair(p: Pairs, c: "DpoConfig"):  # BCO (arXiv 2404.04656), pairwise
    return -jax.nn.log_sigmoid(c.beta * p.chosen_ratio) - jax.nn.log_sigmoid(-c.beta * p.rejected_ratio)


def _sppo_hard(p: Pairs, c: "DpoConfig"):  # SPPO (arXiv 2405.00675), winner probability 1
    return jnp.square(p.chosen_ratio - 0.5 / c.beta) + jnp.square(p.rejected_ratio + 0.5 / c.beta)


def _apo_zero(p: Pairs, c: "DpoConfig"):  # APO (arXiv 2408.06266) eq. 7: chosen better than the model's own
    return 1 - jax.nn.sigmoid(c.beta * p.chosen_ratio) + jax.nn.sigmoid(c.beta * p.rejected_ratio)


def _apo_down(p: Pairs, c: "DpoConfig"):  # APO eq. 8: chosen worse than the model's own
    return (jax.nn.sigmoid(c.beta * p.chosen_ratio)
            + 1 - jax.nn.sigmoid(c.beta * (p.chosen_ratio - p.rejected_ratio)))


def _discopop(p: Pairs, c: "DpoConfig"):  # DiscoPOP (arXiv 2406.08414) eq. 5
    z = c.beta * p.margin
    blend = jax.nn.sigmoid(z / c.discopop_tau)
    return -jax.nn.log_sigmoid(z) * (1 - blend) + jnp.exp(-z) * blend


def _sigmoid_norm(p: Pairs, c: "DpoConfig"):  # DPO on per-token scores
    return -jax.nn.log_sigmoid(c.beta * p.mean_margin)


PAIR_LOSSES: dict[str, Callable[[Pairs, "DpoConfig"], jax.Array]] = {
    "sigmoid": _sigmoid, "hinge": _hinge, "ipo": _ipo, "exo_pair": _exo_pair, "nca_pair": _nca_pair,
    "robust": _robust, "bco_pair": _bco_pair, "sppo_hard": _sppo_hard, "apo_zero": _apo_zero,
    "apo_down": _apo_down, "discopop": _discopop, "sigmoid_norm": _sigmoid_norm}
SFT = "sft"
LOSS_TYPES = (*PAIR_LOSSES, SFT)
# Losses built on the scores' difference, which f-DPO may change; the others use the log-ratios.
F_DIVERGENCE_LOSSES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", SFT}


def _alpha_score(coef: float) -> Callable:
    if abs(coef - 1.0) < 1e-6:  # the limit: f'(t) = log t
        return lambda h: h
    return lambda h: (jnp.exp(jnp.minimum((coef - 1) * h, 80.0)) - 1) / (coef - 1)


# f'(t) at t = exp(h), for each f-divergence (f-DPO's Table 1).
F_DIVERGENCES: dict[str, Callable[[float], Callable]] = {
    "reverse_kl": lambda coef: lambda h: h,
    "forward_kl": lambda coef: lambda h: 1 - jnp.exp(-h),
    "js_divergence": lambda coef: lambda h: math.log(2) + jax.nn.log_sigmoid(h),
    "alpha_divergence": _alpha_score,
}
KEYS = ("beta", "loss_type", "loss_weights", "label_smoothing", "f_divergence_type", "f_alpha_divergence_coef",
        "discopop_tau", "ld_alpha", "use_weighting")
SHAPE = '{"beta": number, "loss_type": name or [names], ...}'


def _number(raw: dict, key: str, default: float, ok: Callable[[float], bool], what: str, parent: str = "dpo") -> float:
    value = raw.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not ok(value):
        raise ConfigError(f"config key '{parent}.{key}' must be {what}, got {json.dumps(value)}")
    return float(value)


def _loss_types(raw: dict) -> tuple[str, ...]:
    names = raw.get("loss_type", "sigmoid")
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"config key 'dpo.loss_type' must be a loss name or a non-empty list of them, "
                          f"got {json.dumps(raw.get('loss_type'))}")
    for name in names:
        if name in ("aot", "aot_unpaired"):
            raise ConfigError(f"config key 'dpo.loss_type': {name!r} is not supported (it sorts log-ratios across "
                              f"each device's batch, so its loss depends on how the batch is split)")
        if name not in LOSS_TYPES:
            raise ConfigError(f"config key 'dpo.loss_type': unknown loss {name!r} (one of {', '.join(LOSS_TYPES)})")
    if len(set(names)) != len(names):
        raise ConfigError(f"config key 'dpo.loss_type' names a loss twice: {json.dumps(names)}")
    return tuple(names)


def _loss_weights(raw: dict, types: tuple[str, ...]) -> tuple[float, ...]:
    weights = raw.get("loss_weights")
    if weights is None:
        return (1.0,) * len(types)
    if (not isinstance(weights, list) or len(weights) != len(types)
            or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights)):
        raise ConfigError(f"config key 'dpo.loss_weights' must be a list of {len(types)} numbers, one per "
                          f"'dpo.loss_type', got {json.dumps(weights)}")
    return tuple(float(w) for w in weights)


def _label_smoothing(raw: dict, types: tuple[str, ...]) -> float:
    eps = _number(raw, "label_smoothing", 0.0, lambda v: 0 <= v < 1, "a number in [0, 1)")
    if "robust" in types and not eps < 0.5:
        raise ConfigError(f"config key 'dpo.label_smoothing' must be in [0, 0.5) for the 'robust' loss, got {eps}")
    if "exo_pair" in types and eps == 0:
        raise ConfigError("config key 'dpo.label_smoothing' must be above 0 for the 'exo_pair' loss "
                          "(EXO's epsilon; its paper suggests 1e-3)")
    if eps and not {"robust", "exo_pair"} & set(types):
        raise ConfigError(f"config key 'dpo.label_smoothing' applies to the 'robust' and 'exo_pair' losses only, "
                          f"not {json.dumps(list(types))}")
    return eps


def _f_divergence(raw: dict, types: tuple[str, ...]) -> str:
    name = raw.get("f_divergence_type", "reverse_kl")
    if name not in F_DIVERGENCES:
        raise ConfigError(f"config key 'dpo.f_divergence_type' must be one of {', '.join(F_DIVERGENCES)}, "
                          f"got {json.dumps(name)}")
    others = [t for t in types if t not in F_DIVERGENCE_LOSSES]
    if name != "reverse_kl" and others:
        raise ConfigError(f"config key 'dpo.f_divergence_type' {name!r} does not apply to the loss {others[0]!r} "
                          f"(only to {', '.join(sorted(F_DIVERGENCE_LOSSES - {SFT}))})")
    if name != "reverse_kl" and types == (SFT,):
        raise ConfigError(f"config key 'dpo.f_divergence_type' {name!r} does nothing to the 'sft' loss alone")
    if "f_alpha_divergence_coef" in raw and name != "alpha_divergence":
        raise ConfigError("config key 'dpo.f_alpha_divergence_coef' applies to f_divergence_type "
                          f"'alpha_divergence' only, not {name!r}")
    if "discopop_tau" in raw and "discopop" not in types:
        raise ConfigError(f"config key 'dpo.discopop_tau' applies to the 'discopop' loss only, "
                          f"not {json.dumps(list(types))}")
    return name


class Objective:
    """What the trainer asks of a preference objective (each config below is one): `pair_sums` of a
    block of rows, and these."""
    needs_reference = False  # reads a frozen reference's log-probabilities (DPO, KTO)
    needs_sum_sq = False  # reads log sum_v p(v)^2 at each position (WPO)
    needs_labels = False  # reads each row's label (KTO's unpaired examples)
    kl_rows: Optional[str] = None  # KTO: the odd rows are KL rows, "read" (with no gradient) or "unread"
    reads_rewards = False  # a reward model's: each row's score at its last token, not log-probabilities
    metrics: tuple = METRICS  # what is logged

    @property
    def sums(self) -> tuple:
        """The names of `pair_sums`' sums, added up over microbatches and validation batches."""
        return self.metrics

    def means(self, sums: dict, count) -> dict:
        """{metric: value} from the added-up sums over `count` pairs: each sum's mean per pair."""
        return {k: sums[k] / count for k in self.metrics}

    def nll_mask(self, mask):
        """The tokens an NLL term covers, or None without one."""
        return None


@dataclass(frozen=True)
class DpoConfig(Objective):
    beta: float = 0.1
    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] = (1.0,)
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05
    ld_alpha: Optional[float] = None
    use_weighting: bool = False

    @classmethod
    def from_dict(cls, raw: Any) -> "DpoConfig":
        """Parse the config's "dpo" object; ConfigError naming `dpo.<key>`."""
        check_object(raw, "dpo", KEYS, SHAPE)
        types = _loss_types(raw)
        ld_alpha = raw.get("ld_alpha")
        if ld_alpha is not None:
            ld_alpha = _number(raw, "ld_alpha", 1.0, lambda v: 0 <= v <= 1, "a number in [0, 1] or null")
        weighting = raw.get("use_weighting", False)
        if not isinstance(weighting, bool):
            raise ConfigError(f"config key 'dpo.use_weighting' must be true or false, got {json.dumps(weighting)}")
        if weighting and SFT in types:
            raise ConfigError("config key 'dpo.use_weighting' weights pairs, and the 'sft' loss is a mean over "
                              "tokens: drop one of them")
        return cls(beta=_number(raw, "beta", cls.beta, lambda v: v > 0, "a positive number"),
                   loss_type=types, loss_weights=_loss_weights(raw, types),
                   label_smoothing=_label_smoothing(raw, types), f_divergence_type=_f_divergence(raw, types),
                   f_alpha_divergence_coef=_number(raw, "f_alpha_divergence_coef", cls.f_alpha_divergence_coef,
                                                   math.isfinite, "a number"),
                   discopop_tau=_number(raw, "discopop_tau", cls.discopop_tau, lambda v: v > 0, "a positive number"),
                   ld_alpha=ld_alpha, use_weighting=weighting)

    needs_reference = True

    @property
    def needs_sum_sq(self) -> bool:
        return self.use_weighting

    def weight(self, loss: str) -> float:
        """The weight of one loss type (0 when not used)."""
        return dict(zip(self.loss_type, self.loss_weights)).get(loss, 0.0)

    def nll_mask(self, mask):
        """The tokens an NLL term covers (the "sft" loss's: the completions'), or None without one."""
        return mask if self.weight(SFT) else None

    def pair_sums(self, token_logps, reference_token_logps, mask, log_sum_sq_probs=None, reduce=lambda x: x,
                  nll_scale=None, labels=None):
        return dpo_sums(token_logps, reference_token_logps, mask, self, log_sum_sq_probs, reduce, nll_scale)


def sequence_logps(token_logps, mask, ld_alpha: Optional[float]):
    """Each row's completion log-probability [b] from its tokens' [b, T] (zero off the completion);
    with LD-DPO's alpha, the tokens past the pair's shorter completion count alpha."""
    if ld_alpha is None:
        return jnp.sum(token_logps, axis=-1)
    lengths = jnp.sum(mask, axis=-1)
    shared = jnp.repeat(jnp.minimum(lengths[0::2], lengths[1::2]), 2)
    past_shared = jnp.cumsum(mask, axis=-1) > shared[:, None]
    return jnp.sum(token_logps * jnp.where(past_shared, ld_alpha, 1.0), axis=-1)


def wpo_weights(token_logps, log_sum_sq_probs, mask):
    """WPO's weight of each pair [k]: the product of its completions' exp(mean over tokens of
    log p(y_t) - log sum_v p(v)^2), held constant."""
    aligned = jax.lax.stop_gradient(token_logps - log_sum_sq_probs * mask)
    per_row = jnp.exp(jnp.sum(aligned, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0))
    return per_row[0::2] * per_row[1::2]


def dpo_sums(token_logps, reference_token_logps, mask, config: DpoConfig, log_sum_sq_probs=None,
             reduce: Callable = lambda x: x, nll_scale=None) -> tuple[jax.Array, dict, jax.Array]:
    """DPO's sums over the pairs of a block of rows, `reduce`d (e.g. summed over data-parallel devices).

    token_logps, reference_token_logps [2k, T]: each position's log-probability of its next token
    under the policy and the reference (rows alternate chosen, rejected); mask [2k, T] the
    completion's tokens; log_sum_sq_probs [2k, T] log sum_v p(v)^2 (WPO only)
    -> (loss sum, {metric: sum} for `METRICS`, number of pairs counted).
    """
    mask = mask.astype(jnp.float32)
    token_logps, reference_token_logps = token_logps * mask, reference_token_logps * mask
    logps = sequence_logps(token_logps, mask, config.ld_alpha)
    reference = jax.lax.stop_gradient(sequence_logps(reference_token_logps, mask, config.ld_alpha))
    ratio = logps - reference
    score = F_DIVERGENCES[config.f_divergence_type](config.f_alpha_divergence_coef)(ratio)
    tokens = jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
    pairs = Pairs(ratio[0::2], ratio[1::2], score[0::2], score[1::2], tokens[0::2], tokens[1::2])
    counted = _counted(mask)
    weight = counted * (wpo_weights(token_logps, log_sum_sq_probs, mask) if config.use_weighting else 1.0)
    losses = sum(w * PAIR_LOSSES[name](pairs, config) for name, w in zip(config.loss_type, config.loss_weights)
                 if name != SFT)
    total = reduce(jnp.sum(losses * weight))
    count = reduce(jnp.sum(counted))
    if config.weight(SFT):  # the chosen tokens' mean NLL over the whole batch, as a term of each pair's loss
        total = total + config.weight(SFT) * chosen_nll(token_logps, mask, count, reduce, nll_scale)
    sums = reward_sums(config.beta * ratio, logps, counted, reduce)
    return total, {"loss": jax.lax.stop_gradient(total), **sums}, count


def chosen_nll(token_logps, nll_mask, count, reduce, nll_scale=None):
    """The chosen rows' negative log-likelihood over the tokens of `nll_mask` [2k, T], as a sum over
    pairs: the NLL summed times `nll_scale` (the step's pairs per such token; default this block's,
    `count` / its tokens), so that divided by the step's pairs it is the mean per token."""
    nll = reduce(-jnp.sum(token_logps[0::2] * nll_mask[0::2]))
    if nll_scale is None:
        nll_scale = count / jnp.maximum(reduce(jnp.sum(nll_mask[0::2])), 1.0)
    return nll * nll_scale


def nll_scale(objective, mask):
    """Pairs per token of an objective's NLL term over a whole step's rows (mask [..., 2k, T], any
    leading microbatch axes; rows alternate chosen, rejected); 0 for an objective without one."""
    covered = objective.nll_mask(mask)
    if covered is None:
        return jnp.zeros((), jnp.float32)
    pairs = jnp.sum((jnp.sum(mask[..., 0::2, :], axis=-1) > 0).astype(jnp.float32))
    return pairs / jnp.maximum(jnp.sum(covered[..., 0::2, :].astype(jnp.float32)), 1.0)


def reward_sums(rewards, logps, counted, reduce, **more) -> dict:
    """{metric: sum over counted pairs} of the rewards TRL logs (each row's [2k]), the rows'
    log-probabilities and `more` (each pair's [k])."""
    chosen, rejected = rewards[0::2], rewards[1::2]
    values = {"rewards/chosen": chosen, "rewards/rejected": rejected,
              "rewards/accuracies": (chosen > rejected).astype(jnp.float32), "rewards/margins": chosen - rejected,
              "logps/chosen": logps[0::2], "logps/rejected": logps[1::2], **more}
    return {name: reduce(jnp.sum(jax.lax.stop_gradient(v) * counted)) for name, v in values.items()}


def _with_nll(pair_total, nll_weight: float, nll, sums: dict, count):
    """(loss sum, {metric: sum}, count) of an objective whose loss is its pairs' terms plus
    `nll_weight` times an NLL term (`chosen_nll`), which is also logged as `nll_loss`."""
    total = pair_total + nll_weight * nll
    return total, {"loss": jax.lax.stop_gradient(total), **sums, "nll_loss": jax.lax.stop_gradient(nll)}, count


def _counted(mask):
    """1 for each pair whose chosen row trains on a token [k] (not a validation pass's padding)."""
    return (jnp.sum(mask[0::2], axis=-1) > 0).astype(jnp.float32)


def _mean_logps(token_logps, mask):
    """Each row's mean log-probability per completion token [2k]."""
    return jnp.sum(token_logps * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)


# ----------------------------------------------------------------------------- CPO and SimPO

CPO_KEYS = ("beta", "loss_type", "label_smoothing", "cpo_alpha", "simpo_gamma", "alpha")
CPO_LOSSES = ("sigmoid", "hinge", "ipo", "simpo")


@dataclass(frozen=True)
class CpoConfig(Objective):
    """CPO (Xu et al. 2024): DPO's losses on the policy's own log-probabilities, with no reference,
    plus `cpo_alpha` times the chosen completions' NLL. `loss_type` "simpo" is SimPO (Meng et al.
    2024): per-token mean log-probabilities and a target margin `simpo_gamma` (with `cpo_alpha` 0,
    SimPO itself; above 0, CPO-SimPO). "ipo" also uses per-token means. `alpha` (AlphaPO, arXiv
    2501.03884) reshapes each reward to (1 - p^-alpha) / alpha; TRL's `loss_type` "alphapo" is
    "simpo" with `cpo_alpha` 0. `label_smoothing` applies to "sigmoid" and "simpo"."""
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    cpo_alpha: float = 1.0
    simpo_gamma: float = 0.5
    alpha: float = 0.0
    metrics = (*METRICS, "nll_loss")

    @classmethod
    def from_dict(cls, raw: Any) -> "CpoConfig":
        check_object(raw, "cpo", CPO_KEYS, '{"beta": number, "loss_type": "sigmoid"|"hinge"|"ipo"|"simpo", ...}')
        loss = raw.get("loss_type", cls.loss_type)
        nll_weight = _number(raw, "cpo_alpha", cls.cpo_alpha, lambda v: v >= 0, "a number >= 0", "cpo")
        if loss == "alphapo":  # TRL's shorthand for AlphaPO: SimPO without the NLL term (the shape is `alpha`)
            if "cpo_alpha" in raw and nll_weight:
                raise ConfigError(f"config key 'cpo.cpo_alpha' must be 0 under 'alphapo' (SimPO without the NLL "
                                  f"term), got {nll_weight}")
            loss, nll_weight = "simpo", 0.0
        if loss not in CPO_LOSSES:
            raise ConfigError(f"config key 'cpo.loss_type' must be one of {', '.join(CPO_LOSSES)} or alphapo, "
                              f"got {json.dumps(loss)}")
        if "simpo_gamma" in raw and loss != "simpo":
            raise ConfigError(f"config key 'cpo.simpo_gamma' applies to the 'simpo' loss only, not {loss!r}")
        smoothing = _number(raw, "label_smoothing", 0.0, lambda v: 0 <= v < 0.5, "a number in [0, 0.5)", "cpo")
        if smoothing and loss not in ("sigmoid", "simpo"):
            raise ConfigError(f"config key 'cpo.label_smoothing' applies to the 'sigmoid' and 'simpo' losses only, "
                              f"not {loss!r}")
        return cls(beta=_number(raw, "beta", cls.beta, lambda v: v > 0, "a positive number", "cpo"),
                   loss_type=loss, label_smoothing=smoothing,
                   cpo_alpha=nll_weight,
                   simpo_gamma=_number(raw, "simpo_gamma", cls.simpo_gamma, math.isfinite, "a number", "cpo"),
                   alpha=_number(raw, "alpha", cls.alpha, math.isfinite, "a number", "cpo"))

    def nll_mask(self, mask):
        return mask

    def pair_sums(self, token_logps, reference_token_logps, mask, log_sum_sq_probs=None, reduce=lambda x: x,
                  nll_scale=None, labels=None):
        mask = mask.astype(jnp.float32)
        per_token = self.loss_type in ("ipo", "simpo")
        logps = _mean_logps(token_logps, mask) if per_token else jnp.sum(token_logps * mask, axis=-1)
        rewards = (1 - jnp.exp(-self.alpha * logps)) / self.alpha if self.alpha else logps
        z = rewards[0::2] - rewards[1::2]
        if self.loss_type == "simpo":
            z = z - self.simpo_gamma / self.beta
        if self.loss_type in ("sigmoid", "simpo"):
            eps = self.label_smoothing
            losses = -(1 - eps) * jax.nn.log_sigmoid(self.beta * z) - eps * jax.nn.log_sigmoid(-self.beta * z)
        elif self.loss_type == "hinge":
            losses = jax.nn.relu(1 - self.beta * z)
        else:  # ipo
            losses = jnp.square(z - 1 / (2 * self.beta))
        counted = _counted(mask)
        count = reduce(jnp.sum(counted))
        nll = chosen_nll(token_logps, mask, count, reduce, nll_scale)
        sums = reward_sums(self.beta * rewards, logps, counted, reduce)
        return _with_nll(reduce(jnp.sum(losses * counted)), self.cpo_alpha, nll, sums, count)


# ----------------------------------------------------------------------------- ORPO

def log1mexp(x):
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return jnp.where(x < -math.log(2), jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


@dataclass(frozen=True)
class OrpoConfig(Objective):
    """ORPO (Hong et al. 2024): the chosen sequences' NLL (prompt and completion, as TRL's
    ORPOTrainer counts it) minus `beta` (the paper's lambda) times log sigmoid of the log odds
    ratio, log(odds(chosen) / odds(rejected)) with odds(y) = p / (1 - p), p the completion's
    geometric-mean token probability (exp of its mean log-probability). No reference."""
    beta: float = 0.1
    metrics = (*METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")

    @classmethod
    def from_dict(cls, raw: Any) -> "OrpoConfig":
        check_object(raw, "orpo", ("beta",), '{"beta": number}')
        return cls(beta=_number(raw, "beta", cls.beta, lambda v: v > 0, "a positive number", "orpo"))

    def nll_mask(self, mask):
        """The chosen sequences' tokens: the prompt's and the completion's (each row's positions up to
        its last completion token; padding only follows it)."""
        return (jnp.cumsum(mask[..., ::-1], axis=-1)[..., ::-1] > 0).astype(jnp.float32)

    def pair_sums(self, token_logps, reference_token_logps, mask, log_sum_sq_probs=None, reduce=lambda x: x,
                  nll_scale=None, labels=None):
        mask = mask.astype(jnp.float32)
        counted = _counted(mask)
        # A row with no token (a validation pass's padding) would have log p = 0 and infinite odds.
        logps = jnp.where(jnp.sum(mask, axis=-1) > 0, _mean_logps(token_logps, mask), -1.0)
        chosen, rejected = logps[0::2], logps[1::2]
        log_odds = jnp.where(counted > 0, (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected)), 0.0)
        ratio = jax.nn.log_sigmoid(log_odds)
        count = reduce(jnp.sum(counted))
        nll = chosen_nll(token_logps, self.nll_mask(mask), count, reduce, nll_scale)
        sums = reward_sums(self.beta * logps, logps, counted, reduce, log_odds_ratio=ratio, log_odds_chosen=log_odds)
        return _with_nll(-self.beta * reduce(jnp.sum(jnp.where(counted > 0, ratio, 0.0))), 1.0, nll, sums, count)


# ----------------------------------------------------------------------------- KTO

KTO_KEYS = ("beta", "desirable_weight", "undesirable_weight", "loss_type")
KTO_LOSSES = ("kto", "apo_zero_unpaired")
KTO_METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class KtoConfig(Objective):
    """KTO (Ethayarajh et al. 2024, arXiv 2402.01306) on unpaired examples, each one completion
    labelled desirable or not (`data.preferences`), against a frozen reference as DPO's. With h the
    completion's log-ratio and z the KL estimate, the loss of a desirable example is
    `desirable_weight` * (1 - sigmoid(beta * (h - z))), of an undesirable one `undesirable_weight` *
    (1 - sigmoid(beta * (z - h))) (the paper's eq. 7, TRL's "kto"), averaged over examples. z is the
    mean log-ratio of the microbatch's KL rows (each example's prompt with another's completion)
    over all its examples, at least 0 and held constant, as TRL's KTOTrainer computes it per batch.
    `loss_type` "apo_zero_unpaired" (APO's unpaired loss, arXiv 2408.06266) is 1 - sigmoid(beta * h)
    and sigmoid(beta * h), without z (the step then does not run the KL rows at all).

    Rows come in twos: an example's row, then its KL row; `labels` [2k] are 1 on desirable examples'.
    The metrics are TRL's: `rewards/*` and `logps/*` are means over the desirable ("chosen") or
    undesirable ("rejected") examples (NaN, and not logged, where a step has none), `kl` is z."""
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_type: str = "kto"
    needs_reference = True
    needs_labels = True
    metrics = KTO_METRICS

    @classmethod
    def from_dict(cls, raw: Any) -> "KtoConfig":
        check_object(raw, "kto", KTO_KEYS, '{"beta": number, "desirable_weight": number, ...}')
        loss = raw.get("loss_type", cls.loss_type)
        if loss not in KTO_LOSSES:
            raise ConfigError(f"config key 'kto.loss_type' must be one of {', '.join(KTO_LOSSES)}, "
                              f"got {json.dumps(loss)}")
        weight = lambda key: _number(raw, key, 1.0, lambda v: v > 0, "a positive number", "kto")  # noqa: E731
        return cls(beta=_number(raw, "beta", cls.beta, lambda v: v > 0, "a positive number", "kto"),
                   desirable_weight=weight("desirable_weight"), undesirable_weight=weight("undesirable_weight"),
                   loss_type=loss)

    @property
    def kl_rows(self) -> str:
        return "read" if self.loss_type == "kto" else "unread"

    def weight_advice(self, desirable: int, undesirable: int) -> Optional[str]:
        """Where the data's labels are unbalanced and neither weight is in the range the paper's eq. 8
        gives (desirable_weight * desirable / (undesirable_weight * undesirable) in [1, 4/3]), what
        TRL's KTOTrainer advises: one line naming both ranges (bounds as TRL rounds them); else None."""
        d, u = max(desirable, 1), max(undesirable, 1)
        if d == u:
            return None
        wd, wu = self.desirable_weight, self.undesirable_weight
        for_desirable = (round(u * wu / d, 2), round(u * wu / d * 1.33, 2))
        for_undesirable = (round(d * wd / u / 1.33, 2), round(d * wd / u, 2))
        if for_desirable[0] <= wd <= for_desirable[1] or for_undesirable[0] <= wu <= for_undesirable[1]:
            return None
        return (f"kto: {desirable} desirable and {undesirable} undesirable examples; KTO's paper advises either "
                f"'kto.desirable_weight' in [{for_desirable[0]}, {for_desirable[1]}] (at 'undesirable_weight' {wu}) "
                f"or 'kto.undesirable_weight' in [{for_undesirable[0]}, {for_undesirable[1]}] "
                f"(at 'desirable_weight' {wd}), not both")

    @property
    def sums(self) -> tuple:
        return ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected",
                "examples/chosen", "examples/rejected")

    def means(self, sums: dict, count) -> dict:
        def over(key, n):
            return jnp.where(n > 0, sums[key] / jnp.maximum(n, 1.0), jnp.nan)
        chosen, rejected = sums["examples/chosen"], sums["examples/rejected"]
        out = {"loss": sums["loss"] / count, "kl": sums["kl"] / count,
               "rewards/chosen": over("rewards/chosen", chosen), "rewards/rejected": over("rewards/rejected", rejected),
               "logps/chosen": over("logps/chosen", chosen), "logps/rejected": over("logps/rejected", rejected)}
        return {**out, "rewards/margins": out["rewards/chosen"] - out["rewards/rejected"]}

    def pair_sums(self, token_logps, reference_token_logps, mask, log_sum_sq_probs=None, reduce=lambda x: x,
                  nll_scale=None, labels=None):
        mask = mask.astype(jnp.float32)
        logps = jnp.sum(token_logps * mask, axis=-1)
        ratio = logps - jax.lax.stop_gradient(jnp.sum(reference_token_logps * mask, axis=-1))
        counted = _counted(mask)
        count = reduce(jnp.sum(counted))
        desirable, own = labels[0::2] * counted, ratio[0::2]
        undesirable = counted - desirable
        if self.loss_type == "kto":
            kl = jax.lax.stop_gradient(jnp.maximum(reduce(jnp.sum(ratio[1::2] * counted)) / jnp.maximum(count, 1.0), 0.0))
            chosen_losses = 1 - jax.nn.sigmoid(self.beta * (own - kl))
            rejected_losses = 1 - jax.nn.sigmoid(self.beta * (kl - own))
        else:  # apo_zero_unpaired
            kl = jnp.zeros((), jnp.float32)
            chosen_losses, rejected_losses = 1 - jax.nn.sigmoid(self.beta * own), jax.nn.sigmoid(self.beta * own)
        total = reduce(jnp.sum(self.desirable_weight * chosen_losses * desirable
                               + self.undesirable_weight * rejected_losses * undesirable))
        rewards, logps = jax.lax.stop_gradient(self.beta * own), jax.lax.stop_gradient(logps[0::2])
        sums = {"loss": jax.lax.stop_gradient(total), "kl": kl * count,
                "rewards/chosen": reduce(jnp.sum(rewards * desirable)),
                "rewards/rejected": reduce(jnp.sum(rewards * undesirable)),
                "logps/chosen": reduce(jnp.sum(logps * desirable)), "logps/rejected": reduce(jnp.sum(logps * undesirable)),
                "examples/chosen": reduce(jnp.sum(desirable)), "examples/rejected": reduce(jnp.sum(undesirable))}
        return total, sums, count


# ----------------------------------------------------------------------------- reward models

REWARD_KEYS = ("center_rewards_coefficient",)
REWARD_METRICS = ("loss", "accuracy", "margin", "mean_reward")  # TRL's RewardTrainer's (its min/max do not add up)


@dataclass(frozen=True)
class RewardConfig(Objective):
    """A reward model (a classifier of one output, `ModelConfig.num_labels` 1) on pairs, as TRL's
    RewardTrainer trains one (Ouyang et al. 2022, eq. 1: the Bradley-Terry model): a row's reward r
    is the score head's output at its last token, and a pair's loss is -log sigmoid(r(chosen) -
    r(rejected)), plus `center_rewards_coefficient` times (r(chosen) + r(rejected))^2 where set
    (Eisenstein et al. 2023: rewards kept near 0), averaged over pairs. No reference, no
    log-probabilities: `pair_sums` takes each row's reward [2k] in place of token log-probabilities."""
    center_rewards_coefficient: Optional[float] = None
    reads_rewards = True
    metrics = REWARD_METRICS

    @classmethod
    def from_dict(cls, raw: Any) -> "RewardConfig":
        check_object(raw, "reward", REWARD_KEYS, '{"center_rewards_coefficient": number or null}')
        coefficient = raw.get("center_rewards_coefficient")
        if coefficient is not None:
            coefficient = _number(raw, "center_rewards_coefficient", 0.0, lambda v: v >= 0,
                                  "a number at least 0, or null", "reward")
        return cls(center_rewards_coefficient=coefficient)

    def pair_sums(self, rewards, reference_token_logps, mask, log_sum_sq_probs=None, reduce=lambda x: x,
                  nll_scale=None, labels=None):
        counted = _counted(mask)
        chosen, rejected = rewards[0::2], rewards[1::2]
        losses = -jax.nn.log_sigmoid(chosen - rejected)
        if self.center_rewards_coefficient is not None:
            losses = losses + self.center_rewards_coefficient * jnp.square(chosen + rejected)
        total = reduce(jnp.sum(losses * counted))
        values = {"accuracy": (chosen > rejected).astype(jnp.float32), "margin": chosen - rejected,
                  "mean_reward": (chosen + rejected) / 2}
        sums = {name: reduce(jnp.sum(jax.lax.stop_gradient(v) * counted)) for name, v in values.items()}
        return total, {"loss": jax.lax.stop_gradient(total), **sums}, reduce(jnp.sum(counted))


def last_tokens(mask):
    """Each row's last token [b] (a position of its inputs, the row less its final token): the last
    completion token's, where `mask` [b, T] marks the completion's tokens as targets; a row that
    fills all T + 1 tokens is read at its last input (the row cut to the model's T)."""
    t = mask.shape[-1]
    last_target = t - 1 - jnp.argmax(mask[:, ::-1] > 0, axis=-1)
    return jnp.minimum(last_target + 1, t - 1)


OBJECTIVES = {"dpo": DpoConfig, "cpo": CpoConfig, "orpo": OrpoConfig, "kto": KtoConfig, "reward": RewardConfig}


def objective(train: TrainConfig):
    """The config's preference objective (`DpoConfig`, `CpoConfig`, `OrpoConfig`, `KtoConfig` or
    `RewardConfig`), or None."""
    key = train.preference
    return None if key is None else OBJECTIVES[key].from_dict(getattr(train, key))


assert set(OBJECTIVES) == set(PREFERENCE_KEYS)
