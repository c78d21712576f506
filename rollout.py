"""Generation for RL: a KV-cached, continuously batched sampler that returns token log-probs.

**The cache and its rows.** The KV cache is one static block [layers, rows, 2 (k, v), kv_heads, max_len, head_dim]
(model.KVCache), sized once from a token budget: `rows = min(max_rows, budget // max_len)`. A row is a slot that
sequences take turns in (nothing is paged): its prompt's k/v, then one position per new token.

    prefill   packed prompts of the newly admitted sequences, one forward  ->  k/v into their rows
    decode    one token for every row 0..B-1, one forward per step         ->  k/v at position len-1

A prompt is prefilled once per admission, into the first of the rows its samples got: once for all n when n rows are
free, else again for the samples admitted later. `KVCache.copy_rows` copies its k/v to the other rows, and each sample
draws its first token from the shared last-position logits. While decoding, every row reads the prompt's positions
from the lowest live row of its prompt (`src`, `plen`): the n programs that read one prompt run side by side, so n-1
of those reads come from L2, not HBM. In a GRPO step the prompt is a large part of the k/v a step reads. The copies
are still made: when that row ends, the next live sample takes over.

**Continuous batching.** The host looks at the rows only every `sync_every` decode steps (one small copy of the per-row
`done` flags and token counts); in between, the next tokens, row lengths, outputs and the stop test (a stop token, or
max_new_tokens) stay on the device: no host sync per token. At a check, finished rows are read out and refilled from the
waiting prompts, so a long tail does not idle the batch (a row done mid-window decodes a few tokens nobody reads). When
nothing is waiting and few rows are live, they move to the front (k/v copied) so decode runs over fewer rows.

A decode step runs rows 0..B-1, each attending to its own length. On CUDA each step (forward, sampling, bookkeeping) is
captured in a CUDA graph per bucket (B in 1, 2, 4, ..., rows; the sampling settings) over static buffers, after one
eager step that also warms up cuBLAS and NCCL; the attention kernel reads the lengths at run time, so no graph depends
on them. On CPU steps are eager and attend over the first L positions, L covering every row until the next check.

**Sampling on the device, over a split vocabulary: Gumbel-max.** If g_i are independent Gumbel(0, 1) draws, argmax_i
(z_i + g_i) falls on token i with probability exactly softmax(z)_i. So a sampler needs no running sum over the
vocabulary, only a max, the same reduction as greedy decoding (which is g = 0). The noise is counter-based: g for
token id i at position t of sample (p, j) is a hash of (seed, p, j, t, i), or of (seeds[p], j, t, i) with per-request
seeds, so a draw depends on neither the row, the cache size, tp nor (with seeds) the rest of the batch, and TP ranks
agree without talking. Each rank reduces its slice of the logits [B, V/tp] to (best z + g, its id, z there,
logsumexp z) in one fused pass; one all-gather of those [B, 4] picks the winner and gives the log-prob.

* top-k: the global top k are among the union of the ranks' local top k, so one all-gather of those values gives the
  k-th largest logit, and the same Gumbel-max runs over the logits at or above it (ties with the k-th included).
* top-p: the nucleus is every token above some value v, and part of those tied with it. v is found without sorting
  the vocabulary: a bisection over the floats' bit patterns (read as ordered ints), where each step asks whether the
  tokens above the midpoint hold < top_p of the (top-k-renormalised) mass: one pass over the logits that sums their
  exp, then an all-gather of a few statistics per row; 16 steps for bf16. The same Gumbel-max then runs over the logits
  >= v, with the tokens tied with v weighted by the share of them that the nucleus keeps.

The returned log-prob of a sampled token is log_softmax(logits / T) over the whole vocabulary: the distribution the
trainer recomputes, NOT the top-k/top-p-renormalised one that was sampled from (that mismatch is what
rollout-correction weights measure). Greedy returns log_softmax at T=1."""
from __future__ import annotations

import argparse
import functools
import math
import os
import time
from dataclasses import dataclass
from numbers import Integral

import torch
import torch.distributed as dist

from model import TRITON, AttnContext, KVCache, Transformer, load_model, read_json
from parallel import all_gather_stack, all_reduce, fused

if TRITON:
    import triton
    import triton.language as tl

MAX_STOP_IDS = 64  # capacity of the static stop-token buffer the decode graphs read
MIN_TEMPERATURE = 1e-5  # below it (but 0, greedy) logits / T overflow fp32


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    max_new_tokens: int = 256
    stop_token_ids: tuple = ()
    seed: int = 0
    ignore_eos: bool = False

    def check(self) -> None:
        stops = self.stop_token_ids
        for k, want, ok in (
                ("n", "an int >= 1", isinstance(self.n, int) and self.n >= 1),
                ("temperature", "0 (greedy) or a finite number >= 1e-5 (below, logits / T overflow)",
                 isinstance(self.temperature, (int, float))
                 and (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf)),
                ("top_p", "a number in (0, 1]", isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1),
                ("top_k", "-1 or 0 (off) or >= 1", isinstance(self.top_k, int) and self.top_k >= -1),
                ("max_new_tokens", "an int >= 1", isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1),
                ("stop_token_ids", "a list or tuple of ints (one id: (id,))",
                 isinstance(stops, (list, tuple)) and all(isinstance(t, Integral) for t in stops)),
                ("seed", "an int", isinstance(self.seed, int))):
            if not ok:
                raise ValueError(f"SamplingParams.{k}={getattr(self, k)!r}: expected {want}")


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop/EOS token, included in token_ids) or "length"


# ----------------------------------------------------------------------------- counter-based noise

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1


def _fmix32(x):
    """MurmurHash3's 32-bit finalizer, a bijection with full avalanche. Works on Python ints and on
    int64 tensors holding values in [0, 2^32) (the products wrap mod 2^64; the mask keeps 32 bits)."""
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & _M32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def sample_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """One sample's random stream; distinct for a prompt's samples (the last step is a bijection of sample_index)."""
    h = _fmix32((seed & _M32) ^ _fmix32(((seed >> 32) + 0x7F4A7C15) & _M32))
    h = _fmix32(h ^ _fmix32((prompt_index * _GOLDEN + 0x632BE5AB) & _M32))
    return _fmix32((h + sample_index * _GOLDEN) & _M32)


def gumbel(keys: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, N] for the token ids [N] (or [B, N]) at each row's (key, position):
    -log(-log u), u in (0, 1) from 23 bits of a hash of (key, position, id): then h + 0.5 is exact in fp32 and
    u <= 1 - 2^-24 (24 bits rounded the top hash to u = 1: g = +inf won whatever the logit, ~1% of draws at 152k)."""
    row = _fmix32(keys ^ _fmix32((positions * _GOLDEN + 0x2545F491) & _M32))[:, None]
    h = _fmix32(row ^ _fmix32((ids * _GOLDEN + 0x165667B1) & _M32))
    return -torch.log(-torch.log(((h >> 9).float() + 0.5) * 2.0 ** -23))


# ----------------------------------------------------------------------------- vocab-parallel sampling


def _sample_stats(logits, keys, positions, temperature: float, vocab_start: int, limit: int | None, floor=None,
                  tie_weight=None):
    """This rank's slice [B, V/tp] -> [B, 4]: the best score z + g (z alone when greedy), its global id,
    z there, and logsumexp(z); z = logits / T in fp32 (T = 1 when greedy). Only logits >= floor [B] (top-k's, top-p's)
    are drawn, those equal to it with their weight times tie_weight [B] if given. The reference of the kernel."""
    z = logits.float() / (temperature or 1.0)
    ids = torch.arange(z.shape[-1], device=z.device)
    score = z + gumbel(keys, positions, ids + vocab_start) if temperature > 0 else z
    if limit is not None:  # ids past the tokenizer's vocabulary are never drawn but stay in the softmax
        score = score.masked_fill(ids >= limit, float("-inf"))
    if floor is not None:
        score = score.masked_fill(logits < floor[:, None], float("-inf"))
    if tie_weight is not None:
        score = score + torch.where(logits == floor[:, None], tie_weight.log()[:, None], 0.0)
    val, idx = score.max(-1)
    z_idx = z.gather(1, idx[:, None])[:, 0]
    return torch.stack([val, (idx + vocab_start).float(), z_idx, torch.logsumexp(z, -1)], -1)


if TRITON:
    @triton.jit
    def _fmix32_tl(x):
        x = (x ^ (x >> 16)) * 0x85EBCA6B
        x = (x ^ (x >> 13)) * 0xC2B2AE35
        return x ^ (x >> 16)

    @triton.jit
    def _uniform(row, ids):
        """gumbel()'s u for token ids at a row's hash, from the bits: the float 1 + (h >> 9) 2^-23 less 1 - 2^-24."""
        h = _fmix32_tl(row ^ _fmix32_tl(ids * 0x9E3779B1 + 0x165667B1))
        return ((h >> 9) | 0x3F800000).to(tl.float32, bitcast=True) - 0.99999994039535522

    @triton.jit
    def _neg_log2(u):
        """-log2 u for _uniform's u: lg2.approx, one instruction where tl.log is a polynomial of ~20; but its absolute
        error (~2^-22) would swamp the result near u = 1 (7x too small at the top u, +2 nats to that token's score), so
        there the series (v + v^2/2 + v^3/3) / ln 2 in v = 1 - u, which is exact in fp32."""
        v = 1.0 - u
        lg2 = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [u], dtype=tl.float32, is_pure=True, pack=1)
        return tl.where(v < 0.015625, v * (1.0 + v * (0.5 + v * 0.33333334)) * 1.4426950408889634, -lg2)

    @triton.jit
    def _sample_chunk(Z, Keys, Pos, Floor, Tie, Out, V, stride_z, inv_temperature, vocab_start, limit,
                      GREEDY: tl.constexpr, FLOOR: tl.constexpr, TIES: tl.constexpr, LIMIT: tl.constexpr,
                      CHUNK: tl.constexpr):
        """Program (row b, chunk c) of _sample_stats in uint32 arithmetic (the same hashes): the chunk's max
        and sum of exp of z, its best score, that token's index in the slice and z there. argmax z - log E is
        argmin E / exp(z - m): one log per token instead of two, and the exp is the one the sum needs. That log is
        mostly lg2.approx (E / ln 2: the same argmin); tl.log's polynomial and a division by T made it 1.7x slower."""
        b, c = tl.program_id(0), tl.program_id(1)
        i = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(Z + b * stride_z + i, mask=i < V, other=float("-inf"))
        z = x.to(tl.float32) * inv_temperature
        m = tl.max(z, 0)
        p = tl.exp(z - m)
        total = tl.sum(p, 0)
        keep = i < limit
        if FLOOR:  # top-k, top-p: the raw logits against the smallest one kept, so ties with it stay in
            floor = tl.load(Floor + b)
            keep = keep & (x >= floor)
        if GREEDY:
            best, j = tl.max(tl.where(i < limit, z, float("-inf")), 0, return_indices=True)
            at = best
        else:
            pos = tl.load(Pos + b).to(tl.uint32)
            row = _fmix32_tl(tl.load(Keys + b).to(tl.uint32) ^ _fmix32_tl(pos * 0x9E3779B1 + 0x2545F491))
            e = _neg_log2(_uniform(row, (i + vocab_start).to(tl.uint32)))
            if LIMIT:  # relative to the allowed ids' max: an id past the limit 87 nats above them all (at a low T)
                p = tl.exp(z - tl.max(tl.where(i < limit, z, float("-inf")), 0))  # underflowed their p to 0
            if TIES:  # top-p: the tokens tied with the floor weigh the share of them the nucleus keeps
                tie = tl.load(Tie + b)
                p = tl.where(x == floor, p * tie, p)
            _, j = tl.min(tl.where(keep, e / p, float("inf")), 0, return_indices=True)
            x_j = tl.load(Z + b * stride_z + c * CHUNK + j)
            at = x_j.to(tl.float32) * inv_temperature
            g_j = -tl.log(-tl.log(_uniform(row, (c * CHUNK + j + vocab_start).to(tl.uint32))))  # exact, once
            ok = c * CHUNK + j < limit
            if FLOOR:
                ok = ok & (x_j >= floor)
            if TIES:
                g_j += tl.where(x_j == floor, tl.log(tie), 0.0)
            best = tl.where(ok, at + g_j, float("-inf"))
        o = Out + (b * tl.num_programs(1) + c) * 5
        tl.store(o, m)
        tl.store(o + 1, total)
        tl.store(o + 2, best)
        tl.store(o + 3, (c * CHUNK + j).to(tl.float32))
        tl.store(o + 4, at)


def _sample_stats_gpu(logits, keys, positions, temperature: float, vocab_start: int, limit: int | None,
                      floor=None, tie_weight=None, chunk: int = 4096):
    """_sample_stats with the vocabulary cut into chunks, one program each (B programs alone would leave
    the GPU idle and serialise the hashing), then the chunks combined like the ranks are."""
    B, V = logits.shape
    out = torch.empty(B, triton.cdiv(V, chunk), 5, dtype=torch.float32, device=logits.device)
    _sample_chunk[(B, out.shape[1])](logits, keys, positions, logits if floor is None else floor,
                                     out if tie_weight is None else tie_weight, out, V, logits.stride(0),
                                     1.0 / (temperature or 1.0), vocab_start, V if limit is None else limit,
                                     GREEDY=temperature == 0, FLOOR=floor is not None, TIES=tie_weight is not None,
                                     LIMIT=limit is not None and limit < V, CHUNK=chunk)
    return fused(_combine_chunks, out)(out, vocab_start)


def _combine_chunks(out: torch.Tensor, vocab_start: int) -> torch.Tensor:
    m = out[..., 0].amax(-1, keepdim=True)
    lse = m[:, 0] + (out[..., 1] * (out[..., 0] - m).exp()).sum(-1).log()
    pick = out.gather(1, out[..., 2].argmax(-1)[:, None, None].expand(-1, 1, 5))[:, 0]
    return torch.stack([pick[:, 2], pick[:, 3] + vocab_start, pick[:, 4], lse], -1)


def sample_tokens(logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, temperature: float, group,
                  vocab_start: int = 0, limit: int | None = None, floor: torch.Tensor | None = None,
                  tie_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact draw from softmax(logits / T) by Gumbel-max (temperature 0: argmax) over the split vocabulary, among
    the logits >= floor [B] if given (top_k_floor), those equal to it weighted by tie_weight [B] if given (top-p's);
    returns (tokens [B], their log_softmax(logits / T), T = 1 when greedy)."""
    stats = _sample_stats_gpu if TRITON and logits.is_cuda else _sample_stats
    s = stats(logits, keys, positions, temperature, vocab_start, limit, floor, tie_weight)
    if group is None:
        return s[:, 1].long(), s[:, 2] - s[:, 3]
    g = all_gather_stack(s, group)  # [tp, B, 4]
    win = g[..., 0].argmax(0)  # the first maximum: lowest rank, so lowest id on ties
    pick = g.gather(0, win[None, :, None].expand(1, -1, 4))[0]
    return pick[:, 1].long(), pick[:, 2] - torch.logsumexp(g[..., 3], 0)


def top_k_floor(logits: torch.Tensor, top_k: int, group, limit: int | None = None) -> torch.Tensor:
    """The k-th largest logit [B] of the whole (split) vocabulary, in the logits' dtype: top-k keeps every token at or
    above it, so the tokens tied with the k-th all stay in, as in transformers (topk's own pick among ties is
    arbitrary, and per rank under tp). The k largest of the union of the ranks' local k largest are the global ones."""
    B, V = logits.shape
    if limit is not None:
        logits = logits.masked_fill(torch.arange(V, device=logits.device) >= limit, float("-inf"))
    vals = logits.topk(min(top_k, V), dim=-1).values.float()  # (gloo gathers no bf16; the values are exact in fp32)
    if group is not None:
        vals = all_gather_stack(vals, group).transpose(0, 1).reshape(B, -1)
        vals = vals.topk(min(top_k, vals.shape[-1]), dim=-1).values
    return vals[:, -1].to(logits.dtype)


def _cut_stats_ref(x, cut, floor, inv_temperature: float, limit: int):
    """[B, V] slice -> [B, 1, 4], one part's statistics: over the allowed ids (>= floor, < limit) the max M of
    z = x / T, the sum of exp(z - M), that sum over the tokens above `cut` [B] (a value in x's dtype), and the count
    of those equal to it. The kernel's reference."""
    ok = (x >= floor[:, None]) & (torch.arange(x.shape[-1], device=x.device) < limit)
    z = torch.where(ok, x.float() * inv_temperature, float("-inf"))
    m = z.amax(-1)
    p = torch.where(ok, torch.exp(z - m[:, None]), 0.0)
    above, equal = (p * (x > cut[:, None])).sum(-1), (ok & (x == cut[:, None])).sum(-1)
    return torch.stack([m, p.sum(-1), above, equal], -1)[:, None]


if TRITON:
    @triton.jit
    def _cut_part(X, Cut, Floor, Out, V, stride_x, inv_temperature, limit, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row b, part s of SPLIT ids) of _cut_stats_ref: one pass for the max, one for the sums (one pass
        with a running max was no faster on H200)."""
        b, s = tl.program_id(0), tl.program_id(1)
        f, cut = tl.load(Floor + b), tl.load(Cut + b)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for n0 in range(s * SPLIT, (s + 1) * SPLIT, BLOCK):
            i = n0 + tl.arange(0, BLOCK)
            x = tl.load(X + b * stride_x + i, mask=i < V, other=float("-inf"))
            m = tl.maximum(m, tl.where((i < limit) & (x >= f), x.to(tl.float32) * inv_temperature, float("-inf")))
        m_all = tl.max(m, 0)
        total, mass = tl.zeros([BLOCK], tl.float32), tl.zeros([BLOCK], tl.float32)
        n_equal = tl.zeros([BLOCK], tl.int32)
        for n0 in range(s * SPLIT, (s + 1) * SPLIT, BLOCK):
            i = n0 + tl.arange(0, BLOCK)
            x = tl.load(X + b * stride_x + i, mask=i < V, other=float("-inf"))
            ok = (i < limit) & (x >= f)
            p = tl.where(ok, tl.exp(x.to(tl.float32) * inv_temperature - m_all), 0.0)
            total += p
            mass += tl.where(x > cut, p, 0.0)
            n_equal += (ok & (x == cut)).to(tl.int32)
        o = Out + (b * tl.num_programs(1) + s) * 4
        tl.store(o, m_all)
        tl.store(o + 1, tl.sum(total, 0))
        tl.store(o + 2, tl.sum(mass, 0))
        tl.store(o + 3, tl.sum(n_equal, 0).to(tl.float32))


def _cut_stats(logits, cut, floor, inv_temperature: float, limit: int, group, split: int = 8192) -> torch.Tensor:
    """_cut_stats_ref of each part of the rows [B, parts, 4]: on GPU a kernel's parts of SPLIT ids; over the ranks,
    all their parts."""
    B, V = logits.shape
    if TRITON and logits.is_cuda:
        st = torch.empty(B, triton.cdiv(V, split), 4, dtype=torch.float32, device=logits.device)
        _cut_part[(B, st.shape[1])](logits, cut, floor, st, V, logits.stride(0), inv_temperature, limit,
                                    SPLIT=split, BLOCK=1024)
    else:
        st = _cut_stats_ref(logits, cut, floor, inv_temperature, limit)
    return st if group is None else all_gather_stack(st, group).transpose(0, 1).flatten(1, 2)


def _combine_cut_stats(st: torch.Tensor) -> torch.Tensor:
    """[B, parts, 4] -> [B, 4]: the parts' sums rescaled to the largest max (a part with no allowed id, or only -inf
    logits, has max -inf, NaN sums, and weighs 0)."""
    m = st[..., 0].amax(-1, keepdim=True)
    w = torch.exp(st[..., 0] - m).nan_to_num(0.0)[..., None]
    return torch.cat([m, torch.where(w > 0, st[..., 1:3] * w, 0.0).sum(1), st[..., 3:].sum(1)], -1)


def _flip(bits: torch.Tensor, width: int) -> torch.Tensor:
    """A float's bits as a signed int <-> a key ordered as the floats are (a negative's magnitude bits flipped); the
    map is its own inverse."""
    return bits ^ ((bits >> (width - 1)) & (2 ** (width - 1) - 1))


_INT = {16: torch.int16, 32: torch.int32}  # a float's bits, by width


def _from_key(key: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    width = torch.finfo(dtype).bits
    return _flip(key, width).to(_INT[width]).view(dtype)


def _narrow(lo, hi, parts, top_p: float, dtype: torch.dtype):
    """One bisection step at the midpoint key, given its _cut_stats; returns (lo, hi) and the next midpoint's value."""
    st, mid = _combine_cut_stats(parts), (lo + hi) // 2
    ok = (st[:, 2] < top_p * st[:, 1]) | (st[:, 2] == 0)  # P(mid): those above hold < top_p (none: a tiny top_p)
    lo, hi = torch.where(ok, lo, mid), torch.where(ok, mid, hi)
    return lo, hi, _from_key((lo + hi) // 2, dtype)


def _nucleus_end(logits, floor, inv_temperature: float, limit: int, group, top_p: float):
    """Where the nucleus of the allowed ids ends: the smallest value v [B] whose tokens are kept, by bisection over
    the floats' keys. P(v) = "the tokens above v hold < top_p of the mass" is false at -inf, true at +inf and turns
    true once, at v; each step reads the logits once, and width steps (16 for bf16) leave lo, hi adjacent."""
    B, width, dtype = logits.shape[0], torch.finfo(logits.dtype).bits, logits.dtype
    ends = torch.tensor([float("-inf"), float("inf")], dtype=dtype).view(_INT[width]).long()  # (on the host: no copy
    lo, hi = (torch.full((B,), k, device=logits.device) for k in _flip(ends, width).tolist())  # in a CUDA graph)
    cut = _from_key((lo + hi) // 2, dtype)
    for _ in range(width):
        lo, hi, cut = fused(_narrow, logits)(lo, hi, _cut_stats(logits, cut, floor, inv_temperature, limit, group),
                                             top_p, dtype)
    return _from_key(hi, dtype)


def sample_top_k_top_p(logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, temperature: float,
                       top_k: int, top_p: float, group, vocab_start: int = 0, limit: int | None = None):
    """Draw from softmax(logits / T) restricted to the top-k (top_k 0: off; every token tied with the k-th in, as in
    transformers), then to the nucleus of mass top_p of that renormalised distribution: a token stays while the mass
    above it is < top_p; log-probs as in sample_tokens. The nucleus ends at a value `last` (_nucleus_end: a
    bisection, no sort). The fused sampler draws from the tokens at or above it, those tied with it weighted by the
    share of them the nucleus keeps, so spread evenly over them (transformers keeps the ones its sort puts first, an
    order that equal logits do not have)."""
    logits = logits.float() if logits.dtype == torch.float64 else logits  # (the bisection reads 16- or 32-bit keys)
    B, V = logits.shape
    limit, inv_t = V if limit is None else limit, 1.0 / temperature
    floor = (top_k_floor(logits, top_k, group, limit) if top_k > 0
             else torch.full((B,), float("-inf"), dtype=logits.dtype, device=logits.device))
    last = _nucleus_end(logits, floor, inv_t, limit, group, top_p)
    st = fused(_combine_cut_stats, logits)(_cut_stats(logits, last, floor, inv_t, limit, group))
    lse, mass, n = st[:, 0] + st[:, 1].log(), st[:, 2] / st[:, 1], st[:, 3]  # mass: of the tokens above last
    # i of the n tied tokens are in while mass + (i - 1) q < top_p: as a share of all n, a weight on their draw
    n_keep = ((top_p - mass) / torch.exp(last.float() * inv_t - lse)).ceil().clamp(1).minimum(n)  # (the first is in)
    return sample_tokens(logits, keys, positions, temperature, group, vocab_start, limit, last, n_keep / n)


# ----------------------------------------------------------------------------- the generator


class Generator:
    """Generation from a full (pp == 1) model, tensor-parallel over `model.layout.tp_group`: every rank of
    that group calls generate() with the same prompts and gets the same completions.

    The KV cache budget is `kv_cache_tokens`, or on CUDA `gpu_memory_fraction` of the free memory (the minimum over the
    TP group), or on CPU max_rows * max_len. With max_len None the cache is sized at the first generate() to its longest
    prompt + max_new_tokens (regrown if a later call needs more). `vocab_size` keeps ids past the tokenizer's vocabulary
    from being drawn (their logits stay in the softmax). `free()` drops the cache and graphs, not the model."""

    def __init__(self, model: Transformer, max_rows: int = 256, max_len: int | None = None,
                 kv_cache_tokens: int | None = None, gpu_memory_fraction: float = 0.5, use_cuda_graphs: bool = True,
                 vocab_size: int | None = None, sync_every: int = 16, max_prefill_tokens: int = 16384):
        cfg = model.cfg
        if model.layout.pp != 1 or model.embed_tokens is None or model.lm_head is None:
            raise ValueError(f"Generator needs a whole model (pp=1, embedding and LM head); got pp={model.layout.pp}")
        for name, v in (("max_rows", max_rows), ("sync_every", sync_every), ("max_prefill_tokens", max_prefill_tokens),
                        ("max_len", 1 if max_len is None else max_len),
                        ("kv_cache_tokens", 1 if kv_cache_tokens is None else kv_cache_tokens)):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"Generator {name}={v!r}: expected an int >= 1")
        if not 0 < gpu_memory_fraction <= 1:
            raise ValueError(f"Generator gpu_memory_fraction={gpu_memory_fraction}: expected a value in (0, 1]")
        if vocab_size is not None and not 1 <= vocab_size <= cfg.vocab_size:
            raise ValueError(f"Generator vocab_size={vocab_size}: expected 1..{cfg.vocab_size} (config vocab_size)")
        if cfg.vocab_size >= 2 ** 24:
            raise ValueError(f"vocab_size={cfg.vocab_size}: token ids travel as fp32 between ranks, need < 2^24")
        self.model, self.group = model, model.layout.tp_group
        self.device, self.dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
        self.vocab_start = model.lm_head.start
        self.limit = (None if vocab_size in (None, cfg.vocab_size)  # allowed ids in this slice
                      else max(0, min(model.lm_head.weight.shape[0], vocab_size - self.vocab_start)))
        self.max_rows, self.fixed_len, self.kv_cache_tokens = max_rows, max_len, kv_cache_tokens
        self.memory_fraction, self.max_prefill_tokens = gpu_memory_fraction, max_prefill_tokens
        self.sync_every, self.use_graphs = sync_every, use_cuda_graphs and self.device.type == "cuda"
        self.cache, self.graphs = None, {}  # the cache is sized at the first generate() when max_len is None
        self.stats = dict(prefill_forwards=0, prefill_tokens=0, decode_steps=0, syncs=0, compactions=0,
                          graphs_captured=0)
        if max_len is not None:
            self._allocate(max_len)

    # --- memory
    def _allocate(self, max_len: int, need: int | None = None) -> None:
        """A cache of rows of max_len positions; one of `need` (<= max_len) instead if that gives more rows."""
        cfg, m = self.model.cfg, self.model
        if cfg.sliding_window is not None and max_len > cfg.sliding_window:
            raise ValueError(f"max_len={max_len}{'' if need is None else ' (the longest prompt + max_new_tokens - 1)'} "
                             f"exceeds the model's sliding_window={cfg.sliding_window}; sliding-window attention is "
                             "not implemented")
        per_token = KVCache.bytes_per_token(cfg, len(m.layers), m.layout.tp, self.dtype)
        budget = self.kv_cache_tokens
        if budget is None and self.device.type == "cuda":
            free = torch.tensor(torch.cuda.mem_get_info(self.device)[0], device=self.device)
            all_reduce(free, self.group, dist.ReduceOp.MIN)  # every rank of the group must choose the same row count
            budget = int(free.item() * self.memory_fraction) // per_token
        elif budget is None:
            budget = self.max_rows * max_len
        if need and min(self.max_rows, budget // need) > min(self.max_rows, budget // max_len):
            max_len = need  # room to grow would cost rows
        if (rows := min(self.max_rows, budget // max_len)) < 1:
            raise ValueError(f"KV cache budget of {budget} tokens ({budget * per_token / 2**30:.2f} GiB at "
                             f"{per_token} bytes/token) cannot hold one row of {need or max_len} positions; raise "
                             "kv_cache_tokens / gpu_memory_fraction or shorten prompts / max_new_tokens")
        hkv = cfg.kv_heads_per_rank(m.layout.tp)
        self.cache = KVCache(len(m.layers), rows, hkv, max_len, cfg.head_dim, self.dtype, self.device)
        kw = dict(device=self.device)
        # the static state the decode graphs read and write
        self.tok, self.keys, self.ngen = (torch.zeros(rows, dtype=torch.long, **kw) for _ in range(3))
        self.lengths = torch.ones(rows, dtype=torch.int32, **kw)  # tokens in the row once `tok` is written
        self.out_tok = torch.zeros(rows, max_len + 1, dtype=torch.long, **kw)  # +1: a done row's scratch column
        self.out_lp = torch.zeros(rows, max_len + 1, dtype=torch.float32, **kw)
        self.stop_ids = torch.full((MAX_STOP_IDS,), -1, dtype=torch.long, **kw)
        self.done, self.max_new = torch.ones(rows, dtype=torch.bool, **kw), torch.ones(rows, dtype=torch.long, **kw)
        self.src, self.plen = torch.arange(rows, dtype=torch.int32, **kw), torch.zeros(rows, dtype=torch.int32, **kw)
        self.shared = None  # the host's copy of src[:B], plen[:B]
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.buckets = [1 << i for i in range(rows.bit_length()) if 1 << i < rows] + [rows] if self.use_graphs else None

    def free(self) -> None:
        """Release the KV cache, the static buffers and the CUDA graphs (and their memory pool)."""
        self.graphs.clear()  # a CUDAGraph frees its memory when it is dropped
        for name in ("cache", "tok", "lengths", "keys", "ngen", "done", "max_new", "out_tok", "out_lp", "stop_ids",
                     "src", "plen", "pool"):
            setattr(self, name, None)  # no gc.collect(): nothing here is in a cycle, and it took 0.25 s per step
        if self.device.type == "cuda":
            # graph capture re-creates cuBLAS workspaces (one per stream); drop them too, they come back on demand
            if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
                torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()

    # --- one decode step over rows 0..B-1 (captured in a CUDA graph on GPU)
    def _sample(self, logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor):
        temperature, top_k, top_p = self.mode  # baked into the decode graphs
        if top_p is not None:
            return sample_top_k_top_p(logits, keys, positions, temperature, top_k, top_p, self.group,
                                      self.vocab_start, self.limit)
        floor = top_k_floor(logits, top_k, self.group, self.limit) if top_k > 0 else None
        return sample_tokens(logits, keys, positions, temperature, self.group, self.vocab_start, self.limit, floor)

    def _decode_step(self, B: int, L: int) -> None:
        tok, lengths, ngen, done = self.tok[:B], self.lengths[:B], self.ngen[:B], self.done[:B]
        ctx = AttnContext(cache=self.cache, lengths=lengths, max_seqlen=L, prefix=(self.src[:B], self.plen[:B]))
        hidden = self.model(tok, lengths.long() - 1, ctx)
        nxt, lp = self._sample(self.model.logits(hidden), self.keys[:B], lengths.long())
        fused(_advance, nxt)(nxt, lp, self.out_tok[:B], self.out_lp[:B], tok, lengths, ngen, done, self.stop_ids,
                             self.max_new[:B], self.cache.max_len)

    def _step(self, B: int, L: int) -> None:
        if not self.use_graphs:
            return self._decode_step(B, L)
        key = (B, self.mode)  # L is the whole cache here
        if (graph := self.graphs.get(key)) is not None:
            return graph.replay()
        # this bucket's first step: run it for real, on a side stream as capture wants, then capture it
        side = _side_stream(self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._decode_step(B, L)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._decode_step(B, L)
        self.graphs[key] = graph
        self.stats["graphs_captured"] += 1

    def _prefill(self, chunk: list, prompts: list[list[int]], streams: list, max_new: list[int]) -> None:
        """Prefill chunk = [(prompt_index, sample_indices, rows)] in one packed forward; sample first tokens."""
        dev, lens = self.device, [len(prompts[p]) for p, _, _ in chunk]
        ids = torch.tensor([t for p, _, _ in chunk for t in prompts[p]], dtype=torch.long).to(dev)
        pos = torch.cat([torch.arange(n) for n in lens]).to(dev)
        cu = torch.tensor([0] + lens).cumsum(0).to(dtype=torch.int32, device=dev)
        slots = torch.repeat_interleave(torch.tensor([rows[0] for _, _, rows in chunk]), torch.tensor(lens)).to(dev)
        hidden = self.model(ids, pos, AttnContext(cu_seqlens=cu, max_seqlen=max(lens), cache=self.cache, slots=slots))
        logits = self.model.logits(hidden[cu[1:].long() - 1])  # [prompts, V/tp]
        if src := [rows[0] for _, _, rows in chunk for _ in rows[1:]]:
            dst = [r for _, _, rows in chunk for r in rows[1:]]
            self.cache.copy_rows(torch.tensor(src, device=dev), torch.tensor(dst, device=dev), max(lens))
        which = [i for i, (_, s, _) in enumerate(chunk) for _ in s]
        rows = torch.tensor([r for _, _, rs in chunk for r in rs], device=dev)
        plen = torch.tensor([lens[i] for i in which], device=dev)
        keys = torch.tensor([sample_key(*streams[p], j) for p, s, _ in chunk for j in s], device=dev)
        nxt, lp = self._sample(logits[torch.tensor(which, device=dev)], keys, plen)
        limit = torch.tensor([max_new[p] for p, s, _ in chunk for _ in s], device=dev)
        length = (plen + 1).clamp(max=self.cache.max_len)  # (a prompt filling its row: one new token, never fed)
        self.tok[rows], self.lengths[rows], self.keys[rows], self.max_new[rows] = nxt, length.int(), keys, limit
        self.out_tok[rows, 0], self.out_lp[rows, 0], self.ngen[rows] = nxt, lp, 1
        self.done[rows] = (nxt[:, None] == self.stop_ids).any(-1) | (limit <= 1)
        self.stats["prefill_forwards"] += 1
        self.stats["prefill_tokens"] += sum(lens)

    # --- the driver
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, eos_token_ids=(), progress: bool = False,
                 max_new_tokens: list[int] | None = None, seeds: list[int] | None = None) -> list[Completion]:
        """Sample params.n completions of every prompt, prompt-major (prompt 0's samples 0..n-1, then prompt 1, ...).
        `max_new_tokens` optionally overrides params.max_new_tokens per prompt. Prompt p's draws are keyed by
        (params.seed, p), or with per-request `seeds` by seeds[p] alone, independent of the rest of the batch."""
        params.check()
        if len(prompts) == 0:  # (not `not prompts`: a 2-D array of equal-length prompts is ambiguous)
            return []
        max_new = [params.max_new_tokens] * len(prompts) if max_new_tokens is None else max_new_tokens
        if not isinstance(max_new, (list, tuple)) or len(max_new) != len(prompts) or not all(
                isinstance(m, Integral) and m >= 1 for m in max_new):
            raise ValueError(f"max_new_tokens: expected {len(prompts)} ints >= 1 (one per prompt), "
                             f"got {max_new_tokens!r}")
        if seeds is not None and (not isinstance(seeds, (list, tuple)) or len(seeds) != len(prompts)
                                  or not all(isinstance(x, Integral) for x in seeds)):
            raise ValueError(f"seeds: expected {len(prompts)} ints (one per prompt), got {seeds!r}")
        streams = [(params.seed, p) for p in range(len(prompts))] if seeds is None else [(int(x), -1) for x in seeds]
        V = self.model.cfg.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: generation needs at least one prompt token")
            if bad := [t for t in p if not (isinstance(t, Integral) and 0 <= t < V)]:  # (numpy ints too; no floats)
                raise ValueError(f"prompt {i}: token id {bad[0]!r} is not an int in the model's vocabulary 0..{V - 1}")
            if self.fixed_len is not None and len(p) + max_new[i] - 1 > self.fixed_len:  # the last token is not fed
                raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new[i]} it needs "
                                 f"{len(p) + max_new[i] - 1} cache positions, the Generator's max_len={self.fixed_len}")
        stops = sorted({int(t) for t in params.stop_token_ids} |
                       (set() if params.ignore_eos else {int(t) for t in _as_tuple(eos_token_ids)}))
        if bad := [t for t in params.stop_token_ids if not 0 <= t < V]:
            raise ValueError(f"SamplingParams.stop_token_ids: id {bad[0]} is outside the model's vocabulary 0..{V - 1}")
        if len(stops) > MAX_STOP_IDS:
            raise ValueError(f"{len(stops)} stop/EOS token ids given; at most {MAX_STOP_IDS} are supported")
        need = max(len(p) + m - 1 for p, m in zip(prompts, max_new))
        if self.cache is None or (self.fixed_len is None and need > self.cache.max_len):
            if self.cache is not None:
                self.free()
            room = -(-need // 64) * 64  # room to grow, but not past a sliding window that `need` fits in
            self._allocate(self.fixed_len or max(need, min(room, self.model.cfg.sliding_window or room)),
                           None if self.fixed_len else need)
        greedy = params.temperature == 0
        self.mode = (float(params.temperature), 0 if greedy else max(params.top_k, 0),
                     None if greedy or params.top_p == 1 else float(params.top_p))
        self.stop_ids.copy_(torch.tensor(stops + [-1] * (MAX_STOP_IDS - len(stops))))
        self.done.fill_(True)
        self.lengths.fill_(1)
        n, R = params.n, self.cache.rows
        admitted, total = 0, len(prompts) * n  # samples are admitted prompt-major: (p, s) is number p * n + s
        owner: list = [None] * R  # row -> (prompt, sample, prompt length, tokens generated as of the last sync)
        results = [None] * total
        from tqdm import tqdm
        bar = tqdm(total=total, unit="seq", desc="generate", dynamic_ncols=True, disable=not progress)
        while True:
            # admit waiting samples into free rows, lowest rows first; prefill in token-budget chunks
            free = [r for r in range(R) if owner[r] is None]
            chunk, tokens = [], 0
            while admitted < total and free:
                p, s0 = divmod(admitted, n)
                k = min(n - s0, len(free))
                if chunk and tokens + len(prompts[p]) > self.max_prefill_tokens:
                    self._prefill(chunk, prompts, streams, max_new)
                    chunk, tokens = [], 0
                chunk.append((p, list(range(s0, s0 + k)), free[:k]))
                tokens += len(prompts[p])
                for s, r in zip(range(s0, s0 + k), free[:k]):
                    owner[r] = (p, s, len(prompts[p]), 1)
                free, admitted = free[k:], admitted + k
            if chunk:
                self._prefill(chunk, prompts, streams, max_new)
            if not (live := [r for r in range(R) if owner[r] is not None]):
                break
            if admitted == total:
                live = self._compact(live, owner)
            B = self._bucket(live[-1] + 1)
            steps = min(self.sync_every, max(max_new[owner[r][0]] - owner[r][3] for r in live))
            # every row stays below L through the window: live rows grow from prompt + generated
            L = max(owner[r][2] + owner[r][3] for r in live) + steps
            L = self.cache.max_len if self.use_graphs else min(self.cache.max_len, L)
            self._share_prompts(live, owner, B)
            for _ in range(steps):
                self._step(B, L)
            self.stats["decode_steps"] += steps
            self.stats["syncs"] += 1
            # the one host sync of the window: which rows are done, how many tokens each has
            done, ngen = torch.stack([self.done[:B].long(), self.ngen[:B]]).cpu().tolist()
            finished = [r for r in live if done[r]]
            for r in live:
                owner[r] = owner[r][:3] + (ngen[r],)
            if finished:
                idx = torch.tensor(finished, device=self.device)
                width = max(ngen[r] for r in finished)
                toks, lps = (buf[idx, :width].cpu().tolist() for buf in (self.out_tok, self.out_lp))
                for r, t, lp in zip(finished, toks, lps):
                    p, s, _, k = owner[r]
                    results[p * n + s] = Completion(p, s, t[:k], lp[:k], "stop" if t[k - 1] in stops else "length")
                    owner[r] = None
                self.lengths[idx] = 1  # idle rows: keep their attention short
                bar.update(len(finished))
        bar.close()
        return results

    def _bucket(self, rows: int) -> int:
        return rows if self.buckets is None else next(b for b in self.buckets if b >= rows)

    def _share_prompts(self, live: list[int], owner: list, B: int) -> None:
        """Point each live row's prompt positions at the lowest live row of its prompt (every live sample of a
        prompt holds its k/v there); rows done or idle read their own. Uploaded only when it changed."""
        src, plen, first = list(range(B)), [0] * B, {}
        for r in live:
            if (s := first.setdefault(owner[r][0], r)) != r:
                src[r], plen[r] = s, owner[r][2]
        if self.shared != (src, plen):
            self.src[:B], self.plen[:B] = torch.tensor(src), torch.tensor(plen)
            self.shared = (src, plen)

    def _compact(self, live: list[int], owner: list) -> list[int]:
        """The tail: move live rows to the front when that lets a smaller decode (graph) run."""
        if self._bucket(len(live)) >= self._bucket(live[-1] + 1):
            return live
        src = [r for r in live if r >= len(live)]
        dst = [r for r in range(len(live)) if owner[r] is None]
        s, d = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        self.cache.copy_rows(s, d, max(owner[r][2] + owner[r][3] for r in src))
        for buf in (self.tok, self.lengths, self.keys, self.ngen, self.done, self.max_new, self.out_tok, self.out_lp):
            buf[d] = buf[s]
        self.done[s], self.lengths[s] = True, 1
        for a, b in zip(src, dst):
            owner[b], owner[a] = owner[a], None
        self.stats["compactions"] += 1
        return list(range(len(live)))  # the holes below len(live) were exactly as many as the live rows above


def _advance(nxt, lp, out_tok, out_lp, tok, lengths, ngen, done, stop_ids, max_new, max_len: int) -> None:
    """Record a decode step's draws, advance the rows (fused on GPU); a done row writes past its tokens, uncounted."""
    out_tok.scatter_(1, ngen[:, None], nxt[:, None])
    out_lp.scatter_(1, ngen[:, None], lp[:, None])
    ngen.add_(~done)
    done.logical_or_((nxt[:, None] == stop_ids).any(-1) | (ngen >= max_new))
    tok.copy_(nxt)
    lengths.add_(1).clamp_(max=max_len)


@functools.cache
def _side_stream(device: torch.device):
    """One warm-up stream per device for the whole process: cuBLAS keeps a workspace per stream, so a
    fresh stream per Generator would leave a workspace behind after every free()."""
    return torch.cuda.Stream(device)


def _as_tuple(x) -> tuple:
    return () if x is None else (tuple(x) if isinstance(x, (list, tuple, set)) else (x,))


def eos_token_ids(model_dir: str, tokenizer) -> list[int]:
    """The ids that end a response: the tokenizer's EOS and the eos_token_id of config.json and generation_config.json
    (an instruct model lists all its ends there, as Qwen2.5-Instruct's <|im_end|> and <|endoftext|>; vLLM uses them)."""
    ids = set(_as_tuple(tokenizer.eos_token_id))
    for name in ("config.json", "generation_config.json"):
        if os.path.isfile(path := os.path.join(model_dir, name)):
            ids.update(_as_tuple(read_json(path).get("eos_token_id")))
    return sorted(ids)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Sample completions from a Hugging Face model directory.")
    ap.add_argument("model_dir")
    ap.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    args = ap.parse_args(argv)
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    try:  # before the Generator, whose row count comes from --n
        params.check()
    except ValueError as e:
        ap.error(str(e).replace("SamplingParams.", "--").replace("_", "-"))
    from data import load_tokenizer  # (a missing directory or tokenizer gets an error naming it)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    tok, texts = load_tokenizer(args.model_dir), args.prompt
    if args.chat and tok.chat_template is None:
        ap.error(f"--chat: the tokenizer in {args.model_dir} has no chat template")
    if args.chat:
        texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 for t in texts]
    prompts = [tok.encode(t, add_special_tokens=not args.chat) for t in texts]
    model = load_model(args.model_dir, dtype=dtype, device=device).eval()
    gen = Generator(model, max_rows=len(prompts) * args.n, vocab_size=min(len(tok), model.cfg.vocab_size))
    eos = eos_token_ids(args.model_dir, tok)
    t0 = time.perf_counter()
    try:
        comps = gen.generate(prompts, params, eos_token_ids=eos, progress=args.max_new_tokens * args.n > 512)
    except ValueError as e:  # an empty prompt, or one too long for a sliding window: a usage error
        ap.error(str(e))
    dt = time.perf_counter() - t0
    for c in comps:
        print(f"=== prompt {c.prompt_index} sample {c.sample_index} ({len(c.token_ids)} tokens, {c.finish_reason}, "
              f"mean logprob {sum(c.logprobs) / len(c.logprobs):.3f})")
        print(texts[c.prompt_index] + tok.decode(c.token_ids, skip_special_tokens=False))
    total = sum(len(c.token_ids) for c in comps)
    print(f"--- {total} tokens in {dt:.2f} s ({total / dt:.1f} tok/s) on {device}")


if __name__ == "__main__":
    main()
