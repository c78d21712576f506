"""rollout.py: greedy parity with transformers, continuous batching, log-probs against teacher forcing,
sampling statistics and masks, stops, prefill sharing, tensor parallelism, CUDA graphs (GPU only)."""
import dataclasses
import glob
import json
import math
import os
import re
import types

import numpy as np
import pytest
import torch

import helpers
import parallel
import rollout
from model import load_model
from rollout import Generator, SamplingParams


def rand_prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def teacher_logits(model, seq):
    """The model's logits over a whole sequence through the training path (model.packed)."""
    ids = torch.tensor(seq)
    with torch.no_grad():
        return model.logits(model.packed(ids, torch.arange(len(seq)), torch.tensor([0, len(seq)], dtype=torch.int32),
                                         len(seq)))


def tokens(comps):
    return [c.token_ids for c in comps]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return helpers.make_checkpoint(str(tmp_path_factory.mktemp("qwen2")), "qwen2", with_tokenizer=False)


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt).eval()


# ----------------------------------------------------------------------------- greedy and batching


@pytest.mark.parametrize("family", helpers.FAMILIES)
def test_greedy_matches_transformers(family, tmp_path):
    path = helpers.make_checkpoint(str(tmp_path), family, with_tokenizer=False)
    ours, ref = load_model(path).eval(), helpers.hf_model(path)
    prompts = rand_prompts((5, 13, 2, 9), seed=1)
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    eos = Generator(ours, max_rows=8).generate(prompts, greedy)[0].token_ids[3]  # an EOS that does occur
    got = Generator(ours, max_rows=8, sync_every=4).generate(prompts, greedy, eos_token_ids=[eos])
    for p, c in zip(prompts, got):
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), do_sample=False, max_new_tokens=10, eos_token_id=eos,
                               pad_token_id=eos, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        want = out[0, len(p):].tolist()
        assert c.token_ids == want, (family, c.prompt_index)
        assert c.finish_reason == ("stop" if want[-1] == eos else "length")
    assert got[0].finish_reason == "stop" and len(got[0].token_ids) <= 4


def test_continuous_batching_with_a_small_cache(model):
    prompts = rand_prompts((4, 12, 7, 1, 15, 6, 9), seed=2)
    greedy = SamplingParams(temperature=0, max_new_tokens=9)
    eos = Generator(model, max_rows=8).generate(prompts, greedy)[1].token_ids[2]  # stops some rows early
    alone = [Generator(model, max_rows=1).generate([p], greedy, eos_token_ids=[eos])[0] for p in prompts]
    small = Generator(model, max_rows=2, sync_every=3)
    got = small.generate(prompts, greedy, eos_token_ids=[eos])
    assert small.cache.rows == 2 and small.stats["prefill_forwards"] >= 4  # rows were reused
    assert tokens(got) == tokens(alone)
    assert {c.finish_reason for c in got} == {"stop", "length"}
    for a, b in zip(got, alone):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
    # draws are keyed by (seed, prompt, sample, position): the cache size does not change samples
    sampled = SamplingParams(temperature=1.0, n=2, max_new_tokens=9, seed=3)
    three = Generator(model, max_rows=3, sync_every=5)
    a = three.generate(prompts, sampled, eos_token_ids=[eos])
    b = Generator(model, max_rows=32).generate(prompts, sampled, eos_token_ids=[eos])
    assert tokens(a) == tokens(b)
    assert small.stats["compactions"] + three.stats["compactions"] >= 1  # the tail moved rows forward
    # a compaction moves a row's whole state: its noise key and its own max_new_tokens too (sampled, per-prompt
    # limits, many stops so that rows end at different times): equal to a cache that never compacts
    mixed = SamplingParams(temperature=1.0, n=2, max_new_tokens=12, stop_token_ids=tuple(range(0, 256, 5)), seed=3)
    limits = [12, 3, 12, 5, 12, 2, 12]
    five = Generator(model, max_rows=5, sync_every=2)
    a = five.generate(prompts, mixed, max_new_tokens=limits)
    roomy = Generator(model, max_rows=14)
    b = roomy.generate(prompts, mixed, max_new_tokens=limits)
    assert five.stats["compactions"] >= 1 and roomy.stats["compactions"] == 0
    assert tokens(a) == tokens(b) and {c.finish_reason for c in a} == {"stop", "length"}
    for c in a:
        assert len(c.token_ids) <= limits[c.prompt_index]
        p = prompts[c.prompt_index]
        logits = teacher_logits(model, p + c.token_ids)[len(p) - 1:-1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert (torch.tensor(c.logprobs) - want).abs().max().item() <= 1e-5, (c.prompt_index, c.sample_index)


# ----------------------------------------------------------------------------- log-probs and sampling


@pytest.mark.parametrize("temperature,top_k", [(0.0, -1), (1.0, -1), (0.6, 20)])
def test_logprobs_match_teacher_forcing(model, temperature, top_k):
    prompts = rand_prompts((6, 11, 3), seed=4)
    params = SamplingParams(temperature=temperature, top_k=top_k, n=2, max_new_tokens=8, seed=1)
    comps = Generator(model, max_rows=8, sync_every=4).generate(prompts, params)
    for c in comps:
        p = prompts[c.prompt_index]
        logits = teacher_logits(model, p + c.token_ids)[len(p) - 1:-1]
        # log_softmax(logits / T) over the whole vocabulary (T = 1 for greedy), not top-k-renormalised
        want = torch.log_softmax(logits / (temperature or 1.0), -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert (torch.tensor(c.logprobs) - want).abs().max().item() <= 1e-5
        if temperature == 0:
            assert c.token_ids == logits.argmax(-1).tolist()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic, pooling the cells expected below 5 into one; returns (statistic, dof)."""
    expected = probs.double() * counts.sum()
    big = expected >= 5
    obs, exp = counts[big].double(), expected[big]
    if not big.all():
        obs, exp = torch.cat([obs, counts[~big].double().sum()[None]]), torch.cat([exp, expected[~big].sum()[None]])
    return ((obs - exp) ** 2 / exp).sum().item(), len(obs) - 1


def test_sampling_is_reproducible_and_follows_the_softmax(model):
    prompt = rand_prompts((7,), seed=5)[0]
    T, n = 0.8, 16384
    params = SamplingParams(n=n, temperature=T, max_new_tokens=1, seed=11)
    gen = Generator(model, max_rows=2048)  # the samples of one prompt come in 8 admissions
    a = tokens(gen.generate([prompt], params))
    assert a == tokens(gen.generate([prompt], params))
    assert a != tokens(gen.generate([prompt], dataclasses.replace(params, seed=12)))
    logits = teacher_logits(model, prompt)[-1]
    counts = torch.bincount(torch.tensor([t[0] for t in a]), minlength=logits.numel())
    stat, dof = chi_square(counts, torch.softmax(logits / T, -1))
    limit = dof + 5 * math.sqrt(2 * dof)  # ~5 sigma: generous, yet far below a wrong distribution's
    assert stat < limit, (stat, dof)
    wrong, _ = chi_square(counts, torch.softmax(logits / (T * 0.9), -1))  # the test can tell T from 0.9 T
    assert wrong > limit, (wrong, limit)


def test_gumbel_noise_is_finite_at_the_top_of_the_hash_range():
    """u must stay below 1 in fp32: at u = 1 the noise is +inf and that token wins whatever its logit. Key 0 at
    position 0 reaches the top hash among the first 2^24 token ids (a 24-bit u rounded it to 1 there)."""
    import rollout
    g = rollout.gumbel(torch.tensor([0]), torch.tensor([0]), torch.arange(2 ** 24))
    assert g.isfinite().all()
    assert g.max().item() > 16.5  # -log(-log(1 - 2^-24)) = 16.64: the top of the range was reached


def test_top_k_and_top_p_masks_are_exact(model):
    prompt = rand_prompts((6,), seed=6)[0]
    T = 1.5
    probs = torch.softmax(teacher_logits(model, prompt)[-1] / T, -1)
    order = probs.argsort(descending=True)
    mass = probs[order].cumsum(0)
    gen = Generator(model, max_rows=1500)

    def drawn(**kw):
        comps = gen.generate([prompt], SamplingParams(n=1500, temperature=T, max_new_tokens=1, seed=2, **kw))
        return {c.token_ids[0] for c in comps}

    assert drawn(top_k=7) == set(order[:7].tolist())
    # a nucleus halfway between the top-5 and top-6 masses keeps exactly the top 6
    assert drawn(top_p=((mass[4] + mass[5]) / 2).item()) == set(order[:6].tolist())
    # top-k first, then the nucleus of the renormalised top 10
    mass10 = mass[:10] / mass[9]
    assert drawn(top_k=10, top_p=((mass10[2] + mass10[3]) / 2).item()) == set(order[:4].tolist())
    # later tokens too: every token of a top-3 completion is among the top 3 of its teacher-forced logits
    comps = gen.generate([prompt], SamplingParams(n=4, temperature=T, top_k=3, max_new_tokens=8, seed=3))
    for c in comps:
        logits = teacher_logits(model, prompt + c.token_ids)[len(prompt) - 1:-1]
        rank = (logits > logits.gather(1, torch.tensor(c.token_ids)[:, None])).sum(-1)
        assert rank.max().item() < 3


def test_top_k_keeps_the_tokens_tied_with_the_kth_logit():
    """top-k keeps every token whose logit is >= the k-th largest, as transformers' TopKLogitsWarper does: with the
    3rd and 4th largest tied, top_k=3 draws from 4 tokens (torch.topk alone would keep an arbitrary one of the two).
    The draw among the survivors is the unfiltered Gumbel-max's wherever that falls among them."""
    from transformers.generation.logits_process import TopKLogitsWarper
    import rollout
    B, V = 4000, 12
    row = torch.tensor([2.0, 0.5, 1.0, 1.0, -1.0, 3.0, 0.0, 1.0, -2.0, 0.25, 0.9, 1.5])  # 1.0 three times: k-th tied
    logits = row.repeat(B, 1)
    keys = torch.tensor([rollout.sample_key(3, i, 0) for i in range(B)])
    pos = torch.full((B,), 7)
    for k in (3, 4, 5, 6, 1):
        keep = TopKLogitsWarper(k)(None, row[None].clone())[0].isfinite()
        floor = rollout.top_k_floor(logits, k, None)
        tok, lp = rollout.sample_tokens(logits, keys, pos, 1.0, None, floor=floor)
        assert set(tok.tolist()) == set(keep.nonzero()[:, 0].tolist()), k
        assert torch.allclose(lp, torch.log_softmax(row, -1)[tok])  # the unfiltered softmax's log-prob
        free, _ = rollout.sample_tokens(logits, keys, pos, 1.0, None)
        inside = keep[free]
        assert torch.equal(tok[inside], free[inside]) and inside.any() and not inside.all()
    # the vocabulary limit comes first: the k-th largest among the ids < limit
    assert rollout.top_k_floor(logits, 2, None, limit=5).tolist() == [1.0] * B


TIED = torch.tensor([2.0, 0.5, 1.0, 1.0, -1.0, 3.0, 0.0, 1.0, -2.0, 0.25, 0.9, 1.5])  # 1.0 at ids 2, 3 and 7


def _tied_draws(k: int, p: float, B: int = 60000, rank: int = 0, group=None, device="cpu", dtype=torch.float32,
                T: float = 1.0):
    import rollout
    keys = torch.tensor([rollout.sample_key(9, i, 0) for i in range(B)], device=device)
    V = len(TIED) // (1 if group is None else 2)  # at tp=2 each rank holds 6 ids: ties 2, 3 on rank 0, 7 on rank 1
    tok, lp = rollout.sample_top_k_top_p(TIED[rank * V:(rank + 1) * V].to(device, dtype).repeat(B, 1), keys,
                                         torch.full((B,), 5, device=device), T, k, p, group, vocab_start=rank * V)
    return tok.cpu(), lp.cpu()


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("cpu", torch.bfloat16), pytest.param(
    "cuda", torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_top_k_top_p_keeps_the_ties_as_transformers(device, dtype):
    """With top_p too, every token tied with the k-th largest is in the top-k (it used to be cut where torch.topk
    cut it) and the nucleus counts them all: the draw frequencies of each logit value match transformers'
    TopKLogitsWarper + TopPLogitsWarper. Which of the ties a partial nucleus keeps is an order among equal logits
    (transformers' is its sort's); ours spreads the kept share of their mass evenly over them. top_k 0: top-p alone,
    whose nucleus ends among the ties at p = 0.75 (2 of 3 in). bf16: the nucleus' bisection runs over 16-bit keys.
    At T 0.7 and 1.5 the nucleus ends among the ties too (1 or 2 of 3 in, by transformers' warpers), so the kept
    share must come from the tempered distribution."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    row = TIED.to(dtype).float()
    for k, p, T in ((4, 0.95, 1.0), (4, 0.85, 1.0), (5, 0.9, 1.0), (6, 0.99, 1.0), (3, 0.9, 1.0), (12, 0.5, 1.0),
                    (0, 0.75, 1.0), (0, 0.9, 1.0), (0, 0.3, 1.0), (0, 0.845, 0.7), (4, 0.945, 0.7), (0, 0.65, 1.5),
                    (4, 0.75, 1.5)):
        tok, lp = _tied_draws(k, p, device=device, dtype=dtype, T=T)  # on CUDA the draws are the Triton sampler's
        freq = torch.bincount(tok, minlength=len(TIED)).float() / len(tok)
        ref = TemperatureLogitsWarper(T)(None, row[None].clone())
        ref = torch.softmax(TopPLogitsWarper(p)(None, TopKLogitsWarper(k)(None, ref) if k else ref), -1)[0]
        for v in row.unique():
            at = row == v
            assert abs(freq[at].sum() - ref[at].sum()) < 0.01, (k, p, T, v)
            assert torch.allclose(freq[at], ref[at].sum() / at.sum(), atol=0.005), (k, p, T, v)  # (each id's own)
        assert torch.allclose(lp, torch.log_softmax(row / T, -1)[tok])  # the unfiltered softmax's log-prob


def _tied_tp_body(rank, world):
    import torch.distributed as dist
    return [_tied_draws(k, p, 2000, rank, dist.group.WORLD) for k, p in ((4, 0.95), (4, 0.85), (5, 0.9), (0, 0.75))]


def test_top_k_top_p_ties_across_tensor_parallel_ranks():
    """The ties counted over the ranks, in id order across them: tp=2 draws what one process draws."""
    r0, r1 = helpers.run_distributed(_tied_tp_body, 2)
    for (k, p), (t0, lp0), (t1, _) in zip(((4, 0.95), (4, 0.85), (5, 0.9), (0, 0.75)), r0, r1):
        one, lp = _tied_draws(k, p, 2000)
        assert torch.equal(t0, one) and torch.equal(t1, one) and torch.allclose(lp0, lp), (k, p)


NEG = torch.tensor([float("-inf")] * 4 + [1.0, 2.0, 0.5, 0.0])  # top_p 0.9 keeps ids 5, 4, 6 (0.58, 0.21, 0.13)


def _neg_draws(rank=0, group=None, B=2000):
    import rollout
    keys = torch.tensor([rollout.sample_key(9, i, 0) for i in range(B)])
    V = len(NEG) // (1 if group is None else 2)
    return rollout.sample_top_k_top_p(NEG[rank * V:(rank + 1) * V].repeat(B, 1), keys, torch.full((B,), 5), 1.0, 0,
                                      0.9, group, vocab_start=rank * V)


def _neg_tp_body(rank, world):
    import torch.distributed as dist
    return _neg_draws(rank, dist.group.WORLD)


def test_top_p_edge_cases():
    """A rank (or a kernel part) whose logits are all -inf weighs nothing (its NaN sums used to poison the nucleus:
    every draw was id 0); a top_p so small that top_p x the mass underflows keeps the argmax; fp64 logits are read
    as fp32."""
    import rollout
    tok, lp = _neg_draws()
    assert set(tok.tolist()) == {4, 5, 6} and torch.allclose(lp, torch.log_softmax(NEG, -1)[tok])
    for t, l in helpers.run_distributed(_neg_tp_body, 2):
        assert torch.equal(t, tok) and torch.allclose(l, lp)
    from transformers.generation.logits_process import TopPLogitsWarper
    for probs, p, want in (([0.5, 0.25, 0.25], 0.5, {0}), ([0.5, 0.25, 0.125, 0.125], 0.75, {0, 1})):
        row = torch.tensor(probs).log()  # the mass above a token exactly top_p (exact in fp32): that token is out
        keep = set(TopPLogitsWarper(p)(None, row[None].clone())[0].isfinite().nonzero()[:, 0].tolist())
        drawn = rollout.sample_top_k_top_p(row.repeat(2000, 1), torch.arange(2000), torch.full((2000,), 3), 1.0, 0, p,
                                           None)[0]
        assert set(drawn.tolist()) == keep == want, (probs, p)
    row, keys, pos = torch.tensor([[0.0, 5.0, 1.0, 2.0]] * 8), torch.arange(8), torch.full((8,), 3)
    assert rollout.sample_top_k_top_p(row, keys, pos, 1.0, 0, 1e-300, None)[0].tolist() == [1] * 8
    a, b = (rollout.sample_top_k_top_p(row.to(dt), keys, pos, 1.0, 2, 0.9, None) for dt in (torch.float32,
                                                                                           torch.float64))
    assert torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1].float())


def test_vocab_size_limits_the_draw_not_the_softmax(model):
    prompt = rand_prompts((5,), seed=7)[0]
    comps = Generator(model, max_rows=512, vocab_size=128).generate(
        [prompt], SamplingParams(n=512, temperature=2.0, max_new_tokens=2, seed=1))
    drawn = torch.tensor(tokens(comps))
    assert drawn.max().item() < 128 and len(set(drawn[:, 0].tolist())) > 20
    logp = torch.log_softmax(teacher_logits(model, prompt)[-1] / 2.0, -1)
    assert max(abs(c.logprobs[0] - logp[c.token_ids[0]].item()) for c in comps) <= 1e-5


# ----------------------------------------------------------------------------- stops, n, errors


def test_stop_tokens_and_max_length(model):
    prompts = rand_prompts((5, 8, 3), seed=8)
    free = tokens(Generator(model, max_rows=4).generate(prompts, SamplingParams(temperature=0, max_new_tokens=10)))
    stop = free[0][4]
    gen = Generator(model, max_rows=4, sync_every=16)
    got = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(stop,)))
    for c, f in zip(got, free):
        want = f[:f.index(stop) + 1] if stop in f else f
        assert c.token_ids == want and c.finish_reason == ("stop" if stop in f else "length")
    # ignore_eos drops the EOS ids, not the explicit stop ids
    got = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True), eos_token_ids=stop)
    assert tokens(got) == free and {c.finish_reason for c in got} == {"length"}
    got = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10), max_new_tokens=[3, 1, 10])
    assert tokens(got) == [free[0][:3], free[1][:1], free[2]]
    # sampled, with several stop ids: nothing follows a stop token, and max_new_tokens bounds the rest
    stops = set(free[1][:4])
    comps = gen.generate(prompts, SamplingParams(n=16, temperature=1.0, max_new_tokens=7, seed=4,
                                                 stop_token_ids=tuple(stops)))
    for c in comps:
        assert not stops & set(c.token_ids[:-1]) and 1 <= len(c.token_ids) <= 7
        assert c.finish_reason == ("stop" if c.token_ids[-1] in stops else "length")
        assert c.finish_reason == "stop" or len(c.token_ids) == 7
    assert {c.finish_reason for c in comps} == {"stop", "length"}


def test_n_samples_share_one_prefill(model):
    prompts = rand_prompts((5, 9, 4), seed=9)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=5, seed=7)
    gen = Generator(model, max_rows=12)
    comps = gen.generate(prompts, params)
    assert [(c.prompt_index, c.sample_index) for c in comps] == [(p, s) for p in range(3) for s in range(4)]
    assert gen.stats["prefill_forwards"] == 1 and gen.stats["prefill_tokens"] == 18
    assert all(len({tuple(c.token_ids) for c in comps[4 * p:4 * p + 4]}) > 1 for p in range(3))
    # 3 rows for groups of 4: every prompt is admitted in two pieces, so prefilled twice
    small = Generator(model, max_rows=3)
    assert tokens(small.generate(prompts, params)) == tokens(comps)
    assert small.stats["prefill_tokens"] == 36


def test_prefill_is_chunked_by_max_prefill_tokens(model):
    """Admitted prompts are prefilled in packed chunks of at most max_prefill_tokens tokens (a prompt longer than
    that alone in its chunk): with a budget of 4, prompts of 3, 1, 6, 2 tokens make chunks [3, 1] (exactly 4),
    [6], [2], so 3 forwards where an unlimited budget makes 1. The chunking does not change the completions."""
    prompts = rand_prompts((3, 1, 6, 2), seed=14)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=2)
    whole = Generator(model, max_rows=8)
    want = whole.generate(prompts, params)
    chunked = Generator(model, max_rows=8, max_prefill_tokens=4)
    got = chunked.generate(prompts, params)
    assert whole.stats["prefill_forwards"] == 1 and chunked.stats["prefill_forwards"] == 3
    assert chunked.stats["prefill_tokens"] == whole.stats["prefill_tokens"] == 12
    assert tokens(got) == tokens(want)
    assert max(abs(x - y) for a, b in zip(got, want) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5


def test_free_then_generate_again(model):
    """free() drops the cache and its buffers (the model stays); the next generate() allocates them again and gives
    the same completions, with a fixed max_len and with the cache sized at first use."""
    prompts = rand_prompts((5, 9, 3), seed=15)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=4)
    for max_len in (16, None):
        gen = Generator(model, max_rows=3, max_len=max_len)
        first = gen.generate(prompts, params)
        gen.free()
        assert gen.cache is None and gen.tok is None and gen.out_tok is None
        again = gen.generate(prompts, params)
        assert gen.cache is not None and tokens(again) == tokens(first), max_len
        assert [c.logprobs for c in again] == [c.logprobs for c in first], max_len


def test_per_request_seeds_do_not_depend_on_the_batch(model):
    """With seeds, a prompt's samples are the same whatever else is in the batch and wherever it stands; without,
    the draws are keyed by the prompt's index, so the same prompt moved in the batch draws differently."""
    prompts = rand_prompts((5, 9, 4), seed=12)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=1)
    gen = Generator(model, max_rows=4)
    whole = tokens(gen.generate(prompts, params, seeds=[11, 22, 33]))
    alone = tokens(gen.generate([prompts[2], prompts[0]], params, seeds=[33, 11]))
    assert alone == whole[6:9] + whole[0:3]
    assert tokens(gen.generate(prompts, params, seeds=[11, 22, 34]))[6:9] != whole[6:9]
    assert tokens(gen.generate([prompts[2]], params))[0:3] != tokens(gen.generate(prompts, params))[6:9]
    with pytest.raises(ValueError, match="seeds: expected 3 ints"):
        gen.generate(prompts, params, seeds=[1, 2])
    # numpy ids and seeds (a parquet column, an arange) draw what the same Python ints draw; numpy floats are refused
    as_np = [np.asarray(p, dtype=np.int64) for p in prompts]
    assert tokens(gen.generate(as_np, params, seeds=list(np.array([11, 22, 33])))) == whole
    with pytest.raises(ValueError, match=r"prompt 0: token id \S*3\.0\S* is not an int"):
        gen.generate([np.array([3.0, 1.0])], params)
    same_length = rand_prompts((5, 5), seed=13)  # one 2-D array (its truth value is ambiguous)
    assert tokens(gen.generate(np.array(same_length), params)) == tokens(gen.generate(same_length, params))


def test_samples_read_their_prompt_from_one_row(model, monkeypatch):
    """Decode reads a prompt's k/v from one row for all its samples: with the other rows' copies overwritten by
    noise after each prefill, greedy samples (which end together, so that row outlives them) are unchanged."""
    prompts = rand_prompts((5, 9, 4, 12), seed=10)
    greedy = SamplingParams(n=3, temperature=0, max_new_tokens=6)
    want = Generator(model, max_rows=4).generate(prompts, dataclasses.replace(greedy, n=1))
    prefill = Generator._prefill

    def prefill_then_poison(self, chunk, *args):
        prefill(self, chunk, *args)
        for p, _, rows in chunk:
            copies = self.cache.kv[:, rows[1:], :, :, :len(prompts[p])]
            self.cache.kv[:, rows[1:], :, :, :len(prompts[p])] = torch.randn_like(copies) * 10
    monkeypatch.setattr(Generator, "_prefill", prefill_then_poison)
    gen = Generator(model, max_rows=5, sync_every=2)  # samples of a prompt split over admissions, rows refilled
    got = gen.generate(prompts, greedy)
    assert gen.stats["prefill_forwards"] >= 3
    for c in got:
        assert c.token_ids == want[c.prompt_index].token_ids, (c.prompt_index, c.sample_index)
        assert max(abs(x - y) for x, y in zip(c.logprobs, want[c.prompt_index].logprobs)) <= 1e-5


def test_errors_name_the_problem(model):
    gen = Generator(model, max_rows=2, max_len=16)
    with pytest.raises(ValueError, match="prompt 1 has 12 tokens.*max_new_tokens=8.*needs 19.*max_len=16"):
        gen.generate([[1, 2], list(range(12))], SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        gen.generate([[]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="prompt 0: token id 999 is not an int in the model's vocabulary 0..271"):
        gen.generate([[1, 999]], SamplingParams(max_new_tokens=2))
    for bad, key in ((dict(top_p=0.0), "top_p"), (dict(temperature=-1.0), "temperature"), (dict(n=0), "n="),
                     (dict(top_k=-3), "top_k"), (dict(max_new_tokens=0), "max_new_tokens"),
                     (dict(stop_token_ids=5), r"stop_token_ids=5: expected a list or tuple of ints \(one id: \(id,"),
                     (dict(stop_token_ids=[1, 2.0]), "stop_token_ids"), (dict(seed=1.5), "seed=1.5: expected an int"),
                     (dict(seed=None), "seed=None"),
                     (dict(stop_token_ids=(7, 272)), "stop_token_ids: id 272 is outside the model's vocab.*0..271")):
        with pytest.raises(ValueError, match=f"SamplingParams.{key}"):
            gen.generate([[1]], SamplingParams(**{"max_new_tokens": 2, **bad}))
    with pytest.raises(ValueError, match="expected 2 ints"):
        gen.generate([[1], [2]], SamplingParams(max_new_tokens=2), max_new_tokens=[1])
    with pytest.raises(ValueError, match="budget of 10 tokens.*one row of 64 positions"):
        Generator(model, max_len=64, kv_cache_tokens=10)
    with pytest.raises(ValueError, match="vocab_size=999"):
        Generator(model, vocab_size=999)


def test_cache_sized_at_first_use_keeps_the_rows_its_budget_holds(model):
    # sized to the need rounded up to 64 positions (room to grow), unless that costs rows; the need is prompt +
    # max_new_tokens - 1 positions (the last token is never fed back)
    prompts = rand_prompts((60,), seed=5)
    gen = Generator(model, max_rows=4, kv_cache_tokens=100)  # 69 positions needed: 100 holds one row, 128 none
    gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10))
    assert (gen.cache.rows, gen.cache.max_len) == (1, 69)
    with pytest.raises(ValueError, match="budget of 68 tokens .* cannot hold one row of 69 positions"):  # (not 128)
        Generator(model, max_rows=4, kv_cache_tokens=68).generate(prompts, SamplingParams(max_new_tokens=10))
    gen = Generator(model, max_rows=16, kv_cache_tokens=1000)
    gen.generate(rand_prompts((56,) * 16, seed=6), SamplingParams(temperature=0, max_new_tokens=10))
    assert (gen.cache.rows, gen.cache.max_len) == (15, 65)  # 1000 // 65, not 1000 // 128 = 7
    gen = Generator(model, max_rows=4)  # no budget on CPU: max_rows rows, rounded up
    gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10))
    assert (gen.cache.rows, gen.cache.max_len) == (4, 128)


@pytest.mark.parametrize("family,dtype", [("qwen2", torch.float32), ("qwen2", torch.bfloat16),
                                          ("qwen3", torch.bfloat16)])
def test_kv_cache_bytes_per_token(family, dtype, tmp_path):
    """On CUDA the row count is free memory // KVCache.bytes_per_token: it must be what the cache takes per
    position, k and v of every layer and (local) KV head, here against the allocated tensor and by hand. GQA (4 q
    heads, 2 kv heads); qwen3 has head_dim 24 != 64 / 4."""
    from model import KVCache
    m = load_model(helpers.make_checkpoint(str(tmp_path), family, with_tokenizer=False), dtype=dtype).eval()
    gen = Generator(m, max_rows=3, max_len=20)
    kv = gen.cache.kv
    per = KVCache.bytes_per_token(m.cfg, 4, 1, dtype)
    assert kv.dtype == dtype and kv.numel() * kv.element_size() == 3 * 20 * per
    d, size = (24 if family == "qwen3" else 16), (4 if dtype == torch.float32 else 2)
    assert per == 2 * 4 * 2 * d * size  # k and v, 4 layers, 2 kv heads, head_dim d, bytes per element
    assert KVCache.bytes_per_token(m.cfg, 4, 2, dtype) == per // 2  # tp=2: one kv head a rank
    assert KVCache.bytes_per_token(m.cfg, 4, 4, dtype) == per // 2  # tp=4: each kv head held by two ranks


def test_cli_checks_the_sampling_options_first(capsys):
    with pytest.raises(SystemExit):  # before loading anything: the directory does not exist
        rollout.main(["/nonexistent", "--prompt", "hi", "--n", "0"])
    assert "--n=0: expected an int >= 1" in capsys.readouterr().err


def test_cli_names_a_missing_directory_or_tokenizer(tmp_path):
    """Not transformers' hub error for a local path, nor "prompt 0 is empty" from the 1-token tokenizer that
    AutoTokenizer makes up for a directory without tokenizer files."""
    with pytest.raises(FileNotFoundError, match="tokenizer directory '/nonexistent' does not exist"):
        rollout.main(["/nonexistent", "--prompt", "hi"])
    path = helpers.make_checkpoint(str(tmp_path / "m"), "qwen2", with_tokenizer=False)
    with pytest.raises(FileNotFoundError, match="m' holds no tokenizer files"):
        rollout.main([path, "--prompt", "hi"])


def test_cli_usage_errors_after_loading(tmp_path, capsys, monkeypatch):
    """What the CLI sees only once the tokenizer is loaded: an empty prompt, a prompt + --max-new-tokens past the
    model's sliding window (worded in the CLI's terms), --chat without a chat template: a usage line, exit 2."""
    monkeypatch.setattr(rollout.torch.cuda, "is_available", lambda: False)
    path = helpers.make_checkpoint(str(tmp_path / "m"), "mistral", sliding_window=16)
    for args, msg in ((["--prompt", ""], "prompt 0 is empty"),
                      (["--prompt", "hello", "--max-new-tokens", "40"], r"max_len=44 \(the longest prompt \+ "
                       r"max_new_tokens - 1\) exceeds the model's sliding_window=16"),
                      (["--prompt", "hello", "--chat"], "--chat: the tokenizer in .* has no chat template")):
        if "--chat" in args:  # the template lives in chat_template.jinja or in tokenizer_config.json
            for f in glob.glob(os.path.join(path, "chat_template.*")):
                os.remove(f)
            conf = json.load(open(os.path.join(path, "tokenizer_config.json")))
            conf.pop("chat_template", None)
            json.dump(conf, open(os.path.join(path, "tokenizer_config.json"), "w"))
        with pytest.raises(SystemExit) as e:
            rollout.main([path, *args])
        assert e.value.code == 2 and re.search(msg, capsys.readouterr().err), args


def test_eos_token_ids_join_the_tokenizer_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text('{"eos_token_id": 7}')
    assert rollout.eos_token_ids(str(tmp_path), types.SimpleNamespace(eos_token_id=7)) == [7]
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 3]}')  # Qwen2.5-Instruct's shape
    assert rollout.eos_token_ids(str(tmp_path), types.SimpleNamespace(eos_token_id=1)) == [1, 3, 7]
    (tmp_path / "config.json").write_text('{}')
    assert rollout.eos_token_ids(str(tmp_path), types.SimpleNamespace(eos_token_id=None)) == [3, 7]


def test_sliding_window_model_fits_when_the_sequence_does(tmp_path):
    path = helpers.make_checkpoint(str(tmp_path), "mistral", with_tokenizer=False, sliding_window=100)
    ours, ref = load_model(path).eval(), helpers.hf_model(path)
    prompt = rand_prompts((80,), seed=3)[0]
    for new in (10, 21):  # 89 positions needed: the cache must not round up past the window; 100: the window's
        gen = Generator(ours, max_rows=2)
        got = gen.generate([prompt], SamplingParams(temperature=0, max_new_tokens=new), eos_token_ids=[258])
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, eos_token_id=258,
                                pad_token_id=258, attention_mask=torch.ones(1, 80, dtype=torch.long))
        assert got[0].token_ids == want[0, 80:].tolist() and gen.cache.max_len <= 100
    with pytest.raises(ValueError, match=r"max_len=101 \(the longest prompt \+ max_new_tokens - 1\) exceeds the "
                                         r"model's sliding_window=100"):
        gen.generate([prompt], SamplingParams(temperature=0, max_new_tokens=22))


# ----------------------------------------------------------------------------- tensor parallel


def _tp_body(rank, world, path, prompts):
    model = load_model(path, parallel.make_layout(tp=2)).eval()
    gen = Generator(model, max_rows=4, sync_every=3, vocab_size=200)
    runs = [gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8)),
            gen.generate(prompts, SamplingParams(temperature=1.0, n=2, max_new_tokens=8, seed=4)),
            gen.generate(prompts, SamplingParams(temperature=1.0, n=2, max_new_tokens=6, seed=5, top_k=5, top_p=0.9)),
            gen.generate(prompts, SamplingParams(temperature=1.0, n=2, max_new_tokens=6, seed=6, top_k=5)),
            gen.generate(prompts, SamplingParams(temperature=0.8, n=2, max_new_tokens=6, seed=7, top_p=0.8))]
    return [(tokens(r), [c.logprobs for c in r]) for r in runs]


def test_tensor_parallel_generation(ckpt, model):
    prompts = rand_prompts((6, 3, 10), seed=10)
    r0, r1 = helpers.run_distributed(_tp_body, 2, ckpt, prompts)
    gen = Generator(model, max_rows=4, sync_every=3, vocab_size=200)
    single = [gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8)),
              gen.generate(prompts, SamplingParams(temperature=1.0, n=2, max_new_tokens=8, seed=4)),
              gen.generate(prompts, SamplingParams(temperature=1.0, n=2, max_new_tokens=6, seed=5, top_k=5, top_p=0.9)),
              gen.generate(prompts, SamplingParams(temperature=1.0, n=2, max_new_tokens=6, seed=6, top_k=5)),
              gen.generate(prompts, SamplingParams(temperature=0.8, n=2, max_new_tokens=6, seed=7, top_p=0.8))]
    for (t0, lp0), (t1, lp1), one in zip(r0, r1, single):
        assert t0 == t1 and lp0 == lp1  # both ranks agree exactly
        # and match one process: the draws do not depend on tp (barring fp32 rounding at a boundary)
        assert t0 == tokens(one)
        assert max(abs(a - b) for x, y in zip(lp0, one) for a, b in zip(x, y.logprobs)) <= 1e-5


# ----------------------------------------------------------------------------- GPU only

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_graphs_match_eager_and_free_releases_memory(ckpt):
    model = load_model(ckpt, dtype=torch.bfloat16, device="cuda").eval()
    prompts = rand_prompts((5, 40, 17, 3, 60, 9), seed=11)
    warm = Generator(model, max_rows=4)  # cuBLAS workspaces (one per stream) outlive any Generator
    warm.generate(prompts, SamplingParams(max_new_tokens=4))
    warm.free()
    base = torch.cuda.memory_allocated()
    outs = {}
    for graphs in (False, True):
        gen = Generator(model, max_rows=4, sync_every=5, use_cuda_graphs=graphs)
        outs[graphs] = [gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=30)),
                        gen.generate(prompts, SamplingParams(temperature=1.0, n=3, max_new_tokens=20, seed=1)),
                        gen.generate(prompts, SamplingParams(temperature=0.7, n=2, max_new_tokens=20, top_k=8)),
                        gen.generate(prompts, SamplingParams(temperature=0.9, n=2, max_new_tokens=20, top_k=8,
                                                             top_p=0.8))]
        assert (gen.stats["graphs_captured"] > 0) == graphs
        gen.free()
        edge = Generator(model, max_rows=4, max_len=60, use_cuda_graphs=graphs)  # the 60-token prompt fills its row
        outs[graphs].append(edge.generate(prompts, SamplingParams(temperature=0), max_new_tokens=[20] * 4 + [1, 20]))
        edge.free()
        assert torch.cuda.memory_allocated() == base
    for a, b in zip(outs[False], outs[True]):
        assert tokens(a) == tokens(b)
        assert max(abs(x - y) for ca, cb in zip(a, b) for x, y in zip(ca.logprobs, cb.logprobs)) <= 1e-3


@cuda
@pytest.mark.parametrize("B,hkv,g,d,L,longest,shared", [
    (256, 2, 7, 64, 768, 768, False), (1, 4, 7, 128, 2000, 2000, False), (5, 2, 2, 24, 37, 37, False),
    (3, 2, 7, 64, 8192, 300, False), (256, 2, 7, 64, 768, 768, True), (6, 4, 7, 128, 3000, 3000, True)])
def test_decode_attention_kernel_matches_matmul(B, hkv, g, d, L, longest, shared):
    """Rows of any length up to `longest` in a cache of L positions (the kernel splits each row by its length:
    in the last case most splits are empty); each row's new k/v are stored at its last position and used there
    (row 0 has only that one: its output is v_new's, not the stale v's). `shared`: rows in pairs share a prompt,
    the second row reading it from the first (its own prompt positions differ); the reference holds copies."""
    import model as M
    if not M.TRITON:
        pytest.skip("needs triton")
    torch.manual_seed(0)
    k, v = (torch.randn(B, hkv, L + 9, d, device="cuda", dtype=torch.bfloat16)[:, :, :L] for _ in range(2))
    q, kn, vn = torch.randn(B, hkv * (g + 2), d, device="cuda", dtype=torch.bfloat16).split([hkv * g, hkv, hkv], 1)
    lengths = torch.randint(1, longest + 1, (B,), device="cuda", dtype=torch.int32)
    lengths[0] = 1
    prefix, (k_ref, v_ref) = shared_prompt(k, v, lengths) if shared else (None, (k, v))
    k_ref, v_ref = k_ref.float(), v_ref.float()  # copies: the reference stores into these
    got = M.decode_attention(q, kn, vn, k, v, lengths, prefix)
    M.TRITON = False
    try:
        want = M.decode_attention(q.float(), kn.float(), vn.float(), k_ref, v_ref, lengths)
    finally:
        M.TRITON = True
    assert ((got.float() - want).norm(dim=-1) / want.norm(dim=-1)).max().item() < 2e-2  # every row and head
    if shared:  # each row's new k/v went to its own row, past its prompt
        k, v = copy_prompts(k, prefix), copy_prompts(v, prefix)
    assert torch.equal(k.float(), k_ref) and torch.equal(v.float(), v_ref)  # stored at lengths - 1, nothing else


def copy_prompts(cache, prefix):
    """cache [B, Hkv, L, d] with row b's first plen[b] positions copied from row src[b], as the generator holds it."""
    src, plen = prefix
    shared = (torch.arange(cache.shape[2], device=cache.device)[None, :] < plen[:, None])[:, None, :, None]
    return torch.where(shared, cache[src.long()], cache)


def shared_prompt(k, v, lengths):
    """Rows in pairs (2i, 2i+1) share a prompt shorter than both rows: prefix = (src, plen), and the caches with
    the prompts copied."""
    B = k.shape[0]
    plen = (torch.rand(B // 2, device=k.device) * lengths.view(-1, 2).amin(1)).int().repeat_interleave(2)
    prefix = ((torch.arange(B, device=k.device) // 2 * 2).int(), plen)
    return prefix, [copy_prompts(t, prefix) for t in (k, v)]


def test_decode_attention_reads_shared_prompt_positions_from_the_source_row():
    """Row 2i+1's own prompt positions hold other values than row 2i's; with the prefix it reads row 2i's."""
    import model as M
    torch.manual_seed(1)
    B, hkv, g, d, L = 6, 2, 3, 16, 40
    k, v = torch.randn(2, B, hkv, L, d)
    lengths = torch.randint(2, L + 1, (B,), dtype=torch.int32)
    q, kn, vn = torch.randn(B, hkv * (g + 2), d).split([hkv * g, hkv, hkv], 1)
    prefix, (k_copied, v_copied) = shared_prompt(k, v, lengths)
    got = M.decode_attention(q, kn, vn, k, v, lengths, prefix)
    want = M.decode_attention(q, kn, vn, k_copied, v_copied, lengths)
    assert (prefix[1][1::2] > 0).all() and torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(M.decode_attention(q, kn, vn, k, v, lengths), want, atol=1e-2)  # the rows differ


@cuda
def test_decode_attention_kernel_addresses_rows_past_2_31_elements():
    """Row b of a long cache starts b * row_stride elements in (256 rows of 20k positions pass 2^31): a row stride
    under 2^31 is an int32 argument, so the kernel must widen the row index before the product."""
    import model as M
    if not M.TRITON:
        pytest.skip("needs triton")
    torch.manual_seed(0)
    B, hkv, g, d, L, stride = 3, 2, 7, 64, 96, 2 ** 30 + 2 ** 20  # row 2 starts past 2^31 (a 4.3 GB buffer)
    base = torch.zeros(2 * stride + 2 * hkv * L * d, device="cuda", dtype=torch.bfloat16)
    k, v = (base.as_strided((B, hkv, L, d), (stride, L * d, d, 1), off) for off in (0, hkv * L * d))
    for t in (k, v):
        t.copy_(torch.randn_like(t))
    q, kn, vn = torch.randn(B, hkv * (g + 2), d, device="cuda", dtype=torch.bfloat16).split([hkv * g, hkv, hkv], 1)
    lengths = torch.tensor([L, 50, L], device="cuda", dtype=torch.int32)
    k_ref, v_ref = k.float(), v.float()
    got = M.decode_attention(q, kn, vn, k, v, lengths)
    want = M.decode_attention(q.float(), kn.float(), vn.float(), k_ref, v_ref, lengths)  # fp32: the matmul path
    assert ((got.float() - want).norm(dim=-1) / want.norm(dim=-1)).max().item() < 2e-2
    assert torch.equal(k.float(), k_ref) and torch.equal(v.float(), v_ref)


@cuda
@pytest.mark.parametrize("temperature,vocab_start,limit,top_k,ties", [
    (0.0, 0, None, 0, False), (1.0, 0, None, 0, False), (0.7, 5000, 4000, 0, False), (1.0, 0, None, 40, False),
    (0.7, 5000, 4000, 700, False), (1e-3, 0, 4000, 0, False), (1e-3, 0, 4000, 40, False), (1.0, 0, None, 40, True),
    (0.7, 5000, 4000, 700, True)])
def test_sampling_kernel_matches_the_reference(temperature, vocab_start, limit, top_k, ties):
    """On GPU the sampler's per-slice reduction is a Triton kernel over vocabulary chunks, in uint32
    arithmetic: the same hashes, so the same tokens as the int64 torch reference (with a top-k floor too). At a low
    temperature with ids past the limit above the allowed ones, the draw took token 0 of the chunk. top-p weighs the
    tokens tied with the floor (ties)."""
    import rollout
    if not rollout.TRITON:
        pytest.skip("needs triton")
    torch.manual_seed(0)
    logits = (torch.randn(64, 5000) * 3).bfloat16().cuda()  # bf16: many ties, some at the k-th largest
    if limit and temperature < 0.1:
        logits[:, limit:] += 20  # the forbidden ids lead their chunk's allowed ones by ~1e4 nats at T = 1e-3
    keys = torch.tensor([rollout.sample_key(9, i, 3) for i in range(64)], device="cuda")
    pos = torch.arange(64, device="cuda") + 11
    floor = rollout.top_k_floor(logits, top_k, None, limit) if top_k else None
    w = torch.rand(64, device="cuda") * 0.9 + 0.05 if ties else None
    want = rollout._sample_stats(logits, keys, pos, temperature, vocab_start, limit, floor, w)
    got = rollout._sample_stats_gpu(logits, keys, pos, temperature, vocab_start, limit, floor, w, chunk=1024)
    assert torch.equal(got[:, 1], want[:, 1]) and ((got - want).abs() <= 1e-3 + 1e-6 * want.abs()).all()
    if floor is not None:  # the floor bit: every token drawn is at or above it, and not all are the argmax
        picked = logits.gather(1, got[:, 1:2].long() - vocab_start)[:, 0]
        assert (picked >= floor).all() and (got[:, 1].long() != logits.argmax(-1) + vocab_start).any()


@cuda
@pytest.mark.parametrize("top_k,limit", [(0, 5000), (700, 4000)])
def test_cut_stats_kernel_matches_the_reference(top_k, limit):
    """top-p's bisection counts and sums the allowed tokens above a cut per row and step; on GPU a Triton kernel
    over parts of the row (1024 ids a part here), each summed against its own max, then combined."""
    import rollout
    if not rollout.TRITON:
        pytest.skip("needs triton")
    torch.manual_seed(0)
    logits = (torch.randn(64, 5000) * 3).bfloat16().cuda()
    floor = (rollout.top_k_floor(logits, top_k, None, limit) if top_k
             else torch.full((64,), float("-inf"), device="cuda").bfloat16())
    cut = logits.gather(1, torch.randint(0, 4000, (64, 1), device="cuda"))[:, 0]  # present values: ties counted
    got = rollout._combine_cut_stats(rollout._cut_stats(logits, cut, floor, 1 / 0.7, limit, None, split=1024)).cpu()
    want = rollout._combine_cut_stats(rollout._cut_stats_ref(logits.cpu(), cut.cpu(), floor.cpu(), 1 / 0.7, limit))
    mass = lambda st: torch.stack([st[:, 0] + st[:, 1].log(), st[:, 2] / st[:, 1]], -1)  # noqa: E731
    assert torch.allclose(mass(got), mass(want), rtol=1e-5, atol=1e-6)
    assert torch.equal(got[:, 3], want[:, 3]) and (want[:, 3] > 0).any()
    assert ((want[:, 2] / want[:, 1]) > 0.01).any() and ((want[:, 2] / want[:, 1]) < 0.99).any()


@cuda
def test_sampling_kernel_is_exact_for_the_largest_uniform():
    """A token whose hash gives the largest u (g = 16.6) and a competitor whose score is 1 nat above it: the
    competitor wins. An approximate -log2 u near u = 1 would add ~2 nats to the first and draw it instead."""
    import rollout
    if not rollout.TRITON:
        pytest.skip("needs triton")
    keys, pos = torch.tensor([rollout.sample_key(9, 0, 0)], device="cuda"), torch.tensor([11], device="cuda")
    ids = torch.arange(1 << 25, device="cuda")
    g = rollout.gumbel(keys, pos, ids)[0]
    top = int(ids[g == g.max()][0])  # 2^25 draws of 2^23 values: the largest, u = 1 - 2^-24, is there
    assert g.max().item() > 16.5
    start, other = top - 100, top + 100  # a slice of 4096 ids holding both
    logits = torch.full((1, 4096), -1e4, device="cuda")
    logits[0, 100], logits[0, 200] = 0.0, g[top] + 1 - g[other]
    logits = logits.bfloat16()
    want = rollout._sample_stats(logits, keys, pos, 1.0, start, None)
    got = rollout._sample_stats_gpu(logits, keys, pos, 1.0, start, None, chunk=1024)
    assert want[0, 1].item() == other and want[0, 0].item() - g[top].item() > 0.5
    assert torch.equal(got[:, 1], want[:, 1]) and (got - want).abs().max().item() < 1e-3


# ----------------------------------------------------------------------------- sampler paths, prompt copies, CLI


def test_greedy_ignores_top_k_and_top_p(model):
    """temperature=0 with top_k / top_p still set (a sampling config switched to greedy for evaluation): argmax
    tokens and log_softmax at T=1, as with the filters off."""
    prompts = rand_prompts((6, 11, 3), seed=21)
    for kw in (dict(top_k=5), dict(top_p=0.9), dict(top_k=5, top_p=0.9)):
        comps = Generator(model, max_rows=4, sync_every=3).generate(
            prompts, SamplingParams(temperature=0, max_new_tokens=6, **kw))
        for c in comps:
            p = prompts[c.prompt_index]
            logits = teacher_logits(model, p + c.token_ids)[len(p) - 1:-1]
            assert c.token_ids == logits.argmax(-1).tolist(), kw
            want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert (torch.tensor(c.logprobs) - want).abs().max().item() <= 1e-5, kw


def test_top_k_top_p_respect_the_vocab_size_limit(model):
    """With top_k / top_p the draw takes the filtered path: ids past `vocab_size` must still never be drawn, and the
    returned log-prob is still log_softmax(logits / T) over the whole vocabulary (those ids included)."""
    prompt = rand_prompts((5,), seed=7)[0]
    T, V = 2.0, 128
    logits0 = teacher_logits(model, prompt)[-1]
    assert (logits0 / T).topk(100).indices.ge(V).sum() > 20  # the top 100 hold many forbidden ids
    comps = Generator(model, max_rows=256, vocab_size=V).generate(
        [prompt], SamplingParams(n=256, temperature=T, top_k=100, top_p=0.98, max_new_tokens=2, seed=1))
    drawn = torch.tensor([c.token_ids for c in comps])
    assert drawn.max().item() < V and len(set(drawn[:, 0].tolist())) > 20
    for c in comps[:32]:
        logits = teacher_logits(model, prompt + c.token_ids)[len(prompt) - 1:-1]
        want = torch.log_softmax(logits / T, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert (torch.tensor(c.logprobs) - want).abs().max().item() <= 1e-5


def test_consecutive_tokens_draw_independent_noise(tmp_path):
    """A model whose logits are all 0 (final norm weight 0): every token is uniform over the vocabulary,
    independently of the others. Consecutive tokens of a sample then agree with probability 1/V (272): if two
    positions shared their Gumbel noise (an off-by-one in the noise position), every token would repeat the last."""
    m = load_model(helpers.make_checkpoint(str(tmp_path), "qwen2", with_tokenizer=False)).eval()
    with torch.no_grad():
        m.norm.weight.zero_()
    prompt = rand_prompts((5,), seed=1)[0]
    comps = Generator(m, max_rows=64, sync_every=3).generate(
        [prompt], SamplingParams(n=64, temperature=1.0, max_new_tokens=6, seed=2))
    toks = torch.tensor([c.token_ids for c in comps])  # [64, 6]
    V = m.cfg.vocab_size
    assert all(abs(lp + torch.log(torch.tensor(float(V))).item()) < 1e-5 for c in comps for lp in c.logprobs)
    same = (toks[:, 1:] == toks[:, :-1]).sum().item()  # 320 pairs, 1.2 expected equal
    assert same <= 8, same
    for t in range(6):  # and each position is spread over the vocabulary (64 draws of 272 values)
        assert len(set(toks[:, t].tolist())) > 40


def test_samples_continue_from_their_own_prompt_copy_after_the_first_stops(model):
    """A prompt's samples read its k/v from the first live sample's row; when that sample stops early, the others
    read their own copies (KVCache.copy_rows at prefill). Those copies must hold the whole prompt: log-probs of every
    sample match teacher forcing. (The existing tests never stop the first sample before its siblings.)"""
    prompts = rand_prompts((9, 4, 13), seed=31)  # one prefill chunk of prompts of different lengths
    stops = tuple(range(0, 256, 4))  # 64 ids, ~1/4 of the draws stop: lengths vary widely
    params = SamplingParams(n=5, temperature=1.0, max_new_tokens=10, stop_token_ids=stops, seed=5)
    comps = Generator(model, max_rows=16, sync_every=1).generate(prompts, params)
    by = {(c.prompt_index, c.sample_index): c for c in comps}
    first_stops_early = [p for p in range(3)
                         if len(by[p, 0].token_ids) + 1 < max(len(by[p, s].token_ids) for s in range(5))]
    assert len(first_stops_early) >= 2, first_stops_early
    for c in comps:
        p = prompts[c.prompt_index]
        logits = teacher_logits(model, p + c.token_ids)[len(p) - 1:-1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert (torch.tensor(c.logprobs) - want).abs().max().item() <= 1e-5, (c.prompt_index, c.sample_index)


# ----------------------------------------------------------------------------- rollout.py: the CLI


def test_cli_uses_seed_and_stops_at_the_generation_config_eos(tmp_path, capsys, monkeypatch):
    """`python rollout.py MODEL --prompt ...`: --seed picks the draws, the EOS ids of generation_config.json
    end a completion (here the greedy first token is made the EOS: one token, finish reason stop), and only the
    tokenizer's ids are drawn. On CPU, in fp32, like the teacher-forced reference (the CLI takes a GPU when there is
    one)."""
    from transformers import AutoTokenizer
    monkeypatch.setattr(rollout.torch.cuda, "is_available", lambda: False)
    path = helpers.make_checkpoint(str(tmp_path / "m"), "qwen2")
    ids = AutoTokenizer.from_pretrained(path).encode("hello")
    first = teacher_logits(load_model(path), ids)[-1].argmax().item()
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [first]}))

    def run(*args):
        rollout.main([path, "--prompt", "hello", "--max-new-tokens", "6", *args])
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("=== ")]

    lp = torch.log_softmax(teacher_logits(load_model(path), ids)[-1], -1)[first]
    assert run("--temperature", "0") == [f"=== prompt 0 sample 0 (1 tokens, stop, mean logprob {lp:.3f})"]
    sampled = ("--temperature", "1.0", "--n", "4")
    a, b, c = run(*sampled, "--seed", "1"), run(*sampled, "--seed", "1"), run(*sampled, "--seed", "2")
    assert a == b and a != c
    # ids past the tokenizer (259 entries; the model has 272) are never drawn, even at a high temperature
    drawn, generate = [], rollout.Generator.generate
    monkeypatch.setattr(rollout.Generator, "generate", lambda *a, **k: drawn.extend(generate(*a, **k)) or drawn)
    run("--temperature", "5", "--n", "32")
    ntok = len(AutoTokenizer.from_pretrained(path))
    assert ntok < 272 and len(drawn) == 32 and max(t for c in drawn for t in c.token_ids) < ntok
    # --top-p / --top-k reach the sampler; --chat wraps the prompt in the tokenizer's chat template (the ids are
    # apply_chat_template's, no special tokens added on top) and the printed text starts with the templated prompt
    calls = []
    monkeypatch.setattr(rollout.Generator, "generate", lambda self, prompts, params, **k: calls.append(
        (prompts, params)) or generate(self, prompts, params, **k))
    run("--top-p", "0.5", "--top-k", "3", "--seed", "7")
    assert (calls[-1][1].top_p, calls[-1][1].top_k, calls[-1][1].seed) == (0.5, 3, 7) and calls[-1][0] == [ids]
    tok = AutoTokenizer.from_pretrained(path)
    msgs = [{"role": "user", "content": "hello"}]
    rollout.main([path, "--prompt", "hello", "--max-new-tokens", "2", "--chat"])
    templated = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert templated == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert calls[-1][0] == [list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False))]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("=== prompt 0 sample 0") and "\n".join(out[1:]).startswith(templated)


# ----------------------------------------------------------------------------- rollout.py: limits at their boundary


def test_limits_accept_their_boundary_values(model):
    """MAX_STOP_IDS (64) stop ids are accepted, 65 are not; a prompt + max_new_tokens of the Generator's max_len + 1
    fits (the last token is never fed back), one more does not; a prompt that fills its row draws one token beside a
    row that goes on decoding."""
    prompt, full = rand_prompts((5, 16), seed=41)
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    want = Generator(model, max_rows=2).generate([full, prompt], greedy, max_new_tokens=[1, 12])
    gen = Generator(model, max_rows=2, max_len=16)
    got = gen.generate([full, prompt], greedy, max_new_tokens=[1, 12])
    assert tokens(got) == tokens(want) and [len(c.token_ids) for c in got] == [1, 12]
    with pytest.raises(ValueError, match="prompt 0 has 5 tokens; with max_new_tokens=13 it needs 17 cache positions"):
        gen.generate([prompt], SamplingParams(temperature=0, max_new_tokens=13))
    want = want[1].token_ids
    cap = rollout.MAX_STOP_IDS
    assert cap == 64
    ok = tuple(t for t in range(272) if t not in want[:3])[:cap]
    comps = Generator(model, max_rows=1).generate([prompt], SamplingParams(temperature=0, max_new_tokens=3,
                                                                           stop_token_ids=ok))
    assert comps[0].token_ids == want[:3] and comps[0].finish_reason == "length"
    with pytest.raises(ValueError, match="65 stop/EOS token ids given; at most 64"):
        Generator(model, max_rows=1).generate([prompt], SamplingParams(max_new_tokens=1,
                                                                       stop_token_ids=ok + (want[0],)))


def test_eos_token_ids_read_config_json(tmp_path):
    """config.json's eos_token_id counts even when neither the tokenizer nor generation_config.json names it."""
    (tmp_path / "config.json").write_text('{"eos_token_id": 5}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 9}')
    assert rollout.eos_token_ids(str(tmp_path), types.SimpleNamespace(eos_token_id=2)) == [2, 5, 9]


def test_bad_input_types_get_errors_naming_the_key(model):
    """A prompt token that is not an int is refused (a float id was silently truncated: [1.5, 2] generated from
    [1, 2]); a string temperature / top_p (YAML reads `1e-3` as one), an int for the per-prompt `max_new_tokens` or
    `seeds` lists: ValueErrors naming the key, not a TypeError from a comparison or len()."""
    gen = Generator(model, max_rows=2)
    greedy = SamplingParams(temperature=0, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt 1: token id 1.5 is not an int in the model's vocabulary 0..271"):
        gen.generate([[3], [1.5, 2]], greedy)
    with pytest.raises(ValueError, match=r"prompt 0: token id 'h' is not an int"):
        gen.generate(["hi"], greedy)
    for bad, msg in ((dict(temperature="1e-3"), r"temperature='1e-3': expected 0 \(greedy\) or a finite number"),
                     (dict(temperature=None), "temperature=None: expected 0"),
                     (dict(temperature=1e-40), r"temperature=1e-40: expected 0 \(greedy\) or a finite number >= 1e-5"),
                     (dict(temperature=float("inf")), "temperature=inf: expected 0"),
                     (dict(top_p="0.9"), r"top_p='0.9': expected a number in \(0, 1\]")):
        with pytest.raises(ValueError, match=f"SamplingParams.{msg}"):
            gen.generate([[1]], SamplingParams(**{"max_new_tokens": 2, **bad}))
    with pytest.raises(ValueError, match="max_new_tokens: expected 2 ints >= 1 .one per prompt., got 5"):
        gen.generate([[1], [2]], greedy, max_new_tokens=5)
    with pytest.raises(ValueError, match="seeds: expected 2 ints .one per prompt., got 7"):
        gen.generate([[1], [2]], greedy, seeds=7)
    assert gen.generate([[1], [2]], greedy, max_new_tokens=(1, 2), seeds=(3, 4))[1].token_ids == \
        gen.generate([[2]], greedy)[0].token_ids  # tuples are fine
