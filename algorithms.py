"""RL algorithms as pure tensor functions: advantages, losses, KL, DAPO pieces.

Every tensor here is [batch, response_len] (B x T), with a `response_mask` that is 1 on real response tokens and 0
on padding. Sequence i earns token rewards r_{i,t} (`token_level_rewards`; for outcome rewards only the last valid
token is nonzero) and its score is s_i = sum_t r_{i,t}. The n samples of one prompt share a group id in `index`.

Advantage estimators (`adv_estimator`) turn rewards into per-token advantages A:
  gae      delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},
           returns R_t = A_t + V_t (critic target), then A is whitened.
  grpo     A_i = (s_i - mean_g s) / (std_g s + eps)  broadcast over the tokens of i;
           `norm_adv_by_std_in_grpo=False` drops the std (Dr.GRPO).
  rloo     A_i = s_i - mean_{j != i in g} s_j = n/(n-1) (s_i - mean_g s).
  reinforce_plus_plus           A_t = whiten(sum_{k>=t} gamma^{k-t} r_k) over the batch.
  reinforce_plus_plus_baseline  A_i = whiten(s_i - mean_g s) over the batch.
Group statistics are gathered with index_add/bincount over group ids, never with a Python loop over groups.

The PPO policy loss per token, with ratio rho = exp(logp - logp_old), is
  L = max(-A rho, -A clip(rho, 1 - clip_ratio_low, 1 + clip_ratio_high)),
and for A < 0 the dual clip caps it: L = min(L, -A clip_ratio_c) (clip_ratio_c > 1), so a token whose ratio has
exploded cannot produce an unbounded loss. DAPO's "clip-higher" is clip_ratio_high > clip_ratio_low. The critic loss is
  L_V = 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).

Aggregation (`loss_agg_mode`) turns the B x T loss matrix into a scalar. The trainer splits a mini-batch into
micro-batches spread over data-parallel ranks and adds up their gradients, so each micro-batch must divide its
*local sum* by the *global* count of the whole mini-batch; then the sum over micro-batches and ranks equals the
loss computed in one shot, whatever the split. The trainer takes `loss_denominator` of the whole mini-batch (every
rank holds all of it, so no collective is needed) as the global count, and `agg_loss` divides by it:
  token-mean               sum_{i,t} m L / N_tokens
  seq-mean-token-sum       sum_i (sum_t m L) / N_seqs
  seq-mean-token-mean      sum_i (sum_t m L / sum_t m) / N_seqs
  seq-mean-token-sum-norm  sum_{i,t} m L / (N_seqs * horizon)      (Dr.GRPO)
where a "sequence" is a row with at least one valid token and `horizon` is a constant (the configured max
response length), never a per-micro-batch length. An entropy bonus is just `agg_loss(entropy, ...)`.

KL to a reference policy is estimated per token from the sampled token only (Schulman's estimators,
x = logp - logp_ref, tokens drawn from the policy):
  k1 = x,  k2 = x^2 / 2,  k3 = exp(-x) + x - 1.
k1 and k3 are unbiased for KL(pi || ref); k3 is never negative and has low variance. The KL is either subtracted
from rewards with a fixed or adaptive coefficient (`apply_kl_penalty`) or added to the actor loss. As a loss, what
counts is the estimator's gradient at the sampled tokens: k1's is zero in expectation, k2's is the gradient of
KL(pi || ref), and k3's that of KL(ref || pi), so use_kl_loss wants k2 or k3 (verl's default low_var_kl is k3)."""
from __future__ import annotations

import math

import torch

# --------------------------------------------------------------------------- masked statistics


def _masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """sum(x * mask); padding may hold inf/nan (e.g. log-probs of pad tokens), so select first."""
    return (torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype)) * mask.to(x.dtype)).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * m) / sum(m) (over all elements, or along `dim`); 0 where the mask is empty."""
    return _masked_sum(x, mask, dim) / mask.to(x.dtype).sum(dim=dim).clamp_min(1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """sum(m (x - mean)^2) / sum(m), times the Bessel factor N/(N-1) when unbiased and N > 1."""
    var = masked_mean((x - masked_mean(x, mask)) ** 2, mask)
    if unbiased and (n := float(mask.to(x.dtype).sum())) > 1:
        var = var * (n / (n - 1))
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over valid elements; with shift_mean=False the mean is added back."""
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    return whitened if shift_mean else whitened + mean


def _group_stats(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: torch.Tensor):
    """(mask as float, scores s_i, per sample its group's size, mean and unbiased std); a singleton: mean 0, std 1.
    The mean is taken as min + mean(s - min), which is exact when a group's scores are all equal: a plain float32
    mean of 16 scores of 0.7 misses by an ulp, and (s_i - mean) / (std + eps) then comes out near 0.1, not 0."""
    mask = response_mask.to(token_level_rewards.dtype)
    scores = _masked_sum(token_level_rewards, mask, dim=-1)
    _, gid = torch.unique(index.to(scores.device), return_inverse=True)  # arbitrary ids -> 0..G-1
    num_groups = int(gid.max()) + 1
    count = torch.bincount(gid, minlength=num_groups).to(scores.dtype)
    low = scores.new_full((num_groups,), math.inf).scatter_reduce(0, gid, scores, "amin")
    mean = low + scores.new_zeros(num_groups).index_add_(0, gid, scores - low[gid]) / count
    sq = scores.new_zeros(num_groups).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = (sq / (count - 1).clamp_min(1)).sqrt()
    single = count[gid] == 1
    return mask, scores, count[gid], torch.where(single, 0.0, mean[gid]), torch.where(single, 1.0, std[gid])


# --------------------------------------------------------------------------- advantage estimators


def compute_gae_advantage_return(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                                 gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}; R_t = A_t + V_t.

    Masked positions are skipped: they neither contribute a TD error nor break the recurrence (V_{t+1} and A_{t+1}
    come from the next *valid* token; 0 past the end). Advantages are then whitened over the batch's valid tokens."""
    mask = response_mask.to(values.dtype)
    rewards, values = (torch.where(mask.bool(), x.to(values.dtype), 0.0) for x in (token_level_rewards, values))
    next_value = next_adv = torch.zeros_like(values[:, 0])
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):  # the recurrence is inherently sequential in time
        a = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_adv  # delta_t + gamma lam A_{t+1}
        m = mask[:, t]
        adv[:, t] = a * m
        next_value = values[:, t] * m + (1 - m) * next_value
        next_adv = a * m + (1 - m) * next_adv
    return masked_whiten(adv, mask) * mask, (adv + values) * mask


def compute_grpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                   index: torch.Tensor, epsilon: float = 1e-6,
                                   norm_adv_by_std_in_grpo: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: A_i = (s_i - mean_g) / (std_g + epsilon), std unbiased; Dr.GRPO (no std): A_i = s_i - mean_g.
    A singleton group has no baseline: mean 0 and std 1, so A_i = s_i / (1 + eps) (verl).
    Returns (A, A) broadcast over valid tokens."""
    mask, scores, _, mean, std = _group_stats(token_level_rewards, response_mask, index)
    adv = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
    adv = adv.unsqueeze(-1) * mask
    return adv, adv


def compute_rloo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                   index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: A_i = s_i - (1/(n-1)) sum_{j != i} s_j = n/(n-1) (s_i - mean_g) for a group of n.
    A singleton group has no other sample to form a baseline, so its advantage is 0: it teaches nothing (verl
    instead passes the raw score through)."""
    mask, scores, count, mean, _ = _group_stats(token_level_rewards, response_mask, index)
    adv = torch.where(count > 1, count / (count - 1).clamp_min(1) * (scores - mean), torch.zeros_like(scores))
    adv = adv.unsqueeze(-1) * mask
    return adv, adv


def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                                  gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: G_t = r_t + gamma G_{t+1} (reset at masked tokens); A = whiten(G) over the batch.
    Returns (A, G), G being the (unwhitened) discounted returns to go."""
    mask = response_mask.to(token_level_rewards.dtype)
    rewards = torch.where(response_mask.bool(), token_level_rewards, 0.0)  # (padding may hold nan)
    returns, running = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t]  # padding before a token must not carry its return
        returns[:, t] = running
    return masked_whiten(returns, mask) * mask, returns


def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards: torch.Tensor,
                                                           response_mask: torch.Tensor,
                                                           index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: A = whiten_batch((s_i - mean_g) broadcast over tokens), eps 1e-8 inside the sqrt (verl's
    masked_whiten). A singleton group's mean is 0 (as in GRPO). Returns (A, A)."""
    mask, scores, _, mean, _ = _group_stats(token_level_rewards, response_mask, index)
    adv = masked_whiten((scores - mean).unsqueeze(-1) * mask, mask) * mask
    return adv, adv


ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def compute_advantage(adv_estimator: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                      index: torch.Tensor | None = None, values: torch.Tensor | None = None, gamma: float = 1.0,
                      lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to the estimator named `adv_estimator`; returns (advantages, returns)."""
    if adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and index is None:
        raise ValueError(f"adv_estimator={adv_estimator!r} needs the group ids `index`")
    if adv_estimator == "gae":
        if values is None:
            raise ValueError("adv_estimator='gae' needs critic `values`")
        return compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)
    if adv_estimator == "grpo":
        return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index,
                                              norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
    if adv_estimator == "rloo":
        return compute_rloo_outcome_advantage(token_level_rewards, response_mask, index)
    if adv_estimator == "reinforce_plus_plus":
        return compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma)
    if adv_estimator == "reinforce_plus_plus_baseline":
        return compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index)
    raise ValueError(f"unknown adv_estimator {adv_estimator!r}; valid: {', '.join(ADV_ESTIMATORS)}")


# --------------------------------------------------------------------------- loss aggregation

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def loss_denominator(response_mask: torch.Tensor, loss_agg_mode: str) -> float:
    """The count a loss is divided by: valid tokens (token-mean) or rows with >= 1 valid token (seq-*). The trainer
    takes it of a whole mini-batch, over all its micro-batches and DP ranks."""
    if loss_agg_mode == "token-mean":
        return float(response_mask.to(torch.float64).sum())
    elif loss_agg_mode in LOSS_AGG_MODES:
        return float(response_mask.bool().any(dim=-1).sum())
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, global_denominator: float,
             horizon: int | None = None) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss (formulas in the module docstring)."""
    denom = max(float(global_denominator), 1e-8)  # an all-padding mini-batch gives 0, not nan
    if loss_agg_mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, loss_mask, dim=-1).sum() / denom
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if horizon is None:
            raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' needs a constant `horizon` (max response length)")
        denom *= horizon
    elif loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    return _masked_sum(loss_mat, loss_mask) / denom


def _metric_tokens(loss_agg_mode: str, global_denominator: float, global_tokens: float | None) -> float:
    """Token count used for additive metrics: the loss denominator itself in token-mean mode."""
    if global_tokens is None and loss_agg_mode != "token-mean":
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} counts sequences; pass global_tokens "
                         "(sum of loss_denominator(mask, 'token-mean') over micro-batches and ranks) for the metrics")
    return max(float(global_denominator if global_tokens is None else global_tokens), 1e-8)


# --------------------------------------------------------------------------- policy and value losses

POLICY_LOSS_MODES = ("vanilla", "gspo", "cispo")


def compute_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, global_denominator: float, loss_agg_mode: str = "token-mean",
                        clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
                        policy_loss_mode: str = "vanilla", horizon: int | None = None,
                        rollout_is_weights: torch.Tensor | None = None,
                        global_tokens: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss; returns (pg_loss, metrics).

    vanilla: rho = exp(clamp(logp - logp_old, -20, 20)),
      L = max(-A rho, -A clip(rho, 1-low, 1+high)); for A < 0, L = min(L, -A clip_ratio_c).
    gspo: rho_i = exp(mean_t(logp - logp_old)) per sequence, in the token form
      rho_{i,t} = sg(rho_i) exp(logp_t - sg(logp_t)), whose value is rho_i and whose gradient is rho_i grad logp_t
      (log rho_{i,t} clamped at 10, where the gradient stops); then the same two-sided clip, no dual clip. It needs
      loss_agg_mode seq-mean-token-mean (the paper's; verl imposes it); the paper's clip ranges are 3e-4 / 4e-4.
    cispo: L = -A sg(clip(rho, 1-low, 1+high)) logp: the IS weight is clipped and detached, so every token keeps a
      gradient (pass a large clip_ratio_low for CISPO's one-sided clip).
    `rollout_is_weights` (detached, per token) multiply L before aggregation.

    metrics (0-dim, detached): pg_clipfrac, pg_clipfrac_lower, ppo_kl = mean(logp_old - logp), each as
    sum(x m) / global_tokens, i.e. this micro-batch's *contribution*: summing them over micro-batches and ranks gives
    the mini-batch value. global_tokens defaults to global_denominator in token-mean mode and is required otherwise."""
    if policy_loss_mode == "gspo" and loss_agg_mode != "seq-mean-token-mean":
        raise ValueError(f"policy_loss_mode gspo needs loss_agg_mode seq-mean-token-mean, got {loss_agg_mode!r}")
    metric_denom = _metric_tokens(loss_agg_mode, global_denominator, global_tokens)
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    clipfrac_lower = torch.zeros_like(ratio)
    if policy_loss_mode in ("vanilla", "gspo"):
        if policy_loss_mode == "gspo":  # token form of rho_i: value rho_i, gradient rho_i grad logp_t
            seq_log_ratio = masked_mean(log_prob - old_log_prob, response_mask, dim=-1).detach().unsqueeze(-1)
            ratio = torch.exp(torch.clamp(log_prob - log_prob.detach() + seq_log_ratio, max=10.0))  # (verl's bound)
        elif clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 for the dual clip, got {clip_ratio_c}")
        loss1 = -advantages * ratio
        loss2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
        pg_losses = torch.maximum(loss1, loss2)
        clipfrac = (loss2 > loss1).to(ratio.dtype)
        if policy_loss_mode == "vanilla":  # dual clip
            loss3 = -advantages * clip_ratio_c
            clipfrac_lower = ((pg_losses > loss3) & (advantages < 0)).to(ratio.dtype)
            pg_losses = torch.where(advantages < 0, torch.minimum(pg_losses, loss3), pg_losses)
    elif policy_loss_mode == "cispo":
        weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()
        pg_losses = -advantages * weight * log_prob
        clipfrac = (weight != ratio.detach()).to(ratio.dtype)
    else:
        raise ValueError(f"unknown policy_loss_mode {policy_loss_mode!r}; valid: {', '.join(POLICY_LOSS_MODES)}")
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, global_denominator, horizon)
    metrics = {k: (_masked_sum(x, response_mask) / metric_denom).detach()
               for k, x in (("pg_clipfrac", clipfrac), ("pg_clipfrac_lower", clipfrac_lower), ("ppo_kl", -log_ratio))}
    return pg_loss, metrics


def compute_value_loss(vpreds: torch.Tensor, values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor,
                       global_denominator: float, cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean",
                       horizon: int | None = None,
                       global_tokens: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped critic loss 0.5 agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)).
    vf_clipfrac = sum(m [clipped branch larger]) / global_tokens, a contribution like the pg metrics."""
    metric_denom = _metric_tokens(loss_agg_mode, global_denominator, global_tokens)
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss1, loss2 = (vpreds - returns) ** 2, (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(loss1, loss2), response_mask, loss_agg_mode, global_denominator, horizon)
    vf_clipfrac = (_masked_sum((loss2 > loss1).to(vpreds.dtype), response_mask) / metric_denom).detach()
    return vf_loss, vf_clipfrac


# --------------------------------------------------------------------------- KL estimators and controllers

KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate from x = logp - logp_ref of the sampled token.

    kl/k1: x;  abs: |x|;  mse/k2: x^2 / 2;  low_var_kl/k3: exp(-x) + x - 1, with -x clamped to
    [-20, 20] and the result to [-10, 10] so a rare huge ratio cannot blow up the loss."""
    x = log_prob - ref_log_prob
    if kl_penalty in ("kl", "k1"):
        return x
    elif kl_penalty == "abs":
        return x.abs()
    elif kl_penalty in ("mse", "k2"):
        return 0.5 * x * x
    elif kl_penalty in ("low_var_kl", "k3"):
        neg = torch.clamp(-x, -20.0, 20.0)
        return torch.clamp(torch.exp(neg) - neg - 1, -10.0, 10.0)
    raise ValueError(f"unknown kl_penalty {kl_penalty!r}; valid: {', '.join(KL_PENALTIES)}")


_kl_estimate = kl_penalty  # apply_kl_penalty's verl-named argument `kl_penalty` shadows the function


class FixedKLController:
    """A constant KL coefficient beta (and the state handling both controllers share)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        pass  # a fixed coefficient is the config's, also when a run resumes with another one


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. (2019): beta <- beta (1 + clip(KL / target - 1, -0.2, 0.2) n_steps / horizon). beta grows when
    the KL overshoots the target, shrinks when it undershoots, by at most 20% per `horizon` samples."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value, self.target, self.horizon = float(init_kl_coef), float(target_kl), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def load_state_dict(self, state: dict) -> None:  # the coefficient it had reached
        self.value = float(state["value"])


def apply_kl_penalty(token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                     response_mask: torch.Tensor, kl_ctrl: FixedKLController | AdaptiveKLController,
                     kl_penalty: str = "kl") -> tuple[torch.Tensor, dict[str, float]]:
    """KL in reward: r_t = score_t - beta kl_t; then update beta with the batch KL.

    The batch KL is mean_i (mean_t kl_{i,t}), the mean per-sequence KL, and the controller steps by n_steps = batch
    size. Call it on the full batch (identical on every rank) so the controllers of all ranks stay in lockstep."""
    kld = torch.where(response_mask.bool(), _kl_estimate(old_log_prob, ref_log_prob, kl_penalty), 0.0)
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = float(masked_mean(kld, response_mask, dim=-1).mean())
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return token_level_rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


# --------------------------------------------------------------------------- DAPO pieces


def filter_groups(metric_values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: keep[i] = (std of the metric in i's group > 0) or (group size 1).

    A group whose samples all scored the same has zero advantage under GRPO and only dilutes
    the batch. std > 0 is tested as max != min, gathered with scatter_reduce on group ids."""
    metric_values = torch.as_tensor(metric_values, dtype=torch.float64)
    _, gid = torch.unique(index, return_inverse=True)
    g = int(gid.max()) + 1
    gmax = torch.full((g,), -math.inf, dtype=torch.float64).scatter_reduce(0, gid, metric_values, "amax")
    gmin = torch.full((g,), math.inf, dtype=torch.float64).scatter_reduce(0, gid, metric_values, "amin")
    count = torch.bincount(gid, minlength=g)
    return ((gmax > gmin) | (count == 1))[gid]


def compute_overlong_penalty(response_length: torch.Tensor, max_response_length: int, overlong_buffer_len: int,
                             penalty_factor: float) -> torch.Tensor:
    """DAPO soft overlong punishment: min(0, -(len - (L_max - L_buf)) / L_buf * penalty_factor).
    0 up to L_max - L_buf, then linear down to -penalty_factor at L_max, and -penalty_factor beyond."""
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(f"overlong_buffer.len={overlong_buffer_len} must be in (0, max_response_length="
                         f"{max_response_length}]")
    exceed = response_length.to(torch.float32) - (max_response_length - overlong_buffer_len)
    return torch.clamp(-exceed / overlong_buffer_len * penalty_factor, min=-penalty_factor, max=0.0)


# --------------------------------------------------------------------------- rollout correction


def compute_rollout_is_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                               threshold: float = 2.0, level: str = "token") -> torch.Tensor:
    """Truncated importance weights pi_train / pi_rollout correcting the sampler/trainer mismatch.

    token: w_t = min(exp(logp_old_t - logp_rollout_t), threshold);
    sequence: w = min(exp(sum_t (logp_old_t - logp_rollout_t)), threshold), broadcast over tokens.
    Detached; 0 on padding."""
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown rollout IS level {level!r}; valid: token, sequence")
    log_ratio = (old_log_prob - rollout_log_prob).detach()
    log_w = log_ratio if level == "token" else _masked_sum(log_ratio, response_mask, dim=-1).unsqueeze(-1)
    w = torch.clamp(torch.exp(torch.clamp(log_w, -20.0, 20.0)), max=threshold)
    return torch.where(response_mask.bool(), w, 0.0)  # (the sequence level's [B, 1] broadcast over tokens)


def rollout_mismatch_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                             response_mask: torch.Tensor) -> dict[str, float]:
    """|p_train - p_rollout| of the sampled tokens over valid tokens: mean, max, std."""
    diff = (torch.exp(old_log_prob) - torch.exp(rollout_log_prob)).abs()[response_mask.bool()].double()
    diff = diff if diff.numel() else torch.zeros(1, dtype=torch.float64)  # no valid token: report zeros
    return {"training/rollout_probs_diff_mean": float(diff.mean()),
            "training/rollout_probs_diff_max": float(diff.max()),
            "training/rollout_probs_diff_std": float(diff.std()) if diff.numel() > 1 else 0.0}
