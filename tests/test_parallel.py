"""parallel.py against one process: vocab-parallel log-probs, the 1F1B pipeline, DP + ZeRO-1 AdamW
with clipping, every (tp, pp, dp) layout on 2 and 4 gloo processes, layout errors, LR schedules.

References are independent of the code under test: dense log_softmax for the vocab-parallel
log-probs, and for the layouts a one-process model with F.cross_entropy, autograd gradients,
torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import helpers
from model import ModelConfig, load_model
from parallel import (ShardedAdamW, lr_at, make_layout, model_state, pipeline_forward_backward, shard_name,
                      stage_layers, validate_layout, vocab_parallel_logprobs)

V = helpers.TINY_VOCAB
HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
MAX_NORM = 0.05
# tp=2, pp=2, dp=2; tp=2 over one KV head (bias): replicated KV heads
TP_CASES_2 = [("qwen3", 2, 1), ("qwen2_tied", 1, 2), ("llama", 1, 1), ("qwen2_kv1", 2, 1)]
# tp2 x dp2, tp2 x pp2, pp2 x dp2; tp=4 over 2 KV heads with q/k norms (their TP-partial grads), tp2 x pp2 over one
# KV head; pp=4 tied, where the embedding's holders (first and last stage) are not the only stages; pp2 x dp2 tied,
# where the tied copy's bucket must wait for the embedding all-reduce before its DP sum
TP_CASES_4 = [("qwen3", 2, 1), ("qwen2_tied", 2, 2), ("qwen2", 1, 2), ("qwen3", 4, 1), ("qwen2_kv1", 2, 2),
              ("qwen2_tied", 1, 4), ("qwen2_tied", 1, 2)]
BUCKET = 6000  # elements: ~30 buckets of "qwen3_odd", whose odd hidden size (63) makes some need padding


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- data


def micro_batch(lens, gen):
    """A packed micro-batch of random sequences with random next-token targets (lens may be empty)."""
    seqs = [torch.randint(0, V, (n,), generator=gen) for n in lens]
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    ids = torch.cat(seqs) if seqs else torch.zeros(0, dtype=torch.long)
    pos = torch.cat([torch.arange(n) for n in lens]) if lens else torch.zeros(0, dtype=torch.long)
    return {"input_ids": ids, "position_ids": pos, "cu_seqlens": cu, "max_seqlen": max(lens, default=0),
            "targets": torch.randint(0, V, (len(ids),), generator=gen)}


def make_steps(seed, n_steps=3, n_mb=6):
    """n_steps global batches of n_mb micro-batches of different lengths; one is empty in the first."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for s in range(n_steps):
        lens = [[int(x) for x in torch.randint(3, 16, (int(torch.randint(1, 4, (1,), generator=gen)),),
                                                 generator=gen)] for _ in range(n_mb)]
        if s == 0:
            lens[1] = []
        batch = [micro_batch(ls, gen) for ls in lens]
        total = sum(len(mb["input_ids"]) for mb in batch)
        for mb in batch:
            mb["denom"] = float(total)  # the global token count: the DP split does not change the loss
        steps.append(batch)
    return steps


def token_mean_loss(layout):
    def loss_fn(model, hidden, mb):
        logp, _ = vocab_parallel_logprobs(model.logits(hidden), mb["targets"], layout.tp_group)
        loss = -logp.sum() / mb["denom"]
        return loss, {"loss": loss, "logp": logp}
    return loss_fn


def local_slice(full, tp_dim, parts, tp, r, kv_heads=None):
    """Slice r of tp of every piece; of the k and v pieces of a fused qkv (kv_heads given) with fewer heads than
    ranks, head r * kv_heads // tp, which tp / kv_heads neighbouring ranks share."""
    if tp_dim is None:
        return full
    shards = [tp if kv_heads is None or j == 0 else min(tp, kv_heads) for j in range(len(parts))]
    return torch.cat([piece.chunk(c, dim=tp_dim)[r * c // tp]
                      for piece, c in zip(full.split(parts, dim=tp_dim), shards)], dim=tp_dim)


def assemble(parts):
    """The flat gradient from the DP ranks' (owned ranges, owned gradient parts in a row): each rank's part
    scattered back into place. The owned ranges must cover the buffer exactly once."""
    n = max(b for owned, _ in parts for _, b in owned)
    flat, hits = torch.zeros(n), torch.zeros(n, dtype=torch.long)
    for owned, g in parts:
        idx = torch.cat([torch.arange(a, b) for a, b in owned])
        flat[idx], hits[idx] = g, hits[idx] + 1
    assert bool((hits == 1).all())
    return flat


def flat_to_params(flat, index):
    return {name: flat[off:off + math.prod(shape)].view(shape) for name, off, shape in index}


# ----------------------------------------------------------------------------- distributed bodies


def _train_case(path, tp, pp, steps, bucket_size=40_000_000, overlap=False, cuda=False):
    """Train len(steps) steps; with `overlap` the optimizer is told the number of backward passes. "launched"
    records, per step, how many buckets had started their DP reduction when the last micro-batch's forward
    reached the loss (the last stage runs its backward right after; None on other stages) and when the
    backward had finished. With `cuda`, on this rank's GPU in fp32 (SDPA: the GPU kernels want bf16)."""
    lay = make_layout(tp, pp)
    model = load_model(path, lay, device="cuda" if cuda else None)
    if cuda:
        model.attn_backend = "sdpa"
        steps = [[{k: v.cuda() if torch.is_tensor(v) else v for k, v in mb.items()} for mb in b] for b in steps]
    opt = ShardedAdamW(model, lay, **HP, bucket_size=bucket_size)
    loss_fn = token_mean_loss(lay)
    mine = [batch[lay.dp_rank::lay.dp] for batch in steps]  # this DP rank's micro-batches
    res = {"coords": (lay.dp_rank, lay.pp_rank, lay.tp_rank), "dp": lay.dp, "start": model.layer_start,
           "report": lay.is_last_stage and lay.tp_rank == 0, "index": opt.index, "owned": opt.owned,
           "buckets": opt.buckets, "order": opt.order, "deferred": opt.deferred, "launched": [],
           "overlap": overlap, "state_elements": sum(x.numel() for x in (opt.master, opt.exp_avg, opt.exp_avg_sq)),
           "numel": opt.numel, "losses": [], "norms": [],
           "shard_name": shard_name(lay, with_dp=True),
           "meta": {n: (p.tp_dim, p.tp_parts, model.cfg.num_kv_heads if "qkv_proj" in n else None)
                    for n, p in model.named_parameters()}}
    with torch.no_grad():  # forward-only: log-probs of step 0's micro-batches
        outs = pipeline_forward_backward(model, lay, mine[0], loss_fn, forward_only=True)
    res["logp"] = [o.get("logp") for o in outs]
    for s, mbs in enumerate(mine):
        opt.zero_grad()
        at_forward = []

        def recording_loss_fn(model, hidden, mb):
            if len(hidden):  # the schedule's forwards; empty micro-batches come after it, without grad
                at_forward.append(opt.launched)
            return loss_fn(model, hidden, mb)

        if overlap:
            opt.expect_backwards(sum(len(mb["input_ids"]) > 0 for mb in mbs))
        outs = pipeline_forward_backward(model, lay, mbs, recording_loss_fn)
        res["losses"].append(sum(float(o["loss"]) for o in outs) if lay.is_last_stage else None)
        res["launched"].append((at_forward[-1] if at_forward else None, opt.launched))
        opt.reduce_gradients()
        if s == 0:
            res["grad_shard"] = torch.cat(opt.owned_grads)
        res["norms"].append(opt.clip_grad_norm(MAX_NORM))
        opt.step()
    res["params"] = {n: p.detach().clone() for n, p in model_state(model).items()}
    res["master_roundtrip"], res["exp_avg"] = _state_roundtrip(opt)
    res["republished"] = all(torch.equal(p, res["params"][n]) for n, p in model_state(model).items())
    return _to_cpu(res)


def _to_cpu(x):
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x.cpu() if torch.is_tensor(x) else x


def _state_roundtrip(opt):
    """Whole-over-DP state (what checkpoints keep) and back: each rank gets exactly its parts again."""
    before = {n: getattr(opt, n).clone() for n in opt.STATES}
    full = {n: {k: v.clone() for k, v in opt.full_state(n).items()} for n in opt.STATES}
    opt.zero_grad()
    for n in opt.STATES:
        getattr(opt, n).zero_()
        opt.load_full_state(n, full[n].items())
    return all(torch.equal(getattr(opt, n), before[n]) for n in opt.STATES), full["exp_avg"]


def _split_case(path, batch):
    lay = make_layout(1, 1)
    model = load_model(path, lay)
    opt = ShardedAdamW(model, lay, **HP)
    pipeline_forward_backward(model, lay, batch[lay.dp_rank::lay.dp], token_mean_loss(lay))
    opt.reduce_gradients()
    return {"dp_rank": lay.dp_rank, "grad_shard": torch.cat(opt.owned_grads), "index": opt.index, "owned": opt.owned}


def _vocab_case(logits, targets, w_logp, w_ent, temperature):
    lay = make_layout(2, 1) if torch.distributed.is_initialized() else make_layout(1, 1)
    local = logits.chunk(lay.tp, dim=-1)[lay.tp_rank].clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(local, targets, lay.tp_group, temperature, with_entropy=True)
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    local2 = local.detach().clone().requires_grad_()
    logp2, none = vocab_parallel_logprobs(local2, targets, lay.tp_group, temperature)
    (logp2 * w_logp).sum().backward()
    return {"logp": logp.detach(), "ent": ent.detach(), "grad": local.grad, "grad_logp_only": local2.grad,
            "none": none}


def _worker(rank, world, cases):
    out = []
    for kind, *args in cases:
        out.append({"train": _train_case, "split": _split_case, "vocab": _vocab_case}[kind](*args))
    return out


# ----------------------------------------------------------------------------- one-process reference


def reference(path, steps):
    """Loss, gradients (step 0), grad norms and parameters after len(steps) AdamW steps, one process."""
    model = load_model(path)
    params = dict(model.named_parameters())
    groups = [{"params": [p for p in params.values() if p.dim() >= 2]},
              {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, **HP)
    out = {"losses": [], "norms": [], "logp": []}
    with torch.no_grad():
        for mb in steps[0]:
            logits = model.logits(model.packed(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"],
                                               mb["max_seqlen"])) if len(mb["input_ids"]) else torch.zeros(0, V)
            out["logp"].append(logits.log_softmax(-1).gather(-1, mb["targets"][:, None]).squeeze(-1))
    for s, batch in enumerate(steps):
        opt.zero_grad()
        loss = 0.0
        for mb in batch:
            if len(mb["input_ids"]):
                h = model.packed(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"], mb["max_seqlen"])
                loss = loss + F.cross_entropy(model.logits(h), mb["targets"], reduction="sum") / mb["denom"]
        loss.backward()
        out["losses"].append(loss.item())
        if s == 0:
            out["grads"] = {n: p.grad.clone() for n, p in params.items()}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(list(params.values()), MAX_NORM).item())
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in params.items()}
    out["exp_avg"] = {n: opt.state[p]["exp_avg"].clone() for n, p in params.items()}
    out["init"] = {n: p.detach().clone() for n, p in load_model(path).named_parameters()}
    out["numel"] = sum(p.numel() for p in params.values())
    return out


def ref_name(name, start, tied):
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        return f"layers.{start + int(i)}.{rest}"
    return "embed_tokens.weight" if name == "lm_head.weight" and tied else name


def check_train_case(results, ref, tp, pp, tied):
    """Every rank's loss, grads (assembled over DP shards), norms and parameters vs the reference."""
    dp = results[0]["dp"]
    assert len(results) == dp * pp * tp
    # the loss: sum over DP ranks of the last stage (tp rank 0)
    reports = [r for r in results if r["report"]]
    for s in range(len(ref["losses"])):
        got = sum(r["losses"][s] for r in reports)
        assert abs(got - ref["losses"][s]) <= 1e-5 * abs(ref["losses"][s]), (s, got, ref["losses"][s])
        for r in results:  # the clipped norm is global: every rank returns the same number
            assert abs(r["norms"][s] - ref["norms"][s]) <= 1e-5 * ref["norms"][s], (s, r["norms"][s])
    assert min(ref["norms"]) > MAX_NORM  # clipping was active
    # forward-only log-probs, on the last stage (tp rank 0)
    for r in reports:
        mine = [lp for i, lp in enumerate(ref["logp"]) if i % dp == r["coords"][0]]
        assert rel_err(torch.cat(r["logp"]), torch.cat(mine)) <= 1e-5
    by_coord = {r["coords"]: r for r in results}
    for r in results:
        d, p, t = r["coords"]
        # ZeRO-1: 1/dp of the master weights and moments per rank (up to the padding of each bucket)
        assert r["state_elements"] == 3 * sum(-(-(b - a) // dp) for a, b in r["buckets"])
        assert r["state_elements"] < 3 * (r["numel"] / dp + len(r["buckets"]))
        assert r["master_roundtrip"] and r["republished"] and r["shard_name"] == f"dp{d}_pp{p}_tp{t}"
        # told the number of backward passes, every bucket that needs no TP / embedding all-reduce first starts
        # its DP reduction during the last micro-batch's backward, none before; not told, none before
        # reduce_gradients
        for before, after in r["launched"]:
            assert (before in (0, None) and after == len(r["order"])) if r["overlap"] else after == 0
        flat = assemble([(by_coord[(k, p, t)]["owned"], by_coord[(k, p, t)]["grad_shard"]) for k in range(dp)])
        grads = flat_to_params(flat, r["index"])
        assert set(grads) == set(r["params"])
        for name, (tp_dim, parts, kv) in r["meta"].items():
            full = ref_name(name, r["start"], tied)
            want = local_slice(ref["grads"][full], tp_dim, parts, tp, t, kv)
            assert rel_err(grads[name], want) <= 1e-5, (name, r["coords"], rel_err(grads[name], want))
            want = local_slice(ref["params"][full], tp_dim, parts, tp, t, kv)
            init = local_slice(ref["init"][full], tp_dim, parts, tp, t, kv)
            assert rel_err(r["params"][name], want) <= 1e-5, (name, r["coords"], rel_err(r["params"][name], want))
            assert rel_err(want, init) > 1e-4, name  # the steps moved it: the comparison can fail
            want = local_slice(ref["exp_avg"][full], tp_dim, parts, tp, t, kv)  # Adam's first moment, whole over DP
            assert rel_err(r["exp_avg"][name], want) <= 1e-4, (name, r["coords"], rel_err(r["exp_avg"][name], want))
    if tied and pp > 1:  # the two copies of the tied embedding stayed equal
        for t in range(tp):
            first, last = by_coord[(0, 0, t)]["params"], by_coord[(0, pp - 1, t)]["params"]
            assert torch.equal(first["embed_tokens.weight"], last["lm_head.weight"])


def check_split(path, batch, results):
    """dp ranks x (4/dp) micro-batches give the gradients of 1 x 4 micro-batches in one process."""
    one = _split_case(path, batch)
    n = sum(math.prod(shape) for _, _, shape in one["index"])
    flat = assemble([(r["owned"], r["grad_shard"]) for r in results])
    assert all(r["index"] == one["index"] for r in results)
    assert one["grad_shard"][:n].abs().max() > 0
    assert rel_err(flat[:n], one["grad_shard"][:n]) <= 1e-6


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    fams = {f for f, _, _ in TP_CASES_2 + TP_CASES_4} - {"qwen2_kv1"}
    heavy_head = {"qwen2_tied": {"intermediate_size": 16}}  # head = 1.13 layers: pp=2 splits 4 layers 3 + 1
    out = {f: helpers.make_checkpoint(str(tmp_path_factory.mktemp(f)), f, with_tokenizer=False,
                                      **heavy_head.get(f, {})) for f in fams}
    out["qwen3_odd"] = helpers.make_checkpoint(str(tmp_path_factory.mktemp("qwen3_odd")), "qwen3",
                                               with_tokenizer=False, hidden_size=63)
    out["qwen2_kv1"] = helpers.make_checkpoint(str(tmp_path_factory.mktemp("qwen2_kv1")), "qwen2",
                                               with_tokenizer=False, num_key_value_heads=1)
    return out


def vocab_inputs(seed=0, scale=3.0, temperature=0.7):
    """scale=20, temperature=0.3: z = logits / T up to ~200, where an entropy formed as lse - E[z] loses ~1e-4."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(11, V, generator=g) * scale
    return (logits, torch.randint(0, V, (11,), generator=g), torch.randn(11, generator=g),
            torch.randn(11, generator=g), temperature)


def check_vocab(res, logits, targets, w_logp, w_ent, temperature):
    """Against autograd through log_softmax in fp64 (fp32's own error on a peaked row's entropy is ~5e-6)."""
    logits, w_logp, w_ent = logits.double(), w_logp.double(), w_ent.double()
    x = logits.clone().requires_grad_()
    logp_all = (x / temperature).log_softmax(-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    x2 = logits.clone().requires_grad_()
    ((x2 / temperature).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1) * w_logp).sum().backward()
    tp = len(res)
    for r, rank_res in enumerate(res):
        assert rel_err(rank_res["logp"].double(), logp.detach()) <= 1e-5
        assert rel_err(rank_res["ent"].double(), ent.detach()) <= 1e-5
        assert rank_res["none"] is None
        assert rel_err(rank_res["grad"].double(), x.grad.chunk(tp, dim=-1)[r]) <= 1e-5
        assert rel_err(rank_res["grad_logp_only"].double(), x2.grad.chunk(tp, dim=-1)[r]) <= 1e-5


def test_vocab_parallel_logprobs_tp1():
    for args in (vocab_inputs(), vocab_inputs(2, scale=20.0, temperature=0.3)):
        check_vocab([_vocab_case(*args)], *args)
    args = vocab_inputs()
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(args[0], args[1], None, temperature=0.0)
    for bad in (-1, V):
        with pytest.raises(RuntimeError, match=rf"targets must be token ids in \[0, {V}\)"):
            vocab_parallel_logprobs(args[0], args[1].clone().fill_(bad), None)
    empty, _ = vocab_parallel_logprobs(torch.zeros(0, V), torch.zeros(0, dtype=torch.long), None)
    assert empty.shape == (0,)


def test_two_processes(ckpts):
    """tp=2, pp=2 (tied), dp=2 vs one process; vocab-parallel log-probs at tp=2; the 2x2 batch split."""
    steps = make_steps(1)
    split = make_steps(2, n_steps=1, n_mb=4)[0]
    vocab, peaked = vocab_inputs(1), vocab_inputs(3, scale=20.0, temperature=0.3)
    cases = [("train", ckpts[f], tp, pp, steps) for f, tp, pp in TP_CASES_2]
    cases += [("split", ckpts["qwen2"], split), ("vocab", *peaked), ("vocab", *vocab)]
    res = helpers.run_distributed(_worker, 2, cases)
    for i, (f, tp, pp) in enumerate(TP_CASES_2):
        check_train_case([r[i] for r in res], reference(ckpts[f], steps), tp, pp, f == "qwen2_tied")
    check_vocab([r[-1] for r in res], *vocab)
    check_vocab([r[-2] for r in res], *peaked)
    check_split(ckpts["qwen2"], split, [r[-3] for r in res])


def test_four_processes_and_batch_split(ckpts):
    """tp2 x dp2, tp2 x pp2 (tied), pp2 x dp2 vs one process, in small buckets reduced during the backward;
    the same batch as 1x4, 2x2, 4x1 (dp x micro-batches) gives the same gradients."""
    steps = make_steps(3)
    split = make_steps(2, n_steps=1, n_mb=4)[0]
    cases = [("train", ckpts[f], tp, pp, steps, BUCKET, True) for f, tp, pp in TP_CASES_4]
    cases += [("split", ckpts["qwen2"], split)]
    res = helpers.run_distributed(_worker, 4, cases)
    for i, (f, tp, pp) in enumerate(TP_CASES_4):
        check_train_case([r[i] for r in res], reference(ckpts[f], steps), tp, pp, f == "qwen2_tied")
    check_split(ckpts["qwen2"], split, [r[-1] for r in res])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: the NCCL paths of parallel.py")
def test_two_gpus_nccl(ckpts):
    """tp=2, pp=2 (tied), dp=2 on two GPUs over NCCL (in-place bucket reduce-scatter and all-gather, GPU p2p),
    with small buckets reduced during the backward, vs one CPU process."""
    steps = make_steps(1)
    cases = [("train", ckpts[f], tp, pp, steps, BUCKET, True, True) for f, tp, pp in TP_CASES_2]
    res = helpers.run_distributed(_worker, 2, cases, backend="nccl")
    for i, (f, tp, pp) in enumerate(TP_CASES_2):
        check_train_case([r[i] for r in res], reference(ckpts[f], steps), tp, pp, f == "qwen2_tied")


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs: tp=4 and pp=4 over NCCL")
def test_four_gpus_nccl(ckpts):
    """The four-process layouts (tp=4 over 2 KV heads, pp=4 tied, one KV head at tp2 x pp2) on four GPUs over NCCL."""
    steps = make_steps(1)
    cases = [("train", ckpts[f], tp, pp, steps, BUCKET, True, True) for f, tp, pp in TP_CASES_4]
    res = helpers.run_distributed(_worker, 4, cases, backend="nccl")
    for i, (f, tp, pp) in enumerate(TP_CASES_4):
        check_train_case([r[i] for r in res], reference(ckpts[f], steps), tp, pp, f == "qwen2_tied")


@pytest.mark.parametrize("tp, world", [(1, 2), (2, 4)])
def test_buckets_reduced_during_backward(ckpts, tp, world):
    """dp=2 and tp2 x dp2 (the qk-norm grads are TP partial sums: their buckets wait for the TP all-reduce)
    with small padded buckets vs one process, told the number of backward passes and not told (then every
    bucket starts in reduce_gradients): both match the reference and each other to the bit."""
    steps = make_steps(4)
    cases = [("train", ckpts["qwen3_odd"], tp, 1, steps, BUCKET, overlap) for overlap in (True, False)]
    res = helpers.run_distributed(_worker, world, cases)
    ref = reference(ckpts["qwen3_odd"], steps)
    for i in range(2):
        check_train_case([r[i] for r in res], ref, tp, 1, False)
    for told, plain in res:
        assert len(told["buckets"]) >= 10 and sum(b - a for a, b in told["buckets"]) > told["numel"]  # padded
        assert bool(told["deferred"]) == (tp > 1)
        assert len(told["order"]) >= 10 and all(before == 0 for before, _ in told["launched"])
        assert told["norms"] == plain["norms"] and torch.equal(told["grad_shard"], plain["grad_shard"])
        assert all(torch.equal(p, plain["params"][n]) for n, p in told["params"].items())


def test_optimizer_single_process(ckpts):
    model = load_model(ckpts["qwen2"])
    opt = ShardedAdamW(model, make_layout(1, 1), **HP)
    n = sum(p.numel() for p in model.parameters())
    assert opt.numel == n and sum(x.numel() for x in (opt.master, opt.exp_avg, opt.exp_avg_sq)) == 3 * n
    # the flat buffer holds exactly the parameters, each once
    assert sorted(name for name, _, _ in opt.index) == sorted(name for name, _ in model.named_parameters())
    # a second optimizer of the same model takes over the gradient hooks (one parameter a bucket: an extra gradient
    # is caught in the bucket it lands in, not only by a later one)
    opt = ShardedAdamW(model, make_layout(1, 1), bucket_size=1, **HP)
    ids = torch.randint(0, V, (7,))

    def backward():
        model.logits(model.packed(ids, torch.arange(7), torch.tensor([0, 7], dtype=torch.int32), 7)).sum().backward()

    backward()
    assert torch.cat(opt.owned_grads).abs().max() > 0 and all(p.grad is None for p in model.parameters())
    # a backward pass more than announced would add to a bucket whose reduction may have started
    opt.zero_grad()
    opt.expect_backwards(1)
    backward()
    with pytest.raises(RuntimeError, match="more backward passes than expect_backwards"):
        backward()
    with pytest.raises(ValueError, match="optimizer state 'exp_avg': no values for"):
        opt.load_full_state("exp_avg", list(opt.full_state("exp_avg").items())[1:])
    with pytest.raises(ValueError, match="optimizer state 'exp_avg': 'lm_head.extra' is not a parameter of this model"):
        opt.load_full_state("exp_avg", [*opt.full_state("exp_avg").items(), ("lm_head.extra", torch.zeros(1))])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_frees_the_device_memory_and_restores_the_state(ckpts):
    opt = ShardedAdamW(load_model(ckpts["qwen2"], device="cuda"), make_layout(1, 1), **HP)
    opt.exp_avg.normal_()
    opt.exp_avg_sq.uniform_()
    before = [t.clone() for t in opt._state()]
    tensors = (*opt._state(), opt.grad_buffer)
    held = torch.cuda.memory_allocated()
    opt.offload()
    assert held - torch.cuda.memory_allocated() >= sum(t.numel() * 4 for t in tensors)  # 16 bytes a parameter
    assert all(h.is_pinned() for h in opt._host)
    opt.reload()
    opt.prefetch()  # the copies, on a side stream
    opt.zero_grad()  # waits for them
    assert all(torch.equal(a, b) for a, b in zip(opt._state(), before)) and opt.grad_buffer.abs().max() == 0


def test_stage_layers_balance_the_lm_head():
    """Qwen2.5-7B: a layer has 3584 * 128 * (2 * 28 + 2 * 4) + 3 * 3584 * 18944 = 233,046,016 matrix parameters,
    the LM head 152064 * 3584 = 544,997,376, i.e. 2.3386 layers. pp=2 gives the last stage 13 layers + head
    (15.34) beside 15, not 14 + head (16.34) beside 14; pp=4: 8, 8, 7, 5 + head (7.34) instead of 7 x 3 and 9.34."""
    cfg = ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                      num_kv_heads=4, head_dim=128)
    assert abs(cfg.head_cost - 544_997_376 / 233_046_016) < 1e-12
    split = lambda n, pp, c: [stage_layers(n, pp, r, c) for r in range(pp)]  # noqa: E731
    assert split(28, 2, cfg.head_cost) == [(0, 15), (15, 28)]
    assert split(28, 4, cfg.head_cost) == [(0, 8), (8, 16), (16, 23), (23, 28)]
    assert split(24, 2, 9.1) == [(0, 17), (17, 24)]  # Qwen2-0.5B's head is worth 9.1 of its layers
    assert split(7, 3, 0.0) == [(0, 3), (3, 5), (5, 7)]  # no head: the even split, earlier stages take the rest
    for n, pp, c in [(n, pp, c) for n in range(1, 30) for pp in range(1, n + 1) for c in (0.0, 0.3, 2.3, 9.1, 50.0)]:
        ranges = split(n, pp, c)
        assert ranges[0][0] == 0 and ranges[-1][1] == n and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        sizes = [b - a for a, b in ranges]
        assert min(sizes) >= 1 and sizes[0] == max(sizes) and sizes[-1] <= n // pp, (n, pp, c, sizes)


def test_invalid_layouts_fail_early(tmp_path):
    cfg = ModelConfig.from_dir(helpers.make_checkpoint(str(tmp_path), "qwen2", with_tokenizer=False))
    with pytest.raises(ValueError, match="world size 3 is not divisible by tp\\*pp = 2\\*1"):
        validate_layout(cfg, 2, 1, 3)
    heads = "num_attention_heads=4 is not divisible by tp=8.*valid tp sizes.*\\[1, 2, 4\\]"  # 4: 2 KV heads replicated
    with pytest.raises(ValueError, match=heads):
        validate_layout(cfg, 8, 1, 8)
    with pytest.raises(ValueError, match="pp=5 exceeds num_hidden_layers=4"):
        validate_layout(cfg, 1, 5, 5)
    with pytest.raises(ValueError, match=r"tp\*pp = 1\*3; valid pp sizes with tp=1: \[1, 2, 4\]"):  # pp's fault
        validate_layout(cfg, 1, 3, 4)
    for tp, pp in ((1, 0), (0, 1)):
        with pytest.raises(ValueError, match=f"tp={tp} and pp={pp} must both be >= 1"):
            validate_layout(cfg, tp, pp, 4)
    with pytest.raises(ValueError, match="world size 1 is not divisible by tp\\*pp = 2\\*1"):
        make_layout(2, 1)
    validate_layout(cfg, 2, 2, 8)  # a valid one passes


def test_lr_schedules():
    assert lr_at(0, 10, 1.0, warmup_steps=4) == 0.25 and lr_at(3, 10, 1.0, warmup_steps=4) == 1.0
    assert lr_at(9, 10, 2.0) == 2.0
    # cosine: halfway between the end of warmup (2) and total (10) is 6 -> midpoint of [min, max]
    assert lr_at(6, 10, 1.0, 2, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_at(10, 10, 1.0, 2, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_at(2, 10, 1.0, 2, "cosine") == pytest.approx(1.0)
    assert lr_at(4, 10, 1.0, 2, "linear") == pytest.approx(0.75)  # 2 of 8 decay steps done
    assert lr_at(50, 10, 1.0, 0, "linear", 0.2) == pytest.approx(0.2)  # clamped past the end
    with pytest.raises(ValueError, match="'cosine'"):
        lr_at(0, 10, 1.0, schedule="exp")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the compiled (fused) kernels")
def test_fused_kernels_match_eager_cpu():
    """On GPU the softmax statistics, RMSNorm, RoPE and SwiGLU run as torch.compile'd kernels; they must give
    the CPU (eager) numbers: fp32 logits against the log_softmax reference, bf16 inputs against eager on the
    same bf16 values."""
    import model
    from parallel import fused
    for args in (vocab_inputs(2), vocab_inputs(4, scale=20.0, temperature=0.3)):
        cuda_args = [a.cuda() if torch.is_tensor(a) else a for a in args]
        check_vocab([{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in _vocab_case(*cuda_args).items()}], *args)
    big = (torch.randn(300, 5000) * 4).bfloat16()
    t, w, we = torch.randint(0, 5000, (300,)), torch.randn(300), torch.randn(300)
    on_gpu = _vocab_case(big.cuda(), t.cuda(), w.cuda(), we.cuda(), 0.9)
    on_cpu = _vocab_case(big, t, w, we, 0.9)
    for k in ("logp", "ent", "grad", "grad_logp_only"):
        assert rel_err(on_gpu[k].float().cpu(), on_cpu[k].float()) <= 1e-2, k
    x, wt, wk = torch.randn(64, 8, 32).bfloat16(), torch.randn(32).bfloat16(), torch.randn(32).bfloat16()
    cos, sin = torch.rand(64, 16), torch.rand(64, 16)
    for fn, inputs in ((model.rms_norm, (x, wt, 1e-6)), (model.rope_qkv, (x, cos, sin, 4, 2)),
                       (model.rope_qkv, (x, cos, sin, 4, 2, wt, wk, 1e-6)), (model.silu_mul, (x,)),
                       (model.add_rms_norm, (x, x.flip(0), wt, 1e-6))):
        gpu = fused(fn, inputs[0].cuda())(*[a.cuda() if torch.is_tensor(a) else a for a in inputs])
        for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (gpu, fn(*inputs)))):
            assert rel_err(a.float().cpu(), b.float()) <= 1e-2, fn.__name__


def test_vocab_parallel_logprobs_checks_its_inputs():
    z, ids = torch.randn(5, 11), torch.zeros(5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"expected logits \[T, V/tp\] and targets \[T\], got \[1, 5, 11\], \[5\]"):
        vocab_parallel_logprobs(z[None], ids, None)
    with pytest.raises(ValueError, match=r"expected logits \[T, V/tp\] and targets \[T\], got \[5, 11\], \[4\]"):
        vocab_parallel_logprobs(z, ids[:4], None)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0.0"):
        vocab_parallel_logprobs(z, ids, None, temperature=0.0)


def test_clip_grad_norm_leaves_small_gradients_alone_and_zero_only_measures(tmp_path):
    """Against torch.nn.utils.clip_grad_norm_: below max_norm the gradient is not scaled (not scaled *up*), above it
    scaled to max_norm; max_norm <= 0 returns the norm and leaves the gradient as it is."""
    path = helpers.make_checkpoint(str(tmp_path), "qwen2", with_tokenizer=False)
    ids = torch.randint(0, helpers.TINY_VOCAB, (9,), generator=torch.Generator().manual_seed(0))

    def grads_after(max_norm):
        model = load_model(path)
        opt = ShardedAdamW(model, make_layout(1, 1))
        ref = load_model(path)
        for m in (model, ref):
            m.logits(m.packed(ids, torch.arange(9), torch.tensor([0, 9], dtype=torch.int32), 9)).logsumexp(-1).mean() \
                .backward()
        want_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm if max_norm > 0 else float("inf"))
        got_norm = opt.clip_grad_norm(max_norm)
        got = dict(zip((n for n, _, _ in opt.index), opt.views))
        return got_norm, want_norm.item(), got, {n: p.grad for n, p in ref.named_parameters()}

    norm = grads_after(0.0)[1]
    for max_norm in (0.0, -1.0, 10 * norm, 0.5 * norm):
        got_norm, want_norm, got, want = grads_after(max_norm)
        assert got_norm == pytest.approx(want_norm, rel=1e-5)
        for n, g in want.items():
            assert torch.allclose(got[n], g, rtol=1e-5, atol=1e-9), (max_norm, n)
    # a non-finite norm is returned as it is and scales nothing (the trainer skips the step)
    model = load_model(path)
    opt = ShardedAdamW(model, make_layout(1, 1))
    model.logits(model.packed(ids, torch.arange(9), torch.tensor([0, 9], dtype=torch.int32), 9)).sum().backward()
    opt.views[0].view(-1)[0] = float("inf")
    before = opt.grad_buffer.clone()
    assert opt.clip_grad_norm(0.5 * norm) == float("inf") and torch.equal(opt.grad_buffer, before)


def _schedule_body(rank, world, path, lens):
    lay = make_layout(1, 2)
    model = load_model(path, lay)
    events, packed, backward = [], model.packed, torch.autograd.backward

    def rec_packed(x, pos, cu, mx):
        events.append(f"F{lens.index(pos.numel())}")
        return packed(x, pos, cu, mx)

    def rec_backward(tensors, grad_tensors=None, **kw):
        events.append("B")
        return backward(tensors, grad_tensors=grad_tensors, **kw)
    model.packed, torch.autograd.backward = rec_packed, rec_backward
    g = torch.Generator().manual_seed(0)
    mbs = [{"input_ids": torch.randint(0, helpers.TINY_VOCAB, (n,), generator=g), "position_ids": torch.arange(n),
            "cu_seqlens": torch.tensor([0, n], dtype=torch.int32), "max_seqlen": n} for n in lens]

    def loss_fn(m, h, mb):
        loss = m.logits(h).logsumexp(-1).sum()
        return loss, {"loss": loss}
    try:
        pipeline_forward_backward(model, lay, mbs, loss_fn)
    finally:
        torch.autograd.backward = backward
    return events


def test_1f1b_order_pp2(tmp_path):
    """pp=2, 4 micro-batches: stage 0 warms up with pp - 0 - 1 = 1 forward, then alternates, then drains (at most 2
    micro-batches of activations alive); the last stage alternates from the start (module docstring's rule)."""
    path = helpers.make_checkpoint(str(tmp_path), "qwen2", with_tokenizer=False)
    lens = [3, 4, 5, 6]
    s0, s1 = helpers.run_distributed(_schedule_body, 2, path, lens)
    assert s0 == ["F0", "F1", "B", "F2", "B", "F3", "B", "B"], s0
    assert s1 == ["F0", "B", "F1", "B", "F2", "B", "F3", "B"], s1


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_lr_warmup_ends_at_the_peak_under_a_decay_schedule(schedule):
    """Warmup's last step (warmup_steps - 1) is lr * warmup / warmup = lr, whatever follows: not a step into the
    decay with a negative progress (cosine: just under lr; linear: over lr)."""
    for warmup in (1, 2, 4):
        assert lr_at(warmup - 1, 10, 1.0, warmup, schedule, 0.1) == 1.0
        assert lr_at(warmup - 1, 10, 2.0, warmup, schedule) == 2.0


def _row_parallel_body(rank, world, x, w, b, gy):
    from parallel import RowParallelLinear
    lay = make_layout(world, 1)
    layer = RowParallelLinear(w.shape[1], w.shape[0], True, lay)
    with torch.no_grad():
        layer.weight.copy_(w.chunk(world, dim=1)[lay.tp_rank])
        layer.bias.copy_(b)
    xs = x.chunk(world, dim=-1)[lay.tp_rank].clone().requires_grad_()
    y = layer(xs)
    (y * gy).sum().backward()
    return {"y": y.detach(), "gx": xs.grad, "gw": layer.weight.grad, "gb": layer.bias.grad}


def test_row_parallel_linear_with_bias_matches_a_dense_linear():
    """RowParallelLinear(bias=True) at tp=2 against torch.nn.functional.linear on the whole weight: the bias is added
    once, after the reduction (not once per rank), and every gradient is the dense one's slice."""
    g = torch.Generator().manual_seed(0)
    x, w, b, gy = torch.randn(5, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g), \
        torch.randn(5, 6, generator=g)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = torch.nn.functional.linear(xr, wr, br)
    (y * gy).sum().backward()
    for r, res in enumerate(helpers.run_distributed(_row_parallel_body, 2, x, w, b, gy)):
        torch.testing.assert_close(res["y"], y.detach())
        torch.testing.assert_close(res["gx"], xr.grad.chunk(2, dim=-1)[r])
        torch.testing.assert_close(res["gw"], wr.grad.chunk(2, dim=1)[r])
        torch.testing.assert_close(res["gb"], br.grad)


def _embedding_body(rank, world, w):
    from parallel import VocabParallelEmbedding
    emb = VocabParallelEmbedding(8, 3, make_layout(tp=2))
    with torch.no_grad():
        emb.weight.copy_(w.chunk(2)[rank])
    errors = []
    for bad in (8, -1):  # held by no rank: every rank's lookup gives zeros
        with pytest.raises(RuntimeError, match=r"ids must be in \[0, 8\)") as e:
            emb(torch.tensor([1, bad]))
        errors.append(str(e.value))
    return emb(torch.tensor([1, 5, 7, 0])), errors


def test_vocab_parallel_embedding_refuses_ids_outside_the_vocabulary():
    """At tp=2 an id past the vocabulary used to embed as a zero vector (one process raises IndexError); the ids
    inside it give the whole table's rows."""
    w = torch.randn(8, 3)
    for y, errors in helpers.run_distributed(_embedding_body, 2, w):
        torch.testing.assert_close(y, w[[1, 5, 7, 0]])
        assert len(errors) == 2


def test_sharded_adamw_follows_torch_adamw_through_checkpoints_skips_and_offload(tmp_path):
    """One process, 3 steps at varying lr against torch.optim.AdamW (weight decay on matrices only), each step's
    update compared (not just the weights, which the small update hardly moves; to the rounding of the weights).
    Between steps the trainer's other uses of the optimizer: a checkpoint (full_state, then zero_grad), an offload /
    reload / prefetch round, and a skipped step (a backward, then zero_grad without step: nothing of it may reach the
    next step)."""
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
    path = helpers.make_checkpoint(str(tmp_path), "qwen2", with_tokenizer=False)
    model, ref = load_model(path), load_model(path)
    opt = ShardedAdamW(model, make_layout(1, 1), **hp)
    params = dict(ref.named_parameters())
    ropt = torch.optim.AdamW([{"params": [p for p in params.values() if p.dim() >= 2]},
                              {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}], **hp)
    g = torch.Generator().manual_seed(0)

    def backward(m, ids):
        m.logits(m.packed(ids, torch.arange(9), torch.tensor([0, 9], dtype=torch.int32), 9)).logsumexp(-1).mean() \
            .backward()

    for s, lr in enumerate((1e-3, 5e-4, 2e-3)):
        ids = torch.randint(0, helpers.TINY_VOCAB, (9,), generator=g)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        ropt.zero_grad()
        backward(model, ids)
        backward(ref, ids)
        opt.reduce_gradients()
        for group in ropt.param_groups:
            group["lr"] = lr
        opt.step(lr)
        ropt.step()
        for n, p in model.named_parameters():
            want = params[n].detach() - before[n]
            got = p.detach() - before[n]
            assert ((got - want).abs().max() / want.abs().max()).item() <= 2e-3, (s, n)  # fp32 rounding of p - p0
        assert opt.step_count == s + 1
        {k: v.clone() for k, v in opt.full_state("exp_avg").items()}  # a checkpoint stages the state in the buffer
        opt.zero_grad()
        opt.offload()  # generation
        opt.reload()
        opt.prefetch()
        backward(model, torch.randint(0, helpers.TINY_VOCAB, (9,), generator=g))  # a step skipped (non-finite)
        opt.zero_grad()
    exp_avg = opt.full_state("exp_avg")
    for n, p in params.items():  # (the two models' weights differ by fp32 rounding after a step, so do later grads)
        torch.testing.assert_close(exp_avg[n], ropt.state[p]["exp_avg"], rtol=1e-4, atol=1e-8)
