"""Tensor, pipeline and data parallelism on plain `torch.distributed`.

The rank grid
-------------
W processes are arranged as a 3-D grid  dp x pp x tp  with TP varying fastest:

    rank = (dp_rank * pp + pp_rank) * tp + tp_rank

so the ranks of one TP group are consecutive (inside one node, on the fastest links), the pp stages of one model
replica are tp apart, and the dp replicas are tp*pp apart. Example, W=8, tp=2, pp=2, dp=2:

    dp 0:  stage 0 = ranks [0 1]   stage 1 = ranks [2 3]
    dp 1:  stage 0 = ranks [4 5]   stage 1 = ranks [6 7]
    TP groups [0,1] [2,3] [4,5] [6,7];  PP groups [0,2] [1,3] [4,6] [5,7];  DP groups [0,4] [1,5] [2,6] [3,7]

Tensor parallelism (Megatron-LM)
--------------------------------
A linear layer Y = X A^T is split two ways. Column-parallel: rank r holds rows r of A (a slice of the output
features); every rank needs all of X and produces its slice of Y. Row-parallel: rank r holds a slice of the input
features and produces a partial sum of Y that one all-reduce completes. An MLP is column then row, attention q/k/v
column (whole heads per rank) then the output projection row: one all-reduce each in forward. The autograd rules
mirror each other: the identity `f` in front of a column layer all-reduces gradients in backward, the all-reduce
`g` after a row layer is the identity in backward. The embedding and the LM head are split over the vocabulary.

Every parameter carries its shard description: `tp_dim` (0 for column, 1 for row, None when replicated), `tp_parts`
(the full sizes of the fused pieces along tp_dim, e.g. q, k, v of a fused qkv: each is split separately on head
boundaries, and the local shard concatenates the local pieces) and `tp_unit` (the rows a piece splits on: head_dim
for q, k, v). Loading, resharding and export all follow this rule (`tp_rows`). A piece with fewer units than ranks (KV
heads when tp > num_kv_heads, as Qwen2.5-3B's 2 at tp = 8) is replicated: each of its heads is held by tp / num_kv_heads
neighbouring ranks, each of which sees only its own query heads, so the head's gradient is summed over its holders.

Log-probs over a split vocabulary
---------------------------------
With z = logits / temperature split over tp ranks, log p(t) = z_t - log sum_j exp z_j needs only three all-reduces
of one number per token, never gathering the logits: the max (for stability), the sum of exp(z - max), and z_t
itself (the rank that owns token t contributes it, the others zero). The entropy H = logsumexp(z) - E_p[z] rides
along with the sum (one more number in the same all-reduce), both taken of z - max so that no two numbers of size
|z| cancel. The backward is local too, recomputed from the logits rather than stored: d log p(t)/dz = onehot(t) - p
and dH/dz = -p * (z - E_p[z]) = -p * (log p + H).

Pipeline parallelism: the 1F1B schedule
---------------------------------------
Stage s holds layers [start_s, end_s). A batch is cut into m micro-batches; activations flow s -> s+1, their
gradients s+1 -> s. Stage s first runs pp-s-1 forwards (warmup), then alternates one forward and one backward
(steady state), then drains the remaining backwards (cooldown):

    stage 0:  F0 F1 F2 F3 B0 F4 B1 F5 B2 .. B5          (pp = 4, m = 6)
    stage 3:           F0 B0 F1 B1 F2 B2 .. B5

so a stage keeps at most pp - s micro-batches of activations alive, and the bubble is (pp-1)/(m+pp-1) of the step. The
pipeline runs at the pace of its slowest stage, and the last also runs the LM head and the loss (2.3 layers' worth
on Qwen2.5-7B), so it gets fewer layers (`stage_layers`). Each exchange posts its sends and receives together (one
batch of P2P ops), which pairs the two sides' messages and cannot deadlock.

Data parallelism and ZeRO-1
---------------------------
DP replicas see different micro-batches; their gradients are summed (the loss is already normalised by the global
token count). The optimizer keeps all parameters of a rank in one flat fp32 buffer, cut into buckets of whole
parameters (~40M elements, each padded to a multiple of dp). ZeRO-1 gives each DP rank the fp32 master weights and
both Adam moments of 1/dp of it, interleaved: rank r owns the r-th 1/dp of every bucket (a contiguous 1/dp of the
buffer would put a bucket on one or two ranks). So one reduce-scatter per bucket hands every rank the summed
gradient of its part, and each bucket is reduced as soon as the backward (last layer first) has filled it,
overlapping the rest. All ranks start these in one fixed order, to issue the same collectives in the same sequence;
buckets holding TP partial sums or a tied embedding copy first wait for their TP / embedding all-reduce after the
backward. Each rank updates its parts and all-gathers them back into the weights; a checkpoint all-gathers the
state the same way and keeps it per parameter (`full_state`), so a run can resume under another layout."""
from __future__ import annotations

import functools
import itertools
import math
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------- layout


@dataclass
class Layout:
    """This rank's place in a dp x pp x tp grid and its process groups: None when of size 1 (or in a single process),
    which every collective helper treats as a no-op. `*_ranks` are the global ranks of each group."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    tp_ranks: list = field(default_factory=lambda: [0])
    pp_ranks: list = field(default_factory=lambda: [0])
    dp_ranks: list = field(default_factory=lambda: [0])
    embed_group: object = None  # first and last pipeline stage of one replica: they share tied embeddings

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


_ORDER = {}  # group -> for each of its `ranks` as listed, its place among them sorted (where that differs)


def _new_group(ranks: list[int]):
    # collective over the whole world: every rank creates every group, in the same order, even those it is not in.
    # `ranks` need not be ascending (a generation TP group, reshard.py), but torch orders a group's ranks ascending
    # (before 2.12 always), so the listed order is kept here: group_rank() and all_gather_stack() follow it
    if len(ranks) < 2:
        return None
    group = dist.new_group(sorted(ranks))
    if ranks != sorted(ranks) and dist.get_rank() in ranks:  # (the others get a placeholder, not a group)
        _ORDER[group] = [sorted(ranks).index(r) for r in ranks]
    return group


def group_rank(group) -> int:
    """This rank's place in the ranks its group was made from (0 without a group)."""
    if group is None:
        return 0
    r = dist.get_rank(group)
    return _ORDER[group].index(r) if group in _ORDER else r


def make_layout(tp: int = 1, pp: int = 1) -> Layout:
    """Build the training layout from torchrun's environment (or one process when not distributed)."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    if tp < 1 or pp < 1:
        raise ValueError(f"parallel.train: tp={tp} and pp={pp} must both be >= 1")
    if world % (tp * pp) != 0:
        raise ValueError(f"parallel.train: world size {world} is not divisible by tp*pp = {tp}*{pp}; "
                         f"valid (tp, pp) have tp*pp dividing {world}")
    dp = world // (tp * pp)
    lay = Layout(tp=tp, pp=pp, dp=dp, rank=rank, tp_rank=rank % tp, pp_rank=rank // tp % pp, dp_rank=rank // (tp * pp))
    grid = torch.arange(world).view(dp, pp, tp)  # grid[d, p, t] is the rank at those coordinates
    # a group is a row of the grid with its axis moved last: the ranks that differ only along that axis
    for kind, groups in (("tp", grid.reshape(-1, tp)), ("pp", grid.transpose(1, 2).reshape(-1, pp)),
                         ("dp", grid.permute(1, 2, 0).reshape(-1, dp))):
        for ranks in groups.tolist():
            g = _new_group(ranks)
            if rank in ranks:
                setattr(lay, f"{kind}_group", g)
                setattr(lay, f"{kind}_ranks", ranks)
            if kind == "pp":  # the first and last stage of a replica share tied embeddings
                ends = sorted({ranks[0], ranks[-1]})
                g = _new_group(ends)
                if rank in ends:
                    lay.embed_group = g
    return lay


def validate_layout(cfg, tp: int, pp: int, world_size: int, name: str = "model") -> None:
    """Check a (tp, pp) layout against a model config (model.ModelConfig) before anything is built."""
    need = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
    fits = lambda key, t: need[key] % t == 0 or key == "num_key_value_heads" and t % need[key] == 0  # noqa: E731
    if tp < 1 or pp < 1:
        raise ValueError(f"{name}: tp={tp} and pp={pp} must both be >= 1")
    valid = [t for t in range(1, world_size + 1) if world_size % (t * pp) == 0 and all(fits(k, t) for k in need)]
    if world_size % (tp * pp) != 0:
        hint = (f"valid tp sizes for this model with pp={pp}: {valid}" if world_size % pp == 0 else  # pp's fault
                f"valid pp sizes with tp={tp}: {[p for p in range(1, world_size + 1) if world_size % (tp * p) == 0]}")
        raise ValueError(f"{name}: world size {world_size} is not divisible by tp*pp = {tp}*{pp}; {hint}")
    for key, n in need.items():
        if not fits(key, tp):
            how = ", nor is tp a multiple of it (KV heads replicated)" if key == "num_key_value_heads" else ""
            raise ValueError(f"{name}: {key}={n} is not divisible by tp={tp}{how}; valid tp sizes for "
                             f"this model and {world_size} ranks: {valid}")
    if pp > cfg.num_layers:
        valid_pp = [p for p in range(1, cfg.num_layers + 1) if world_size % (tp * p) == 0]
        raise ValueError(f"{name}: pp={pp} exceeds num_hidden_layers={cfg.num_layers}; valid pp sizes for tp={tp} "
                         f"and {world_size} ranks: {valid_pp}")


def stage_layers(num_layers: int, pp: int, pp_rank: int, head_cost: float = 0.0) -> tuple[int, int]:
    """[start, end) of the layers held by one pipeline stage. The last stage also runs the LM head and loss,
    worth `head_cost` layers (ModelConfig.head_cost), so it takes about (layers + head_cost) / pp - head_cost
    layers (at least 1, at most an even share); the others split the rest evenly, earlier ones taking more."""
    last = min(max(1, round((num_layers + head_cost) / pp - head_cost)), num_layers // pp) if pp > 1 else num_layers
    if pp_rank == pp - 1:
        return num_layers - last, num_layers
    base, extra = divmod(num_layers - last, pp - 1)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


# ----------------------------------------------------------------------------- process group, collectives


def init_distributed(device: str = "auto", timeout_s: int = 1800) -> tuple[torch.device, int, int]:
    """(this process's device, rank, world size). device: auto (CUDA when visible) | cpu | cuda. Under torchrun (RANK
    set) it starts the default process group, NCCL on GPU, gloo on CPU; a collective that waits past timeout_s fails
    the job instead of hanging it. Without torchrun: rank 0 of 1."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible")
    cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s),
                                device_id=dev if cuda else None)
    return (dev, dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (dev, 0, 1)


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def world_all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """all_reduce over every rank (a no-op in a single process)."""
    return all_reduce(x, dist.group.WORLD if dist.is_initialized() else None, op)


def world_barrier() -> None:
    if dist.is_initialized():  # (a no-op in a single process)
        dist.barrier()


def all_gather_objects(obj) -> list:
    """Every rank's `obj` (picklable), in rank order ([obj] without a process group)."""
    if not dist.is_initialized():
        return [obj]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward (in front of a column layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward (after a row layer)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def all_gather_stack(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x stacked into [ranks, *x.shape], the same on every rank of `group` (no autograd)."""
    if group is None:
        return x.unsqueeze(0)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts if group not in _ORDER else [parts[i] for i in _ORDER[group]])


# ----------------------------------------------------------------------------- TP layers


def tp_chunks(full: int, tp: int, unit: int = 1) -> int:
    """Distinct TP shards of a piece of `full` rows that splits on `unit` rows: tp, or its unit count when smaller."""
    return min(tp, full // unit)


def tp_rows(full: int, tp: int, rank: int, unit: int = 1) -> slice:
    """The rows of such a piece that TP rank `rank` holds: shard rank * chunks // tp (ranks share a replicated one)."""
    chunks = tp_chunks(full, tp, unit)
    n, c = full // chunks, rank * chunks // tp
    return slice(c * n, (c + 1) * n)


def _param(shape: tuple, tp_dim, parts, dtype, device, init=torch.empty, unit: int = 1) -> nn.Parameter:
    p = nn.Parameter(init(shape, dtype=dtype, device=device))
    p.tp_dim, p.tp_parts, p.tp_unit = tp_dim, parts, unit
    return p


class _SumOverHolders(torch.autograd.Function):
    """Identity forward. Backward: the rows of a replicated piece (a KV head on several TP ranks) get from each holder
    only what its own query heads contribute, so they are summed over the holders: one all-reduce over TP of a
    [chunks, rows] buffer to which each rank adds at its shard's place (no process group per head needed)."""

    @staticmethod
    def forward(ctx, w, replicas, group):
        ctx.replicas, ctx.group = replicas, group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        for rows, shard, chunks in ctx.replicas:
            buf = g.new_zeros(chunks, *g[rows].shape)
            buf[shard] = g[rows]
            g[rows] = all_reduce(buf, ctx.group)[shard]
        return g, None, None


class ColumnParallelLinear(nn.Module):
    """y[..., local outputs] = x W_local^T + b_local, W split by output rows ([q_r; k_r; v_r] for `parts` [q, k, v],
    each on multiples of `unit` rows, replicated where a piece has fewer units than ranks)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, layout: Layout,
                 parts: list[int] | None = None, dtype=None, device=None, unit: int = 1):
        super().__init__()
        parts, tp = parts or [out_features], layout.tp
        chunks = [tp_chunks(n, tp, unit) for n in parts]
        assert sum(parts) == out_features and all(n % (unit * c) == 0 for n, c in zip(parts, chunks))
        at = [0, *itertools.accumulate(n // c for n, c in zip(parts, chunks))]  # where each local piece starts
        self.group = layout.tp_group
        self.replicas = [(slice(a, b), layout.tp_rank * c // tp, c) for a, b, c in zip(at, at[1:], chunks) if c < tp]
        self.weight = _param((at[-1], in_features), 0, parts, dtype, device, unit=unit)
        self.bias = _param((at[-1],), 0, parts, dtype, device, torch.zeros, unit) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.replicas:  # (rows, its shard, shards) of each replicated piece
            w, b = (t if t is None else _SumOverHolders.apply(t, self.replicas, self.group) for t in (w, b))
        return F.linear(copy_to_tp(x, self.group), w, b)


class RowParallelLinear(nn.Module):
    """y = sum_r x[..., inputs_r] W_r^T (+ b once, after the reduction)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, layout: Layout, dtype=None, device=None):
        super().__init__()
        assert in_features % layout.tp == 0
        self.group = layout.tp_group
        self.weight = _param((out_features, in_features // layout.tp), 1, [in_features], dtype, device)
        self.bias = _param((out_features,), None, None, dtype, device, torch.zeros) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r*V/tp, (r+1)*V/tp); other ids give zeros, and one all-reduce assembles the embedding.
    The padding_idx row gets no gradient from the lookup, as in torch's nn.Embedding (transformers: pad_token_id)."""

    def __init__(self, vocab_size: int, dim: int, layout: Layout, dtype=None, device=None, padding_idx=None):
        super().__init__()
        self.group, n, self.vocab_size = layout.tp_group, vocab_size // layout.tp, vocab_size
        self.start, self.end = layout.tp_rank * n, (layout.tp_rank + 1) * n
        self.weight = _param((n, dim), 0, [vocab_size], dtype, device)
        self.pad = None if padding_idx is None or not self.start <= padding_idx < self.end else padding_idx - self.start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(ids, self.weight, self.pad)
        if not (ids.is_cuda and torch.cuda.is_current_stream_capturing()):  # (a graph's ids: the sampler's own)
            # an id that no rank holds would embed as zeros, silently
            torch._assert_async(((ids >= 0) & (ids < self.vocab_size)).all(), f"ids must be in [0, {self.vocab_size})")
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        return reduce_from_tp(F.embedding(local, self.weight, self.pad).masked_fill(outside.unsqueeze(-1), 0.0),
                              self.group)


# ----------------------------------------------------------------------------- vocab-parallel log-probs


def _logit_stats(logits, local, own, temperature: float):
    """Per token, over this rank's vocabulary slice of z = logits / temperature: the max m, s = sum exp(z - m),
    w = sum exp(z - m) * (z - m) and z at the target (0 where another rank owns it). One read of the logits when
    compiled; no [T, V] tensor outlives it."""
    z = logits.float() / temperature
    m = z.amax(-1)
    d = z - m.unsqueeze(-1)  # shifted by the slice's max: no cancellation of ~|z| in the entropy
    e = torch.exp(d)
    z_t = z.gather(-1, local.unsqueeze(-1)).squeeze(-1) * own
    return m, e.sum(-1), (e * d).sum(-1), z_t


def _logit_grad(logits, local, own, vmax, log_s, ent, g_logp, g_ent, temperature: float):
    """d/dlogits of g_logp * log p(t) + g_ent * H, recomputing p from the logits (nothing [T, V] was saved).
    z - E_p[z] = log p + H, with log p = (z - M) - log S: no term of size |z| cancels."""
    z = logits.float() / temperature
    logp = (z - vmax.unsqueeze(-1)) - log_s.unsqueeze(-1)
    p = torch.exp(logp)
    hit = (torch.arange(z.shape[-1], device=z.device) == local.unsqueeze(-1)) & own.unsqueeze(-1)
    grad = hit * g_logp.unsqueeze(-1) - p * (g_logp.unsqueeze(-1) + g_ent.unsqueeze(-1) * (logp + ent.unsqueeze(-1)))
    return (grad / temperature).to(logits.dtype)


_compile = functools.cache(torch.compile)  # one compiled version per function


def fused(fn, x: torch.Tensor):
    """`fn` compiled into fused kernels when `x` is on a GPU, else `fn` itself (CPU runs the same math eagerly).
    Elementwise chains and row reductions (softmax statistics, RMSNorm, RoPE) are memory-bound: as a dozen
    separate kernels they read and write their [T, V] or [T, d] operand a dozen times, fused once or twice.
    Shapes are left to torch.compile's automatic dynamism: the token count, which changes from call to call,
    turns symbolic at the first recompile, while the model's sizes (V/tp, d) stay constants, so the kernels
    keep aligned, vectorised loads (all-symbolic shapes made the 0.5B decode step ~13% slower on H200)."""
    return _compile(fn) if x.is_cuda else fn


class _VocabParallelLogProb(torch.autograd.Function):
    """log p(target) and the entropy of softmax(logits / temperature) over a TP-split vocabulary. The ranks'
    statistics combine as M = max_r m_r, S = sum_r s_r exp(m_r - M), W = sum_r (w_r + (m_r - M) s_r) exp(m_r - M),
    so log p(t) = z_t - M - log S and H = log S - W / S: every term is shifted by a max, none of size |z| cancels
    (H as lse - E_p[z] lost ~1e-5 to fp32 rounding at z ~ 60). Saves only the logits (as given, bf16 on GPU) and [T]
    vectors for the backward."""

    @staticmethod
    def forward(ctx, logits, targets, group, temperature):
        n, tp = logits.shape[-1], 1 if group is None else dist.get_world_size(group)
        # an id outside the vocabulary would be owned by no rank and score -lse: fail instead (no host sync)
        torch._assert_async(((targets >= 0) & (targets < n * tp)).all(), f"targets must be token ids in [0, {n * tp})")
        local = targets - group_rank(group) * n
        own, local = (local >= 0) & (local < n), local.clamp(0, n - 1)
        m, s, w, z_t = fused(_logit_stats, logits)(logits, local, own, temperature)
        vmax = all_reduce(m.clone(), group, dist.ReduceOp.MAX)
        s, w = all_reduce(torch.stack([s, w + (m - vmax) * s]) * torch.exp(m - vmax), group)  # E_p[z - M] parts
        log_s = s.log()
        ent = log_s - w / s
        ctx.save_for_backward(logits, local, own, vmax, log_s, ent)
        ctx.temperature = temperature
        return (all_reduce(z_t, group) - vmax) - log_s, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits = ctx.saved_tensors[0]  # then local, own, vmax, log_s, ent: _logit_grad's arguments in order
        grad = fused(_logit_grad, logits)(*ctx.saved_tensors, g_logp.contiguous(), g_ent.contiguous(), ctx.temperature)
        return grad, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, tp_group, temperature: float = 1.0,
                            with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of `targets` [T] (global ids) under softmax(logits / temperature), and the entropy
    of that distribution when asked; `logits` is this rank's vocabulary slice [T, V/tp]."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [T, V/tp] and targets [T], got {list(logits.shape)}, {list(targets.shape)}")
    logp, ent = _VocabParallelLogProb.apply(logits, targets, tp_group, float(temperature))
    return logp, (ent if with_entropy else None)


# ----------------------------------------------------------------------------- pipeline schedule


def _detach(out: dict) -> dict:
    return {k: (v.detach() if torch.is_tensor(v) else v) for k, v in out.items()}


_WARM_GROUPS: set = set()


def _p2p(model, layout: Layout, send_next=None, send_prev=None, recv_prev=None, recv_next=None):
    """Post this stage's sends and receives as one batch and wait for all of them. recv_prev / recv_next
    name the micro-batch whose activation / gradient is expected; its shape [tokens, hidden] is known from
    the micro-batch itself (every rank of a PP group has the same list), so no shape message is needed."""
    ops, got = [], [None, None]  # received from the previous, the next stage
    for i, (peer, send, recv) in enumerate(((layout.pp_rank - 1, send_prev, recv_prev),
                                            (layout.pp_rank + 1, send_next, recv_next))):
        if not 0 <= peer < layout.pp:
            continue
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send.detach().contiguous(), layout.pp_ranks[peer], layout.pp_group))
        if recv is not None:
            got[i] = next(model.parameters()).new_empty(recv["input_ids"].numel(), model.cfg.hidden_size)
            ops.append(dist.P2POp(dist.irecv, got[i], layout.pp_ranks[peer], layout.pp_group))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return got[0], got[1]


def pipeline_forward_backward(model, layout: Layout, micro_batches: list[dict], loss_fn,
                              forward_only: bool = False) -> list[dict]:
    """Run every micro-batch forward (and backward) through the pipeline with the 1F1B schedule.

    Each micro-batch is a packed dict (input_ids, position_ids, cu_seqlens, max_seqlen, plus what loss_fn
    needs); all ranks of a PP group pass the same list. `loss_fn(model, hidden, mb) -> (loss, outputs)`
    runs on the last stage; gradients accumulate as usual (into the optimizer's buffers). Returns the
    detached `outputs` of each micro-batch on the last stage and empty dicts elsewhere. Empty micro-batches
    skip the model; the last stage still calls loss_fn on an empty hidden (without grad) for their outputs."""
    work = [i for i, mb in enumerate(micro_batches) if mb["input_ids"].numel() > 0]
    param = next(model.parameters())
    if layout.pp_group not in _WARM_GROUPS:  # NCCL wants the whole group in its first collective
        all_reduce(torch.zeros(1, device=param.device), layout.pp_group)
        _WARM_GROUPS.add(layout.pp_group)
    outputs = dict(zip(work, _1f1b(model, layout, [micro_batches[i] for i in work], loss_fn, forward_only)))
    if layout.is_last_stage:  # empty micro-batches: loss_fn on an empty hidden gives their outputs
        with torch.no_grad():
            for i, mb in enumerate(micro_batches):
                if mb["input_ids"].numel() == 0:
                    outputs[i] = _detach(loss_fn(model, param.new_zeros(0, model.cfg.hidden_size), mb)[1])
    return [outputs.get(i, {}) for i in range(len(micro_batches))]


def _1f1b(model, layout: Layout, mbs: list[dict], loss_fn, forward_only: bool) -> list[dict]:
    """One stage's schedule. pp = 1 has no warmup and no messages (F0 B0 F1 B1 ...); forward_only runs every
    forward as warmup, without grad, so activations only flow downstream."""
    n = len(mbs)
    outputs: list[dict] = [{} for _ in mbs]
    warmup = n if forward_only else min(layout.pp - layout.pp_rank - 1, n)
    inflight: list[tuple] = []  # (input, output) of micro-batches whose backward is pending, oldest first
    p2p = functools.partial(_p2p, model, layout)

    def forward(k, x):  # hidden states to send on, or the loss at the last stage
        mb = mbs[k]
        with torch.set_grad_enabled(torch.is_grad_enabled() and not forward_only):
            if x is not None and not forward_only:
                x.requires_grad_()
            y = model.packed(mb["input_ids"] if layout.is_first_stage else x, mb["position_ids"], mb["cu_seqlens"],
                             mb["max_seqlen"])
            if layout.is_last_stage:
                res = loss_fn(model, y, mb)
                if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[1], dict)):
                    raise TypeError("loss_fn(model, hidden, mb) must return (loss: 0-dim tensor, "
                                    "outputs: dict of tensors)")
                y, outputs[k] = res[0], _detach(res[1])
        if not forward_only:
            inflight.append((x, y))
        return y

    def backward(dy):  # of the oldest pending micro-batch: the gradient to send back
        x, y = inflight.pop(0)
        torch.autograd.backward(y, grad_tensors=dy)
        return None if x is None else x.grad

    for k in range(warmup):
        x, _ = p2p(recv_prev=mbs[k])
        p2p(send_next=forward(k, x))
    x, _ = p2p(recv_prev=mbs[warmup] if warmup < n else None)
    for j in range(n - warmup):  # steady state: forward k = warmup + j, backward j
        _, dy = p2p(send_next=forward(warmup + j, x), recv_next=mbs[j])
        x, _ = p2p(send_prev=backward(dy), recv_prev=mbs[warmup + j + 1] if warmup + j + 1 < n else None)
    for j in range(n - len(inflight), n):  # cooldown: the backwards still pending
        _, dy = p2p(recv_next=mbs[j])
        p2p(send_prev=backward(dy))
    return outputs


# ----------------------------------------------------------------------------- DP + ZeRO-1 AdamW

# torch >= 2.13 renames the flat collectives (the old names warn); older versions have only the old ones
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _cut_buckets(numels: list[int], bucket_size: int, dp: int) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """Flat offsets of consecutive parameters, the bucket of each, and the buckets [start, end): whole
    parameters, a bucket closed before it would pass bucket_size elements (a larger parameter is a bucket of
    its own), each padded to a multiple of dp so that it splits into dp equal parts."""
    offsets, which, buckets, start, end = [], [], [], 0, 0
    for i, n in enumerate(numels):
        offsets.append(end)
        which.append(len(buckets))
        end += n
        if i + 1 == len(numels) or end - start + numels[i + 1] > bucket_size:
            end = start + -(-(end - start) // dp) * dp
            buckets.append((start, end))
            start = end
    return offsets, which, buckets


class ShardedAdamW:
    """AdamW with fp32 master weights and moments sharded over the DP group (ZeRO-1, module docstring).

    The flat buffer orders this rank's parameters by kind (_kind: weight decay?, norm weight, TP-partial grad?), so
    that each property covers a few contiguous runs instead of a per-element mask. Gradients accumulate into the full
    fp32 buffer through post-accumulate hooks (p.grad is freed at once), so micro-batch accumulation of bf16 grads loses
    nothing. Weight decay is decoupled and skipped for 1-D parameters (norms, biases)."""

    STATES = ("master", "exp_avg", "exp_avg_sq")  # this rank's fp32 parts: weights and Adam's two moments

    def __init__(self, model: nn.Module, layout: Layout, lr: float = 1e-6, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, bucket_size: int = 40_000_000):
        self.layout, self.lr, self.betas, self.eps, self.weight_decay = layout, lr, tuple(betas), eps, weight_decay
        self.step_count = 0
        named = list(model.named_parameters())
        if len({p.dtype for _, p in named}) != 1:
            raise ValueError(f"ShardedAdamW needs one compute dtype, got {sorted({str(p.dtype) for _, p in named})}")
        dev = named[0][1].device
        # pp > 1 with tied embeddings: the first stage's embed_tokens and the last's lm_head are copies, grads summed
        self.tied = None
        if layout.embed_group is not None and getattr(model.cfg, "tie_word_embeddings", False):
            mine = model.embed_tokens if layout.is_first_stage else model.lm_head
            ok = all_reduce(torch.tensor([float(mine is not None)], device=dev), layout.embed_group, dist.ReduceOp.MIN)
            self.tied = mine.weight if ok.item() == 1.0 else None
        # flat order: the tied copy, replicated, sharded, then TP-partial last (one contiguous all-reduce)
        named.sort(key=lambda item: self._kind(item[1])[::-1])
        self.params = [p for _, p in named]
        offsets, which, self.buckets = _cut_buckets([p.numel() for p in self.params], bucket_size, layout.dp)
        self.index = [(name, o, tuple(p.shape)) for (name, p), o in zip(named, offsets)]  # (name, offset, shape)
        self.numel, dp, r = sum(p.numel() for p in self.params), layout.dp, layout.dp_rank
        self.owned = [(a + r * (b - a) // dp, a + (r + 1) * (b - a) // dp) for a, b in self.buckets]
        self.grad_buffer = torch.zeros(self.buckets[-1][1], dtype=torch.float32, device=dev)
        self.views = [self.grad_buffer[o:o + p.numel()].view_as(p) for (_, o, _), p in zip(self.index, self.params)]
        self.owned_grads = [self.grad_buffer[a:b] for a, b in self.owned]
        with torch.no_grad():  # stage the parameters in the (still empty) grad buffer to cut the master parts
            torch._foreach_copy_(self.views, self.params)
            self.master = torch.cat(self.owned_grads)
            self.grad_buffer.zero_()
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.master), torch.zeros_like(self.master)
        self.segments = self._segments()
        self.norm_parts = [self.grad_buffer[a:b] for a, b, _, _, w in self.segments if w]
        self.norm_weights = torch.tensor([w for *_, w in self.segments if w], dtype=torch.float32, device=dev)
        self.tied_grad = next((v for p, v in zip(self.params, self.views) if p is self.tied), None)
        start = next((o for (_, o, _), p in zip(self.index, self.params) if self._kind(p)[2]), None)
        self.partial = (start, len(self.grad_buffer)) if start is not None and layout.tp_group is not None else None
        # buckets with the tied copy or TP partial sums wait for that all-reduce; the others go in backward order
        late = {i for p, i in zip(self.params, which) if p is self.tied or self.partial and self._kind(p)[2]}
        self.deferred, self.order = sorted(late), [i for i in reversed(range(len(self.buckets))) if i not in late]
        self.nccl = layout.dp_group is not None and dist.get_backend(layout.dp_group) == "nccl"
        self.counts = [sum(p.requires_grad for p, j in zip(self.params, which) if j == i)
                       for i in range(len(self.buckets))]  # the gradients a bucket receives per backward pass
        self._reset()
        self._host = self._copied = None  # offload()'s host copy of the state; the event that ends prefetch()'s copies
        for h in getattr(model, "_sharded_adamw_hooks", []):  # a new optimizer of this model replaces the old
            h.remove()
        model._sharded_adamw_hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._accumulate, v, i))
                                      for p, v, i in zip(self.params, self.views, which) if p.requires_grad]

    def _norm_weights(self, p) -> list[tuple[int, float]]:
        """(elements, weight in the grad norm) along p: 1 / (the TP ranks holding the same values), so 1 for a
        sharded piece, 1/tp for a replicated parameter, chunks/tp for a replicated KV head; 0 for the tied copy."""
        if p is self.tied and not self.layout.is_first_stage:
            return [(p.numel(), 0.0)]
        if p.tp_dim != 0:
            return [(p.numel(), 1.0 if p.tp_dim is not None else 1.0 / self.layout.tp)]
        tp, row = self.layout.tp, p[0].numel()
        chunks = [tp_chunks(full, tp, p.tp_unit) for full in p.tp_parts]
        return [(row * (full // c), c / tp) for full, c in zip(p.tp_parts, chunks)]

    def _kind(self, p) -> tuple[bool, float, bool]:
        """(weight decay?, first norm weight (the flat order groups by it), TP-partial grad?)."""
        return p.dim() >= 2, self._norm_weights(p)[0][1], bool(getattr(p, "tp_partial_grad", False))

    def _segments(self) -> list[tuple[int, int, int, bool, float]]:
        """Runs (start, end, local start, decay, norm weight) of equal kind, cut to this rank's owned ranges:
        start and end address the grad buffer, the local start the master weights and moments."""
        runs = []  # [start, end, decay, weight] of consecutive elements of one kind
        for (_, off, _), p in zip(self.index, self.params):
            for n, weight in self._norm_weights(p):
                if not runs or runs[-1][2:] != [p.dim() >= 2, weight]:  # a new kind starts a new run
                    runs.append([off, off, p.dim() >= 2, weight])
                off = runs[-1][1] = off + n
        segments, local = [], 0
        for lo, hi in self.owned:
            segments += [(max(a, lo), min(b, hi), local + max(a, lo) - lo, d, w) for a, b, d, w in runs
                         if a < hi and b > lo]
            local += hi - lo
        return segments

    def _accumulate(self, view: torch.Tensor, bucket: int, p) -> None:  # p's post-accumulate-grad hook
        view.add_(p.grad)
        p.grad = None
        if self.need is not None:
            self.arrived[bucket] += 1
            if self.arrived[bucket] > self.need[bucket]:  # its reduction may have started: the sum would be wrong
                raise RuntimeError("a gradient arrived after its bucket was complete: more backward passes "
                                   "than expect_backwards() announced")
            self._launch_ready()

    def _reset(self) -> None:
        self.need, self.arrived, self.launched, self.works = None, [0] * len(self.buckets), 0, []

    def zero_grad(self) -> None:
        self._wait()
        self.grad_buffer.zero_()
        self._reset()

    def expect_backwards(self, m: int) -> None:
        """Announce m backward passes (this rank's non-empty micro-batches, on every pipeline stage) after
        zero_grad: each bucket then starts its DP sum once its last gradient is in (else reduce_gradients does)."""
        self.need = [m * k for k in self.counts]

    def _launch_ready(self) -> None:
        # strictly in self.order, whichever completes first: every DP rank issues the same collective sequence
        while self.launched < len(self.order):
            i = self.order[self.launched]
            if self.arrived[i] < self.need[i]:
                return
            self._reduce_bucket(i)
            self.launched += 1

    def _reduce_bucket(self, i: int) -> None:
        """Start bucket i's DP sum in place: NCCL reduce-scatters it, gloo (older torch lacks that) all-reduces it."""
        bucket, group = self.grad_buffer[self.buckets[i][0]:self.buckets[i][1]], self.layout.dp_group
        if group is not None:
            self.works.append(_reduce_scatter_flat(self.owned_grads[i], bucket, group=group, async_op=True)
                              if self.nccl else dist.all_reduce(bucket, group=group, async_op=True))

    def reduce_gradients(self) -> None:
        """The DP sums not started in the backward, then the TP partial and tied sums, then their buckets' DP sums."""
        for i in self.order[self.launched:]:
            self._reduce_bucket(i)
        if self.partial is not None:
            all_reduce(self.grad_buffer[self.partial[0]:self.partial[1]], self.layout.tp_group)
        if self.tied is not None:
            all_reduce(self.tied_grad, self.layout.embed_group)
        for i in self.deferred:
            self._reduce_bucket(i)
        for work in self.works:
            work.wait()
        self._reset()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale the gradient parts so that the global L2 norm is at most max_norm (max_norm <= 0 only measures);
        returns the norm before clipping. A non-finite norm is returned as it is and nothing is scaled: the caller
        should skip the step. Every element counts once over the whole grid: DP parts are disjoint, PP stages hold
        different layers, TP-sharded parameters are disjoint slices, and values held by r TP ranks (replicated
        parameters, r = tp; replicated KV heads) count 1/r on each; so one all-reduce over the world sums it all."""
        sq = (torch.stack(torch._foreach_norm(self.norm_parts)).square() @ self.norm_weights if self.norm_parts
              else self.grad_buffer.new_zeros(()))
        norm = world_all_reduce(sq).sqrt().item()
        if max_norm > 0 and math.isfinite(norm) and (coef := max_norm / (norm + 1e-6)) < 1.0:
            torch._foreach_mul_(self.owned_grads, coef)
        return norm

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        """One AdamW step on this rank's parts, then publish the weights to every replica. torch's fused kernel makes
        one pass over weights, moments and gradients (~30 bytes a parameter) where a chain of foreach ops made ~8."""
        lr = self.lr if lr is None else lr
        self.step_count += 1
        t = torch.full((), float(self.step_count), device=self.master.device)
        for decay in (True, False):
            if runs := [(a, b, c) for a, b, c, d, _ in self.segments if d == decay]:
                w, avg, sq = ([x[c:c + b - a] for a, b, c in runs] for x in self._state())
                torch._fused_adamw_(w, [self.grad_buffer[a:b] for a, b, _ in runs], avg, sq, [], [t] * len(runs),
                                    lr=lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps, amsgrad=False,
                                    weight_decay=self.weight_decay if decay else 0.0, maximize=False)
        # publish: all-gather the master parts into the parameters, staged (in their dtype) in the spent grad buffer
        dtype = self.params[0].dtype
        full = self.grad_buffer.view(torch.uint8)[:self.grad_buffer.numel() * dtype.itemsize].view(dtype)
        self._gather(self.master, full)
        views = [full[o:o + p.numel()].view_as(p) for (_, o, _), p in zip(self.index, self.params)]
        torch._foreach_copy_(self.params, views)
        self.grad_buffer.zero_()

    def _gather(self, parts: torch.Tensor, full: torch.Tensor) -> None:
        """Every DP rank's parts of each bucket into the flat `full` (cast to its dtype)."""
        group = self.layout.dp_group
        for (a, b), mine in zip(self.buckets, parts.split([b - a for a, b in self.owned])):
            if group is None:
                full[a:b].copy_(mine)
            elif self.nccl:
                _all_gather_flat(full[a:b], mine.to(full.dtype), group=group)
            else:
                dist.all_gather(list(full[a:b].chunk(self.layout.dp)), mine.to(full.dtype), group=group)

    def offload(self) -> None:
        """Free this optimizer's device memory between steps (while the actor generates): the fp32 state goes to
        (pinned) host memory and the grad buffer, all zeros then, is dropped. Only the storages are resized, so
        every view of them stays valid for reload()."""
        if self._host is None:  # else the state never came back since the last offload: the host copy is current
            self._wait()
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda).copy_(t) for t in self._state()]
        for t in (*self._state(), self.grad_buffer):
            t.untyped_storage().resize_(0)

    def reload(self) -> None:
        """Give the state its device memory back. The copies wait for prefetch(), or for the next zero_grad(),
        offload() or checkpoint call, which makes them."""
        for t in (*self._state(), self.grad_buffer):
            t.untyped_storage().resize_(t.numel() * t.element_size())
        self.grad_buffer.zero_()

    def prefetch(self) -> None:
        """Start reload()'s host-to-device copies on a side stream without blocking the host, so that they run under
        the next forward passes. Call it once those passes' inputs are on the device: a copy engine takes copies in
        order, and an input copy queued behind gigabytes of state would hold the passes back until it is done."""
        if self._host is None:
            return
        side = torch.cuda.Stream(self.master.device) if self.master.is_cuda else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())  # the storages were allocated on the current stream
        with torch.cuda.stream(side):  # a no-op context on CPU
            torch._foreach_copy_(self._state(), self._host, non_blocking=True)
            self._copied = side.record_event() if side is not None else None
        self._host = None  # a pinned block is reused only once the copies that read it are done

    def _wait(self) -> None:
        """Order the current stream after reload()'s copies (starting them if nothing did)."""
        self.prefetch()
        if self._copied is not None:
            torch.cuda.current_stream().wait_event(self._copied)
            self._copied = None

    def _state(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.STATES]

    def full_state(self, name: str) -> dict[str, torch.Tensor]:
        """One of STATES per parameter of this rank, whole over DP and shaped like it: the layout-free form a checkpoint
        keeps. Views of the grad buffer (free between steps): copy them out before the next zero_grad()."""
        self._wait()
        self._gather(getattr(self, name), self.grad_buffer)
        return {n: v for (n, _, _), v in zip(self.index, self.views)}

    def load_full_state(self, name: str, tensors) -> None:
        """The inverse: (parameter name, whole tensor) pairs, every parameter once, in any order."""
        self._wait()
        views, seen = {n: v for (n, _, _), v in zip(self.index, self.views)}, set()
        for n, t in tensors:
            if n not in views:
                raise ValueError(f"optimizer state {name!r}: {n!r} is not a parameter of this model")
            views[n].copy_(t)
            seen.add(n)
        if missing := set(views) - seen:
            raise ValueError(f"optimizer state {name!r}: no values for {sorted(missing)[:3]}")
        getattr(self, name).copy_(torch.cat(self.owned_grads))
        self.grad_buffer.zero_()


def lr_at(step: int, total_steps: int, lr: float, warmup_steps: int = 0, schedule: str = "constant",
          min_lr_ratio: float = 0.0) -> float:
    """Learning rate at training step `step` (0-based; every optimizer step of a training step uses it): linear
    warmup from lr/warmup_steps to lr over warmup_steps, then constant, cosine or linear decay to min_lr_ratio * lr
    at total_steps."""
    if schedule not in ("constant", "cosine", "linear"):
        raise ValueError(f"lr schedule {schedule!r} is not one of 'constant', 'cosine', 'linear'")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * shape)


# ----------------------------------------------------------------------------- sharded model state


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's local shards under our parameter names (layer i of the stage is model.layer_start + i)."""
    return {name: p.detach() for name, p in model.named_parameters()}


def shard_name(layout: Layout, with_dp: bool = False) -> str:
    """File stem of a rank's shard: 'pp{p}_tp{t}' for weights and optimizer state (whole over DP), with a
    'dp{d}_' prefix for what differs per DP rank (sampler, RNG)."""
    stem = f"pp{layout.pp_rank}_tp{layout.tp_rank}"
    return f"dp{layout.dp_rank}_{stem}" if with_dp else stem
