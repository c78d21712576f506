"""algorithms.py against hand-worked numbers and loop-based re-implementations."""
import math
import random

import pytest
import torch

import algorithms as A



@pytest.fixture(autouse=True)
def float64_default():
    """fp64 for tight tolerances, restored afterwards so other test modules are unaffected."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def approx(a, b, tol=1e-9):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=tol, rtol=tol)


def random_batch(seed, B=12, T=7, holes=False):
    """Right-padded masks with lengths 0..T (one empty row), rewards on the last valid token,
    groups of sizes 3, 1, 4, 2, 1, 1 with arbitrary ids."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[5] = 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    if holes:  # interior masked tokens (e.g. tool outputs in a multi-turn response)
        mask = mask * (torch.rand(B, T, generator=g) > 0.2).double()
    rewards = torch.zeros(B, T)
    scores = torch.randint(0, 3, (B,), generator=g).double()
    for i in range(B):
        valid = mask[i].nonzero().flatten()
        if len(valid):
            rewards[i, valid[-1]] = scores[i]
    index = torch.tensor([40, 40, 40, 7, -3, -3, -3, -3, 11, 11, 99, 1000])[:B]
    return rewards, mask, index, g


def ref_whiten(x, mask, eps=1e-8):
    vals = [x[i, t].item() for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t] > 0]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    return (x - mean) / math.sqrt(var + eps)


def groups_of(index):
    groups = {}
    for i, k in enumerate(index.tolist()):
        groups.setdefault(k, []).append(i)
    return groups


# --------------------------------------------------------------------------- masked statistics


def test_masked_stats_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, float("nan")]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    # valid 1,2,3,4: mean 2.5; squared deviations 2.25+0.25+0.25+2.25 = 5 -> biased 1.25, unbiased 5/3
    assert approx(A.masked_mean(x, m), 2.5)
    assert approx(A.masked_mean(x, m, dim=-1), [2.0, 4.0])
    assert approx(A.masked_var(x, m, unbiased=False), 1.25)
    assert approx(A.masked_var(x, m), 5 / 3)
    w = A.masked_whiten(x, m)
    assert approx(w[m], (torch.tensor([1.0, 2, 3, 4]) - 2.5) / math.sqrt(5 / 3 + 1e-8))
    assert approx(A.masked_whiten(x, m, shift_mean=False)[m], w[m] + 2.5)
    assert approx(A.masked_mean(x, torch.zeros_like(m)), 0.0)


# --------------------------------------------------------------------------- advantage estimators


def test_gae_hand():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    m = torch.ones(1, 3)
    # gamma=lam=1: deltas 0.1, 0.1, 0.3 -> A = 0.5, 0.4, 0.3; R = A + V = 1, 1, 1
    _, ret = A.compute_gae_advantage_return(r, v, m, 1.0, 1.0)
    assert approx(ret, [[1.0, 1.0, 1.0]])
    # gamma=0.9, lam=0.5: deltas 0.9*0.6-0.5=0.04, 0.9*0.7-0.6=0.03, 0.3
    # A2=0.3, A1=0.03+0.45*0.3=0.165, A0=0.04+0.45*0.165=0.11425
    adv, ret = A.compute_gae_advantage_return(r, v, m, 0.9, 0.5)
    raw = torch.tensor([[0.11425, 0.165, 0.3]])
    assert approx(ret, raw + v)
    assert approx(adv, ref_whiten(raw, m))
    # padding may hold NaN values (a critic's output there): skipped, not propagated
    pad = torch.cat([v, torch.tensor([[float("nan")]])], 1), torch.cat([m, torch.zeros(1, 1)], 1)
    adv2, ret2 = A.compute_gae_advantage_return(torch.cat([r, torch.zeros(1, 1)], 1), *pad, 0.9, 0.5)
    assert approx(adv2[:, :3], adv) and approx(ret2[:, :3], ret) and adv2[0, 3] == ret2[0, 3] == 0


def ref_gae(r, v, m, gamma, lam):
    B, T = r.shape
    raw = torch.zeros(B, T)
    for i in range(B):
        valid = [t for t in range(T) if m[i, t] > 0]
        next_v, next_a = 0.0, 0.0
        for t in reversed(valid):
            delta = r[i, t].item() + gamma * next_v - v[i, t].item()
            next_a = delta + gamma * lam * next_a
            next_v = v[i, t].item()
            raw[i, t] = next_a
    return ref_whiten(raw, m) * m, (raw + v) * m


@pytest.mark.parametrize("holes", [False, True])
def test_gae_vs_loop(holes):
    r, m, _, g = random_batch(0, holes=holes)
    r = r + torch.randn(r.shape, generator=g) * 0.1 * m  # dense rewards too
    v = torch.randn(r.shape, generator=g)
    adv, ret = A.compute_gae_advantage_return(r, v, m, 0.95, 0.9)
    ref_adv, ref_ret = ref_gae(r, v, m, 0.95, 0.9)
    assert approx(adv, ref_adv) and approx(ret, ref_ret)


def test_grpo_hand():
    r = torch.zeros(6, 2)
    r[:, 1] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 5.0])
    m = torch.ones(6, 2)
    index = torch.tensor([7, 7, 7, 3, 3, 9])
    # group 7: mean 1/3, unbiased std sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3)
    # group 3: std 0 -> 0 / eps = 0;  singleton 9: mean 0, std 1 -> 5 / (1 + 1e-6)
    s = math.sqrt(1 / 3)
    adv, ret = A.compute_grpo_outcome_advantage(r, m, index)
    expected = torch.tensor([(2 / 3) / (s + 1e-6), (-1 / 3) / (s + 1e-6), (-1 / 3) / (s + 1e-6), 0, 0, 5 / (1 + 1e-6)])
    assert approx(adv, expected[:, None].expand(6, 2)) and approx(ret, adv)
    adv, _ = A.compute_grpo_outcome_advantage(r, m, index, norm_adv_by_std_in_grpo=False)  # Dr.GRPO
    assert approx(adv[:, 0], [2 / 3, -1 / 3, -1 / 3, 0, 0, 5])


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_vs_loop(norm):
    r, m, index, _ = random_batch(1)
    adv, _ = A.compute_grpo_outcome_advantage(r, m, index, norm_adv_by_std_in_grpo=norm)
    scores = (r * m).sum(-1)
    expected = torch.zeros_like(scores)
    for members in groups_of(index).values():
        vals = [scores[i].item() for i in members]
        n = len(vals)
        mean = sum(vals) / n if n > 1 else 0.0
        std = math.sqrt(sum((x - mean) ** 2 for x in vals) / (n - 1)) if n > 1 else 1.0
        for i in members:
            expected[i] = (scores[i] - mean) / (std + 1e-6) if norm else scores[i] - mean
    assert approx(adv, expected[:, None] * m)


def test_rloo_hand_and_loop():
    r = torch.zeros(6, 2)
    r[:, 1] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 5.0])
    index = torch.tensor([7, 7, 7, 3, 3, 9])
    # 1 - mean(0, 0) = 1;  0 - mean(1, 0) = -0.5 (twice);  group 3: 0, 0;  singleton: 0 by convention
    adv, _ = A.compute_rloo_outcome_advantage(r, torch.ones(6, 2), index)
    assert approx(adv[:, 0], [1, -0.5, -0.5, 0, 0, 0])

    r, m, index, _ = random_batch(2)
    adv, ret = A.compute_rloo_outcome_advantage(r, m, index)
    scores = (r * m).sum(-1)
    expected = torch.zeros_like(scores)
    for members in groups_of(index).values():
        for i in members:
            others = [scores[j].item() for j in members if j != i]
            expected[i] = scores[i] - sum(others) / len(others) if others else 0.0
    assert approx(adv, expected[:, None] * m) and approx(ret, adv)


def test_reinforce_pp_hand_and_loop():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 7.0]])
    m = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    # gamma 0.5: row 0 returns 0.25, 0.5, 1; row 1 (the 7 is padding) 0.5, 1
    adv, ret = A.compute_reinforce_plus_plus_outcome_advantage(r, m, 0.5)
    assert approx(ret, [[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]])
    assert approx(adv, ref_whiten(ret, m) * m)

    r, m, _, g = random_batch(3, holes=True)
    r = r + torch.randn(r.shape, generator=g) * m
    adv, ret = A.compute_reinforce_plus_plus_outcome_advantage(r, m, 0.9)
    expected = torch.zeros_like(r)
    for i in range(r.shape[0]):
        running = 0.0
        for t in reversed(range(r.shape[1])):
            if m[i, t] == 0:
                running = 0.0  # a masked token ends the return of what precedes it
                continue
            running = r[i, t].item() + 0.9 * running
            expected[i, t] = running
    assert approx(ret, expected) and approx(adv, ref_whiten(expected, m) * m)


def test_reinforce_pp_baseline_vs_loop():
    r, m, index, _ = random_batch(4)
    adv, _ = A.compute_reinforce_plus_plus_baseline_outcome_advantage(r, m, index)
    scores = (r * m).sum(-1)
    centered = torch.zeros_like(r)
    for members in groups_of(index).values():
        mean = sum(scores[i].item() for i in members) / len(members) if len(members) > 1 else 0.0
        for i in members:
            centered[i] = (scores[i] - mean) * m[i]
    assert approx(adv, ref_whiten(centered, m, eps=1e-8) * m)


def test_compute_advantage_dispatch():
    r, m, index, g = random_batch(5)
    v = torch.randn(r.shape, generator=g)
    assert approx(A.compute_advantage("gae", r, m, values=v, gamma=0.9, lam=0.8)[0],
                  A.compute_gae_advantage_return(r, v, m, 0.9, 0.8)[0])
    assert approx(A.compute_advantage("grpo", r, m, index, norm_adv_by_std_in_grpo=False)[0],
                  A.compute_grpo_outcome_advantage(r, m, index, norm_adv_by_std_in_grpo=False)[0])
    assert approx(A.compute_advantage("rloo", r, m, index)[0], A.compute_rloo_outcome_advantage(r, m, index)[0])
    assert approx(A.compute_advantage("reinforce_plus_plus", r, m, gamma=0.7)[1],
                  A.compute_reinforce_plus_plus_outcome_advantage(r, m, 0.7)[1])
    assert approx(A.compute_advantage("reinforce_plus_plus_baseline", r, m, index)[0],
                  A.compute_reinforce_plus_plus_baseline_outcome_advantage(r, m, index)[0])
    with pytest.raises(ValueError, match="grpo.*rloo"):
        A.compute_advantage("ppo", r, m, index)
    with pytest.raises(ValueError, match="index"):
        A.compute_advantage("grpo", r, m)
    with pytest.raises(ValueError, match="values"):
        A.compute_advantage("gae", r, m)


# --------------------------------------------------------------------------- aggregation


def test_agg_loss_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [9.0, 9.0, 9.0]])
    m = torch.tensor([[1.0, 1, 0], [1, 1, 1], [0, 0, 0]])
    # valid sum 1+2+4+5+6 = 18 over 5 tokens and 2 non-empty rows (the empty row is not a sequence)
    assert A.loss_denominator(m, "token-mean") == 5.0
    assert A.loss_denominator(m, "seq-mean-token-mean") == 2.0
    assert approx(A.agg_loss(loss, m, "token-mean", 5), 18 / 5)
    assert approx(A.agg_loss(loss, m, "seq-mean-token-sum", 2), 18 / 2)
    assert approx(A.agg_loss(loss, m, "seq-mean-token-mean", 2), (1.5 + 5.0) / 2)
    assert approx(A.agg_loss(loss, m, "seq-mean-token-sum-norm", 2, horizon=4), 18 / (2 * 4))
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-sum-norm"):
        A.agg_loss(loss, m, "mean", 1)
    with pytest.raises(ValueError, match="token-mean"):
        A.loss_denominator(m, "sum")
    with pytest.raises(ValueError, match="horizon"):
        A.agg_loss(loss, m, "seq-mean-token-sum-norm", 2)


def ref_agg(loss, m, mode, horizon):
    rows = [[loss[i, t].item() for t in range(loss.shape[1]) if m[i, t] > 0] for i in range(loss.shape[0])]
    rows = [row for row in rows if row]
    tokens = sum(len(row) for row in rows)
    total = sum(sum(row) for row in rows)
    if mode == "token-mean":
        return total / tokens
    if mode == "seq-mean-token-sum":
        return total / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in rows) / len(rows)
    return total / (len(rows) * horizon)


def random_splits(B, rng, num_shards):
    """Rows shuffled into `num_shards` DP shards, each cut into 1..3 micro-batches (some may be empty)."""
    rows = list(range(B))
    rng.shuffle(rows)
    cuts = sorted(rng.sample(range(B + 1), num_shards - 1))
    shards = [rows[a:b] for a, b in zip([0] + cuts, cuts + [B])]
    micro = []
    for shard in shards:
        k = rng.randint(1, 3)
        bounds = sorted(rng.choices(range(len(shard) + 1), k=k - 1))
        micro += [shard[a:b] for a, b in zip([0] + bounds, bounds + [len(shard)])]
    return micro


def trimmed(t, rows, m):
    """A micro-batch padded only to its own longest row, as a packer would produce."""
    sub = m[rows]
    T = int(sub.nonzero()[:, 1].max()) + 1 if sub.sum() > 0 else 1
    return t[rows][:, :T]


MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_split_invariance(mode):
    _, m, _, g = random_batch(6, B=12, T=7)
    loss = torch.randn(m.shape, generator=g)
    whole = A.agg_loss(loss, m, mode, A.loss_denominator(m, mode), horizon=7)
    assert approx(whole, ref_agg(loss, m, mode, 7))
    rng = random.Random(0)
    for trial in range(20):
        micro = [rows for rows in random_splits(12, rng, num_shards=1 + trial % 4) if rows]
        denom = sum(A.loss_denominator(trimmed(m, rows, m), mode) for rows in micro)
        total = sum(A.agg_loss(trimmed(loss, rows, m), trimmed(m, rows, m), mode, denom, horizon=7) for rows in micro)
        assert approx(total, whole, 1e-12)
    # an all-padding mini-batch (its denominator 0: no valid token, no non-empty row) contributes 0, not 0/0 = nan
    empty = torch.zeros_like(m)
    assert A.loss_denominator(empty, mode) == 0.0
    assert A.agg_loss(loss, empty, mode, A.loss_denominator(empty, mode), horizon=7).item() == 0.0


# --------------------------------------------------------------------------- policy loss


def hand_ppo_inputs():
    ratio = torch.tensor([[1.1, 1.5, 0.5, 0.9, 5.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    return torch.zeros(1, 5), torch.log(ratio).requires_grad_(), adv, torch.ones(1, 5)


def test_ppo_loss_hand():
    old, logp, adv, m = hand_ppo_inputs()
    # per token max(-A r, -A clip(r, 0.8, 1.2)), then for A<0 min(., 3 * -A):
    #   -1.1 (unclipped) | max(-1.5,-1.2) = -1.2 (clipped) | max(0.5, 0.8) = 0.8 (clipped)
    #   0.9 (unclipped)  | max(5, 1.2) = 5 -> dual clip min(5, 3) = 3
    # token-mean: (-1.1 - 1.2 + 0.8 + 0.9 + 3) / 5 = 0.48; clipfrac 2/5; lower 1/5
    loss, metrics = A.compute_policy_loss(old, logp, adv, m, global_denominator=5, clip_ratio_c=3.0)
    assert approx(loss.detach(), 0.48)
    assert approx(metrics["pg_clipfrac"], 0.4) and approx(metrics["pg_clipfrac_lower"], 0.2)
    assert approx(metrics["ppo_kl"], -math.log(1.1 * 1.5 * 0.5 * 0.9 * 5.0) / 5)
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dlogp (-A r) = -A r: only tokens 0 and 3 are unclipped -> -1.1/5 and +0.9/5
    assert approx(grad, [[-1.1 / 5, 0.0, 0.0, 0.9 / 5, 0.0]])
    # clip-higher (DAPO): with high=0.6 token 1 (r=1.5 < 1.6) is no longer clipped
    old, logp, adv, m = hand_ppo_inputs()
    loss, metrics = A.compute_policy_loss(old, logp, adv, m, 5, clip_ratio_low=0.2, clip_ratio_high=0.6)
    (grad,) = torch.autograd.grad(loss, logp)
    assert approx(grad, [[-1.1 / 5, -1.5 / 5, 0.0, 0.9 / 5, 0.0]]) and approx(metrics["pg_clipfrac"], 0.2)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        A.compute_policy_loss(old, logp, adv, m, 5, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="vanilla.*gspo.*cispo"):
        A.compute_policy_loss(old, logp, adv, m, 5, policy_loss_mode="ppo")
    with pytest.raises(ValueError, match="global_tokens"):
        A.compute_policy_loss(old, logp, adv, m, 1, loss_agg_mode="seq-mean-token-mean")


def test_ppo_loss_at_ratio_one_is_minus_mean_advantage():
    _, m, _, g = random_batch(7)
    adv = torch.randn(m.shape, generator=g)
    logp = torch.randn(m.shape, generator=g)
    loss, metrics = A.compute_policy_loss(logp, logp.clone(), adv, m, A.loss_denominator(m, "token-mean"))
    assert approx(loss, -(adv * m).sum() / m.sum())
    assert approx(metrics["pg_clipfrac"], 0.0) and approx(metrics["ppo_kl"], 0.0)


def ref_ppo_token(old, new, a, low, high, c):
    r = math.exp(new - old)
    l1, l2 = -a * r, -a * min(max(r, 1 - low), 1 + high)
    clipped = max(l1, l2)
    loss = min(clipped, -a * c) if a < 0 else clipped
    # d loss/d new: -a r on the unclipped branch, else 0
    grad = -a * r if loss == l1 and l1 >= l2 else 0.0
    return loss, float(l2 > l1), float(a < 0 and clipped > -a * c), grad


def test_ppo_loss_vs_loop_with_gradient():
    _, m, _, g = random_batch(8)
    old = torch.randn(m.shape, generator=g) * 0.1 - 1
    logp = (old + torch.randn(m.shape, generator=g) * 0.6).requires_grad_()
    adv = torch.randn(m.shape, generator=g)
    isw = (torch.rand(m.shape, generator=g) + 0.5).requires_grad_()  # a constant of the loss: no gradient reaches it
    N = m.sum().item()
    loss, metrics = A.compute_policy_loss(old, logp, adv, m, N, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                          clip_ratio_c=2.0, rollout_is_weights=isw)
    grad, isw_grad = torch.autograd.grad(loss, [logp, isw], allow_unused=True)
    assert isw_grad is None
    tot = [0.0, 0.0, 0.0, 0.0]
    ref_grad = torch.zeros_like(old)
    for i, t in m.nonzero().tolist():
        lo, cf, cfl, gr = ref_ppo_token(old[i, t].item(), logp[i, t].item(), adv[i, t].item(), 0.2, 0.28, 2.0)
        tot[0] += lo * isw[i, t].item()
        tot[1] += cf
        tot[2] += cfl
        tot[3] += old[i, t].item() - logp[i, t].item()
        ref_grad[i, t] = gr * isw[i, t] / N
    assert 0 < tot[1] < N and tot[2] > 0  # both clip branches are exercised
    assert approx(loss, tot[0] / N)
    assert approx(metrics["pg_clipfrac"], tot[1] / N) and approx(metrics["pg_clipfrac_lower"], tot[2] / N)
    assert approx(metrics["ppo_kl"], tot[3] / N)
    assert approx(grad, ref_grad)


@pytest.mark.parametrize("policy_loss_mode", ["vanilla", "gspo", "cispo"])
@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_split_invariance(mode, policy_loss_mode):
    if policy_loss_mode == "gspo" and mode != "seq-mean-token-mean":  # the one aggregation GSPO is defined with
        with pytest.raises(ValueError, match=f"gspo needs loss_agg_mode seq-mean-token-mean, got '{mode}'"):
            A.compute_policy_loss(*torch.zeros(4, 1, 1), 1, loss_agg_mode=mode, policy_loss_mode="gspo")
        return
    _, m, _, g = random_batch(9)
    old = torch.randn(m.shape, generator=g) * 0.1 - 1
    logp = old + torch.randn(m.shape, generator=g) * 0.5
    adv = torch.randn(m.shape, generator=g)
    kw = dict(loss_agg_mode=mode, policy_loss_mode=policy_loss_mode, horizon=7, clip_ratio_c=2.0)
    whole, wm = A.compute_policy_loss(old, logp, adv, m, A.loss_denominator(m, mode),
                                      global_tokens=A.loss_denominator(m, "token-mean"), **kw)
    rng = random.Random(1)
    for trial in range(8):
        micro = [rows for rows in random_splits(12, rng, num_shards=1 + trial % 4) if rows]
        cut = [[trimmed(t, rows, m) for t in (old, logp, adv, m)] for rows in micro]
        denom = sum(A.loss_denominator(c[3], mode) for c in cut)
        tokens = sum(A.loss_denominator(c[3], "token-mean") for c in cut)
        parts = [A.compute_policy_loss(*c, denom, global_tokens=tokens, **kw) for c in cut]
        assert approx(sum(p[0] for p in parts), whole, 1e-12)
        for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
            assert approx(sum(p[1][key] for p in parts), wm[key], 1e-12)
    # an all-padding mini-batch: a finite 0 loss with a zero gradient and zero metrics, not nan
    empty, logp = torch.zeros_like(m), logp.clone().requires_grad_()
    loss, metrics = A.compute_policy_loss(old, logp, adv, empty, A.loss_denominator(empty, mode),
                                          global_tokens=A.loss_denominator(empty, "token-mean"), **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert all(v.item() == 0.0 for v in metrics.values())


def test_gspo_value_and_gradient():
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # row 0: log ratios 0.1, -0.05, (pad) -> sequence ratio exp(0.025); row 1: 1.0 each -> exp(1), clipped
    logp = torch.tensor([[0.1, -0.05, 9.0], [1.0, 1.0, 1.0]], requires_grad=True)
    adv = torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 1.0]])
    m = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    loss, metrics = A.compute_policy_loss(old, logp, adv, m, 2, loss_agg_mode="seq-mean-token-mean",
                                          policy_loss_mode="gspo", clip_ratio_low=0.2, clip_ratio_high=0.2,
                                          global_tokens=5)
    s0 = math.exp(0.025)
    # seq-mean-token-mean: (-2 s0 + -1 * 1.2) / 2
    assert approx(loss.detach(), (-2 * s0 - 1.2) / 2)
    assert approx(metrics["pg_clipfrac"], 3 / 5)
    (grad,) = torch.autograd.grad(loss, logp)
    # each valid token of row 0 gets -A s0 / (2 tokens) / (2 seqs); row 1 is clipped
    assert approx(grad, [[-2 * s0 / 4, -2 * s0 / 4, 0.0], [0.0, 0.0, 0.0]])


def test_gspo_ratio_is_clamped_at_exp_10_without_gradient_beyond():
    logp = torch.full((2, 3), 15.0, requires_grad=True)  # log rho = 15 for every sequence
    m, adv = torch.ones(2, 3), -torch.ones(2, 3)
    loss, _ = A.compute_policy_loss(torch.zeros(2, 3), logp, adv, m, 2, loss_agg_mode="seq-mean-token-mean",
                                    policy_loss_mode="gspo", global_tokens=6)
    assert approx(loss.detach(), math.exp(10.0))  # -A rho with rho = e^10, not e^15
    assert torch.autograd.grad(loss, logp)[0].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_of_equal_scores_has_zero_advantage(dtype):
    r = torch.zeros(16, 3, dtype=dtype)  # one group of 16 responses that all scored 0.7 (partial credit)
    r[:, 2] = 0.7
    m, index = torch.ones(16, 3, dtype=dtype), torch.zeros(16, dtype=torch.long)
    for est in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        assert A.compute_advantage(est, r, m, index)[0].abs().max() == 0, est


def test_cispo_gradient_flows_through_clipped_tokens():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.0, 2.0, 0.5]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, _ = A.compute_policy_loss(old, logp, adv, torch.ones(1, 3), 3, policy_loss_mode="cispo",
                                    clip_ratio_low=10.0, clip_ratio_high=0.28)
    (grad,) = torch.autograd.grad(loss, logp)
    # -A sg(clip(r, -9, 1.28)) / 3: weights 1, 1.28 (clipped, still a gradient), 0.5
    assert approx(grad, [[-1.0 / 3, -1.28 / 3, 0.5 / 3]])


# --------------------------------------------------------------------------- value loss


def test_value_loss_hand_and_split():
    vpreds, values, returns = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 2.0]]), torch.tensor([[1.5, 0.0]])
    # token 0: clip(1, -0.5, 0.5) = 0.5 -> max(0.25, 1.0) = 1.0 (clipped); token 1: max(4, 4) = 4
    loss, clipfrac = A.compute_value_loss(vpreds, values, returns, torch.ones(1, 2), 2, cliprange_value=0.5)
    assert approx(loss, 0.5 * (1.0 + 4.0) / 2) and approx(clipfrac, 0.5)

    _, m, _, g = random_batch(10)
    v, R = torch.randn(m.shape, generator=g), torch.randn(m.shape, generator=g)
    vp = v + torch.randn(m.shape, generator=g)
    whole, wcf = A.compute_value_loss(vp, v, R, m, A.loss_denominator(m, "token-mean"), 0.5)
    micro = [rows for rows in random_splits(12, random.Random(2), 3) if rows]
    denom = sum(A.loss_denominator(m[rows], "token-mean") for rows in micro)
    parts = [A.compute_value_loss(vp[rows], v[rows], R[rows], m[rows], denom, 0.5) for rows in micro]
    assert approx(sum(p[0] for p in parts), whole, 1e-12) and approx(sum(p[1] for p in parts), wcf, 1e-12)


# --------------------------------------------------------------------------- KL


def test_kl_penalty_hand():
    logp, ref = torch.tensor([0.5, -0.5, 0.0, 30.0]), torch.zeros(4)
    assert approx(A.kl_penalty(logp, ref, "kl"), [0.5, -0.5, 0.0, 30.0])
    assert approx(A.kl_penalty(logp, ref, "k1"), A.kl_penalty(logp, ref, "kl"))
    assert approx(A.kl_penalty(logp, ref, "abs"), [0.5, 0.5, 0.0, 30.0])
    assert approx(A.kl_penalty(logp, ref, "mse"), [0.125, 0.125, 0.0, 450.0])
    # exp(-x) + x - 1: x=0.5 -> 0.1065307, x=-0.5 -> 0.1487213, x=30 -> 29 clamped to 10
    k3 = A.kl_penalty(logp, ref, "low_var_kl")
    assert approx(k3, [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 0.0, 10.0])
    assert approx(A.kl_penalty(logp, ref, "k3"), k3)
    with pytest.raises(ValueError, match="low_var_kl"):
        A.kl_penalty(logp, ref, "full")


def test_kl_estimators_sampled_and_gradients():
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(6, generator=g).requires_grad_()
    logq = torch.log_softmax(torch.randn(6, generator=g), -1)
    logp = torch.log_softmax(theta, -1)
    p = logp.exp()
    kl_pq = (p * (logp - logq)).sum()
    kl_qp = (logq.exp() * (logq - logp)).sum()
    # k1 and k3 on tokens sampled from p are unbiased for KL(p||q)
    tokens = torch.multinomial(p.detach(), 400_000, replacement=True, generator=g)
    for name in ("k1", "k3"):
        est = A.kl_penalty(logp.detach()[tokens], logq[tokens], name)
        assert abs(est.mean() - kl_pq.detach()) < 4 * est.std() / math.sqrt(len(tokens)) + 1e-4
    # as losses (expectation taken exactly with weights sg(p)):
    #   grad E[k1] = sum p grad log p = 0;  grad E[k2] = sum p x grad log p = grad KL(p||q);
    #   grad E[k3] = sum p (1 - q/p) grad log p = -sum q grad log p = grad KL(q||p)
    def grad_of(name):
        return torch.autograd.grad((p.detach() * A.kl_penalty(logp, logq, name)).sum(), theta, retain_graph=True)[0]
    assert approx(grad_of("k1"), torch.zeros(6), 1e-12)
    assert approx(grad_of("k2"), torch.autograd.grad(kl_pq, theta, retain_graph=True)[0], 1e-12)
    assert approx(grad_of("k3"), torch.autograd.grad(kl_qp, theta, retain_graph=True)[0], 1e-12)
    # per-token gradients: d k2/d logp = x, d k3/d logp = 1 - exp(-x)
    x = torch.tensor([0.3, -0.7]).requires_grad_()
    assert approx(torch.autograd.grad(A.kl_penalty(x, torch.zeros(2), "k2").sum(), x)[0], x.detach())
    assert approx(torch.autograd.grad(A.kl_penalty(x, torch.zeros(2), "k3").sum(), x)[0], 1 - torch.exp(-x.detach()))


def test_kl_controllers():
    fixed = A.FixedKLController(0.05)
    fixed.update(100.0, 64)
    assert fixed.value == 0.05
    ctl = A.AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=1000)  # error clip(0.5) = 0.2 -> x(1 + 0.2 * 0.1) = 0.102
    assert math.isclose(ctl.value, 0.102)
    ctl.update(current_kl=5.4, n_steps=1000)  # error -0.1 -> x0.99
    assert math.isclose(ctl.value, 0.102 * 0.99)
    other = A.AdaptiveKLController(1.0, 6.0, 10000)
    other.load_state_dict(ctl.state_dict())
    assert other.value == ctl.value
    fixed.load_state_dict({"value": 0.3})  # a resumed run's fixed coefficient is its config's, not the checkpoint's
    assert fixed.value == 0.05


def test_apply_kl_penalty():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    m = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0]])
    ref = torch.tensor([[-1.5, -2.0, -0.2], [-0.8, -1.2, 0.0]])
    # k1 = old - ref: row 0: 0.5, 0, -0.3 (mean 0.2/3); row 1: -0.2, 0.2, pad (mean 0)
    ctl = A.AdaptiveKLController(0.1, target_kl=0.01, horizon=100)
    rewards, metrics = A.apply_kl_penalty(scores, old, ref, m, ctl, kl_penalty="kl")
    assert approx(rewards, [[-0.05, 0.0, 1.03], [0.02, 0.98, 0.0]])
    assert math.isclose(metrics["actor/reward_kl_penalty"], (0.2 / 3) / 2)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    # kl 0.0333 > target 0.01: error clipped to 0.2, n_steps = batch size 2 -> 0.1 * (1 + 0.2 * 2/100)
    assert math.isclose(ctl.value, 0.1 * 1.004)


def test_padding_holding_nan_or_inf_changes_nothing():
    """Padding may hold anything (a pad token's log-prob can be -inf): the estimators and the KL in reward must
    select the valid tokens, not multiply by the mask (0 * nan = nan)."""
    r, m, index, g = random_batch(3)
    v, bad_r = torch.randn(r.shape, generator=g), torch.where(m.bool(), r, torch.nan)
    for est in A.ADV_ESTIMATORS:
        kw = dict(index=index, values=v)
        want, got = A.compute_advantage(est, r * m, m, **kw), A.compute_advantage(est, bad_r, m, **kw)
        assert all(torch.equal(w * m, g * m) for w, g in zip(want, got)), est
    old, ref = torch.randn(r.shape, generator=g), torch.randn(r.shape, generator=g)
    for bad in (torch.nan, -torch.inf):
        got, gm = A.apply_kl_penalty(r * m, torch.where(m.bool(), old, bad), ref, m, A.FixedKLController(0.1))
        want, wm = A.apply_kl_penalty(r * m, old, ref, m, A.FixedKLController(0.1))
        assert torch.equal(got, want) and gm == wm


# --------------------------------------------------------------------------- DAPO, rollout correction


def test_filter_groups():
    values = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 3.0, 2.0, 2.0])
    index = torch.tensor([5, 5, 5, 9, 9, 100, -1, -1])
    # group 5 has spread -> kept; 9 and -1 are constant -> dropped; singleton 100 kept
    assert A.filter_groups(values, index).tolist() == [True, True, True, False, False, True, False, False]
    g = torch.Generator().manual_seed(3)
    values = torch.randint(0, 2, (40,), generator=g).double()
    index = torch.randint(0, 15, (40,), generator=g) * 7
    groups = groups_of(index)
    expected = [len(groups[k]) == 1 or len({values[j].item() for j in groups[k]}) > 1 for k in index.tolist()]
    assert A.filter_groups(values, index).tolist() == expected


def test_overlong_penalty():
    lengths = torch.tensor([10, 15, 16, 18, 20])
    # max 20, buffer 5: free up to 15, then -(len - 15) / 5 * 1.0
    assert approx(A.compute_overlong_penalty(lengths, 20, 5, 1.0), [0.0, 0.0, -0.2, -0.6, -1.0], 1e-6)
    assert approx(A.compute_overlong_penalty(lengths, 20, 5, 0.5), [0.0, 0.0, -0.1, -0.3, -0.5], 1e-6)
    assert approx(A.compute_overlong_penalty(torch.tensor([25]), 20, 5, 1.0), [-1.0], 1e-6)  # DAPO: -1 past L_max
    with pytest.raises(ValueError, match="overlong_buffer.len=0 must be in"):
        A.compute_overlong_penalty(lengths, 20, 0, 1.0)


def test_rollout_is_weights_and_metrics():
    rollout = torch.zeros(1, 4)
    old = torch.log(torch.tensor([[1.5, 3.0, 0.5, 7.0]])).requires_grad_()
    m = torch.tensor([[1.0, 1, 1, 0]])
    w = A.compute_rollout_is_weights(old, rollout, m, threshold=2.0)
    assert approx(w, [[1.5, 2.0, 0.5, 0.0]]) and not w.requires_grad
    # sequence: exp(log 1.5 + log 3 + log 0.5) = 2.25 -> truncated at 2, or kept under threshold 3
    assert approx(A.compute_rollout_is_weights(old, rollout, m, 2.0, "sequence"), [[2.0, 2.0, 2.0, 0.0]])
    assert approx(A.compute_rollout_is_weights(old, rollout, m, 3.0, "sequence"), [[2.25, 2.25, 2.25, 0.0]])
    with pytest.raises(ValueError, match="token, sequence"):
        A.compute_rollout_is_weights(old, rollout, m, level="geometric")
    p_train = torch.log(torch.tensor([[0.5, 0.4, 0.9]]))
    p_roll = torch.log(torch.tensor([[0.45, 0.1, 0.1]]))
    metrics = A.rollout_mismatch_metrics(p_train, p_roll, torch.tensor([[1.0, 1, 0]]))
    # |0.5 - 0.45| = 0.05, |0.4 - 0.1| = 0.3 (third token is padding)
    assert math.isclose(metrics["training/rollout_probs_diff_mean"], 0.175)
    assert math.isclose(metrics["training/rollout_probs_diff_max"], 0.3)
    assert math.isclose(metrics["training/rollout_probs_diff_std"], 0.125 * math.sqrt(2))  # unbiased, as verl


def test_ppo_loss_log_ratio_is_clamped_to_plus_minus_20():
    # log ratios 1000, 1000, 1000, -15 with A = 1, -1, 0, 1 (verl: rho = exp(clamp(logp - logp_old, -20, 20)))
    old = torch.zeros(1, 4)
    logp = torch.tensor([[1000.0, 1000.0, 1000.0, -15.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 0.0, 1.0]])
    m = torch.ones(1, 4)
    loss, metrics = A.compute_policy_loss(old, logp, adv, m, 4, clip_ratio_c=3.0)
    # t0: max(-e^20, -1.2) = -1.2 (clipped) | t1: max(e^20, 1.2) -> dual clip 3 | t2: A = 0 -> 0 (not 0 * inf = nan)
    # t3: rho = e^-15 inside the clamp: max(-e^-15, -0.8) = -e^-15, unclipped
    assert approx(loss.detach(), (-1.2 + 3.0 + 0.0 - math.exp(-15)) / 4, 1e-12)
    assert approx(metrics["ppo_kl"], -(20 + 20 + 20 - 15) / 4)  # -log ratio, clamped as verl does
    assert approx(metrics["pg_clipfrac"], 1 / 4) and approx(metrics["pg_clipfrac_lower"], 1 / 4)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(grad).all()
    assert approx(grad, [[0.0, 0.0, 0.0, -math.exp(-15) / 4]], 1e-15)


def test_k3_has_a_finite_zero_gradient_at_huge_log_ratios():
    # x = logp - ref = -1000: exp(-x) overflows unless -x is clamped at 20 first (verl's low_var_kl); the result is
    # clamped to 10 either way, so the gradient must be exactly 0, not 0 * inf = nan
    logp = torch.tensor([-1000.0, 1000.0, 0.3], requires_grad=True)
    k3 = A.kl_penalty(logp, torch.zeros(3), "low_var_kl")
    assert approx(k3.detach(), [10.0, 10.0, math.exp(-0.3) + 0.3 - 1])
    (grad,) = torch.autograd.grad(k3.sum(), logp)
    assert torch.isfinite(grad).all()
    assert approx(grad, [0.0, 0.0, 1 - math.exp(-0.3)])


def test_cispo_clipfrac_counts_clipped_weights():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.0, 2.0, 0.5]]))
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, metrics = A.compute_policy_loss(old, logp, adv, torch.ones(1, 3), 3, policy_loss_mode="cispo",
                                          clip_ratio_low=10.0, clip_ratio_high=0.28)
    # weights clip(r, -9, 1.28) = 1, 1.28 (clipped), 0.5: one of three tokens clipped
    assert approx(metrics["pg_clipfrac"], 1 / 3)
    assert approx(metrics["pg_clipfrac_lower"], 0.0)
    # L = -A w logp: 0, -1.28 log 2, +0.5 log 0.5
    assert approx(loss, (-1.28 * math.log(2.0) + 0.5 * math.log(0.5)) / 3)


def test_value_loss_in_sequence_modes_and_its_clipfrac_per_token():
    values = torch.zeros(2, 3)
    vpreds = torch.tensor([[1.0, 0.2, 9.0], [-1.0, 9.0, 9.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1, 0], [1, 0, 0]])
    # cliprange 0.5 around V_old = 0:
    #   (0,0): V 1 -> 0.5: max((1-2)^2, (0.5-2)^2) = 2.25, clipped branch larger
    #   (0,1): V 0.2 stays: 0.04 both                  (1,0): V -1 -> -0.5: max(4, 2.25) = 4
    per_row_sum, per_row_mean = [2.25 + 0.04, 4.0], [(2.25 + 0.04) / 2, 4.0]
    cases = {"token-mean": (3, sum(per_row_sum) / 3), "seq-mean-token-sum": (2, sum(per_row_sum) / 2),
             "seq-mean-token-mean": (2, sum(per_row_mean) / 2),
             "seq-mean-token-sum-norm": (2, sum(per_row_sum) / (2 * 5))}
    for mode, (denom, expected) in cases.items():
        loss, clipfrac = A.compute_value_loss(vpreds, values, returns, m, denom, cliprange_value=0.5,
                                              loss_agg_mode=mode, horizon=5, global_tokens=3)
        assert approx(loss, 0.5 * expected), mode
        assert approx(clipfrac, 1 / 3), mode  # 1 clipped token of 3 valid tokens, not of 2 sequences


def test_adaptive_kl_controller_clips_an_undershoot_at_minus_20_percent():
    ctl = A.AdaptiveKLController(init_kl_coef=1.0, target_kl=6.0, horizon=100)
    ctl.update(current_kl=0.0, n_steps=50)  # error clip(-1, -0.2, 0.2) = -0.2 -> x(1 - 0.2 * 0.5) = 0.9
    assert math.isclose(ctl.value, 0.9)


def test_overlong_buffer_longer_than_max_response_length_is_rejected():
    lengths = torch.tensor([10, 20])
    with pytest.raises(ValueError, match=r"overlong_buffer.len=21 must be in \(0, max_response_length=20\]"):
        A.compute_overlong_penalty(lengths, 20, 21, 1.0)
    # the boundary len == max is allowed: penalty -len / 20
    assert approx(A.compute_overlong_penalty(lengths, 20, 20, 1.0), [-0.5, -1.0], 1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_need_index(estimator):
    r, m = torch.zeros(2, 2), torch.ones(2, 2)
    with pytest.raises(ValueError, match=f"{estimator}.*needs the group ids"):
        A.compute_advantage(estimator, r, m)
