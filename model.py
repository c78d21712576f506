"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) built from tensor-parallel layers.

The architecture
----------------
Every model in this family is the same pre-norm decoder:

    h   = embed(tokens)
    for each layer:
        h = h + o_proj(attention(rope(q), rope(k), v))      q, k, v = qkv_proj(rmsnorm(h))
        h = h + down_proj(silu(gate) * up)                  gate, up = gate_up_proj(rmsnorm(h))
    logits = lm_head(rmsnorm(h))

The families differ only in switches read from the HF `config.json`: a bias on q/k/v (Qwen2), an RMSNorm on
each head of q and k (Qwen3), a head_dim that is not hidden/heads (Qwen3), grouped-query attention (each k/v
head shared by a group of q heads), the RoPE base and Llama-3 frequency rescaling, and a tied LM head.

RoPE rotates each (x_i, x_{i+d/2}) pair of a q or k head by the angle pos * theta^(-2i/d), so q.k depends only
on the distance between the two positions. Llama 3 stretches the context by dividing the low frequencies by `factor`.

Shapes and parallelism
----------------------
Tokens travel *packed*: a batch of sequences is one [T] vector with `cu_seqlens` marking the boundaries and
`position_ids` restarting at 0 for each sequence, so no compute is spent on padding. Attention is causal within
each sequence and blind across them. Three backends give the same numbers: `flash_attn` when installed,
PyTorch's `varlen_attn` on CUDA, and SDPA with a block-diagonal causal mask elsewhere.

With tensor parallelism a rank holds heads/tp of the heads and intermediate/tp of the MLP (see parallel.py);
with pipeline parallelism a contiguous slice of the layers, the embedding only on the first stage and the
final norm and head only on the last. Generation adds two paths against a static KV cache: `prefill` (packed
prompts, writing their k/v) and `decode` (one token per cache row, attending to the row's past)."""
from __future__ import annotations

import glob
import inspect
import json
import math
import os
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel import (ColumnParallelLinear, Layout, RowParallelLinear, VocabParallelEmbedding, _param, copy_to_tp,
                      fused, stage_layers, tp_rows)

MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
SUPPORTED = tuple(MODEL_TYPES.values())
HF_PIECES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# transformers' defaults for keys missing from config.json, where its config classes differ
ARCH_DEFAULTS = {"LlamaForCausalLM": dict(max_position_embeddings=2048),
                 "MistralForCausalLM": dict(num_key_value_heads=8, sliding_window=4096, max_position_embeddings=131072),
                 "Qwen2ForCausalLM": dict(num_key_value_heads=32, sliding_window=4096, max_position_embeddings=32768),
                 "Qwen3ForCausalLM": dict(num_key_value_heads=32, head_dim=128, sliding_window=4096,
                                          max_position_embeddings=32768)}


def read_json(path: str, kind: type = dict):
    """json.load that names the file when it is not valid JSON (a config or meta cut mid-write) or not a `kind`."""
    with open(path) as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if type(obj) is not kind:
        raise ValueError(f"{path}: expected a JSON {'object' if kind is dict else kind.__name__}, got {obj!r:.60}")
    return obj


def open_safetensors(path: str):
    """safe_open that names the file when it is truncated or corrupt."""
    from safetensors import SafetensorError, safe_open
    try:
        return safe_open(path, "pt")
    except SafetensorError as e:
        raise ValueError(f"{path}: truncated or corrupt safetensors file ({e})") from None

# ----------------------------------------------------------------------------- config


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    pad_token_id: int | None = None  # its embedding row gets no gradient from the lookup (nn.Embedding's padding_idx)
    architecture: str = "LlamaForCausalLM"
    raw: dict | None = None  # the config.json it came from (export writes it back)

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model directory {path!r} does not exist")
        if not os.path.isfile(f := os.path.join(path, "config.json")):
            raise FileNotFoundError(f"model directory {path!r} has no config.json")
        return cls.from_hf(read_json(f), source=f)

    @classmethod
    def from_hf(cls, c: dict, source: str = "config.json") -> "ModelConfig":
        # transformers' AutoModelForCausalLM builds the model_type's class, whatever architectures names
        if (mt := c.get("model_type")) not in MODEL_TYPES and (mt is not None or not c.get("architectures")):
            raise ValueError(f"{source}: model_type {mt!r} is not supported; supported: {sorted(MODEL_TYPES)}")
        if (arch := MODEL_TYPES[mt] if mt else c["architectures"][0]) not in SUPPORTED:
            raise ValueError(f"{source}: architecture {arch!r} is not supported; supported: {sorted(SUPPORTED)}")
        c = c if c.get("architectures") else {**c, "architectures": [arch]}  # (some configs name only the model_type)
        if missing := [k for k in REQUIRED_KEYS if k not in c]:
            raise ValueError(f"{source}: missing required key(s) {missing}")
        if bad := {k: c[k] for k in REQUIRED_KEYS if type(c[k]) is not int or c[k] < 1}:
            raise ValueError(f"{source}: {bad} must be positive integers")
        c = {**ARCH_DEFAULTS[arch], **c}
        if c.get("quantization_config"):
            raise ValueError(f"{source}: quantized checkpoints ({c['quantization_config'].get('quant_method')}) are "
                             "not supported; use the bf16/fp16/fp32 weights")
        if (act := c.get("hidden_act", "silu")) not in ("silu", "swish"):
            raise ValueError(f"{source}: hidden_act={act!r} is not supported; the MLP is SwiGLU (silu)")
        # transformers 5 writes rope settings as `rope_parameters`; older files use rope_theta + rope_scaling, and a
        # rope_scaling present replaces rope_parameters there too (its theta included: then the top-level one or 1e4)
        rope = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
        if nested := [k for k, v in rope.items() if isinstance(v, dict)]:
            raise ValueError(f"{source}: rope parameters per layer type ({nested}) are not supported")
        theta = rope.pop("rope_theta", c.get("rope_theta", 10000.0))
        if (rtype := rope.get("rope_type", rope.get("type", "default"))) not in ("default", "llama3"):
            raise ValueError(f"{source}: rope type {rtype!r} is not supported; supported: default, llama3")
        if rtype == "llama3":  # transformers': a top-level original_max_position_embeddings wins; none: the max
            rope["original_max_position_embeddings"] = c.get("original_max_position_embeddings", rope.get(
                "original_max_position_embeddings", c["max_position_embeddings"]))
            if missing := [k for k in LLAMA3_ROPE_KEYS if k not in rope]:
                raise ValueError(f"{source}: llama3 rope scaling lacks {missing} (needs {list(LLAMA3_ROPE_KEYS)})")
        # Llama and Qwen3 put attention_bias on o_proj as well, Llama mlp_bias on the MLP: neither is built here (the
        # other architectures ignore these keys, as transformers does)
        for key, archs in (("attention_bias", ("LlamaForCausalLM", "Qwen3ForCausalLM")),
                           ("mlp_bias", ("LlamaForCausalLM",))):
            if c.get(key) and arch in archs:
                raise ValueError(f"{source}: {key}=true is not supported for {arch} (only Qwen2's q/k/v biases are)")
        heads = c["num_attention_heads"]
        # Mistral always slides (4096 unless set, null: never); Qwen2/3 only with use_sliding_window, and then only
        # the layers from max_window_layers on (or as layer_types says): none of them, no window
        slides = c.get("layer_types") or ["sliding_attention" if i >= c.get("max_window_layers", 28) else
                                          "full_attention" for i in range(c["num_hidden_layers"])]
        sw = c.get("sliding_window") if arch == "MistralForCausalLM" else (
            c.get("sliding_window") if c.get("use_sliding_window") and "sliding_attention" in slides else None)
        return cls(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                   intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
                   num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads, rms_norm_eps=c.get("rms_norm_eps", 1e-6),
                   rope_theta=float(theta), rope_scaling=rope if rtype == "llama3" else None, sliding_window=sw,
                   attention_bias=arch == "Qwen2ForCausalLM",  # (Qwen2 has q/k/v biases whatever the key says)
                   qk_norm=arch == "Qwen3ForCausalLM", tie_word_embeddings=c.get("tie_word_embeddings", False),
                   max_position_embeddings=c["max_position_embeddings"], architecture=arch, raw=c,
                   pad_token_id=c.get("pad_token_id") if 0 <= (c.get("pad_token_id") or 0) < c["vocab_size"] else None)

    def num_params(self, with_embedding: bool = True) -> int:
        """Matrix parameters N (norms and biases are negligible); MFU uses N without the input embedding."""
        n = self.num_layers * self.layer_params + self.vocab_size * self.hidden_size  # LM head (tied: counted once)
        return n + (self.vocab_size * self.hidden_size if with_embedding and not self.tie_word_embeddings else 0)

    @property
    def layer_params(self) -> int:
        return self.hidden_size * (2 * self.head_dim * (self.num_heads + self.num_kv_heads)
                                   + 3 * self.intermediate_size)

    def kv_heads_per_rank(self, tp: int) -> int:  # 1 when tp > num_kv_heads: each held by tp / num_kv_heads ranks
        return self.num_kv_heads // min(tp, self.num_kv_heads)

    @property
    def head_cost(self) -> float:  # the LM head in layers' worth of matrix FLOPs, for parallel.stage_layers
        return self.vocab_size * self.hidden_size / self.layer_params

    def forward_flops(self, seq_lens: list[int], scored_tokens: float) -> float:
        """FLOPs of one forward pass over sequences of these lengths (a backward costs twice as much): 2 per matrix
        weight and token, the LM head only on the `scored_tokens` whose logits are used, plus causal attention,
        2 * layers * heads * head_dim * length^2 (QK^T and PV over half the square each)."""
        head, tokens = self.vocab_size * self.hidden_size, float(sum(seq_lens))
        return 2 * ((self.num_params(with_embedding=False) - head) * tokens + head * scored_tokens) \
            + 2 * self.num_layers * self.num_heads * self.head_dim * float(sum(s * s for s in seq_lens))


# ----------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps, self.weight = eps, _param((dim,), None, None, dtype, device, torch.ones)  # replicated over TP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused(rms_norm, x)(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # normalise in fp32 and cast back before the scale, as transformers does
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + y, its RMSNorm) in one kernel on GPU: the residual stream is read once for both."""
    s = x + y
    return s, rms_norm(s, weight, eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    # in fp32 op for op as transformers (fp64 moves ~30% of them by an ulp: 1.6e-5 of the logits at 2k positions)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
    if s := cfg.rope_scaling:  # Llama 3: scale long wavelengths by 1/factor, keep short ones, blend in between
        factor, lo, hi, old = (s[k] for k in LLAMA3_ROPE_KEYS)
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old / lo, inv / factor, torch.where(wavelen < old / hi, inv, blended))
    return inv


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, h: int, hkv: int,
             wq: torch.Tensor | None = None, wk: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """The fused projection's heads [T, h + 2 hkv, d] with q and k rotated (RMS-normed first when the model
    has q/k norms, weights wq/wk [d]) and v unchanged; cos/sin [T, d/2] fp32, the rotate-half convention of
    HF checkpoints. One tensor in, one out: on GPU a single kernel, and k, v stay adjacent for the cache."""
    head = torch.arange(qkv.shape[1], device=qkv.device)[:, None]
    rotated = head < h + hkv
    x = qkv if wq is None else torch.where(rotated, rms_norm(qkv, torch.where(head < h, wq, wk), eps), qkv)
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.where(rotated, torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype), x)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # SwiGLU's gate, from the fused gate_up projection
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------- attention backends


try:
    from flash_attn import flash_attn_varlen_func as FLASH_ATTN
except ImportError:
    FLASH_ATTN = None
try:
    from torch.nn.attention.varlen import varlen_attn as TORCH_VARLEN
    _VARLEN_PARAMS = inspect.signature(TORCH_VARLEN).parameters
    if "window_size" not in _VARLEN_PARAMS:  # its first versions took other arguments: SDPA serves there
        raise ImportError
except ImportError:
    TORCH_VARLEN, _VARLEN_PARAMS = None, {}


def attention_backend(device: torch.device, requested: str = "auto", dtype=torch.bfloat16) -> str:
    """'flash' (flash_attn), 'varlen' (torch varlen_attn, CUDA) or 'sdpa'; 'auto' takes the first available. The
    flash kernels take fp16 and bf16 only: an fp32 model (actor.dtype: fp32, for debugging) runs SDPA on GPU too."""
    flash = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    avail = [name for name, ok in (("flash", flash and FLASH_ATTN is not None),
                                   ("varlen", flash and TORCH_VARLEN is not None), ("sdpa", True)) if ok]
    if requested != "auto" and requested not in avail:
        raise ValueError(f"attention backend {requested!r} is not available on {device} in {dtype}; available: {avail}")
    return avail[0] if requested == "auto" else requested


def varlen_attention(q, k, v, cu_seqlens, max_seqlen: int, backend: str, window: int | None = None):
    """Causal attention inside each packed sequence. q [T, H, d], k/v [T, Hkv, d] -> [T, H, d]."""
    if window is not None and max_seqlen > window:
        raise ValueError(f"sequence of {max_seqlen} tokens exceeds the model's sliding_window={window}; "
                         "sliding-window attention is not implemented")
    scale = q.shape[-1] ** -0.5
    if backend == "flash":
        return FLASH_ATTN(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale, causal=True)
    if backend == "varlen":
        gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
        if gqa and "enable_gqa" not in _VARLEN_PARAMS:
            return _FlashGQA.apply(q, k, v, cu_seqlens, max_seqlen, scale)
        return TORCH_VARLEN(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, window_size=(-1, 0),
                            scale=scale, **gqa)
    # SDPA over the whole pack with a block-diagonal causal mask: O(T^2) memory, meant for CPU
    idx = torch.arange(q.shape[0], device=q.device)
    seq_id = torch.searchsorted(cu_seqlens[1:], idx.to(cu_seqlens.dtype), right=True)  # count of sequence ends <= idx
    mask = (seq_id[:, None] == seq_id[None, :]) & (idx[:, None] >= idx[None, :])
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, T, d]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)


class _FlashGQA(torch.autograd.Function):
    """A varlen_attn without `enable_gqa` (torch 2.11) wants as many k/v heads as q heads, but the aten flash kernels
    under it take grouped k/v in both passes: calling them directly skips repeating k/v (and summing its gradient),
    2-3% of a 0.5B step."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen: int, scale: float):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng, unused)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        grads = torch.ops.aten._flash_attention_backward(dout.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_seqlen,
                                                         ctx.max_seqlen, 0.0, True, rng, unused, scale=ctx.scale)
        return *grads, None, None, None


def decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, prefix=None):
    """One new token per cache row: q [B, H, d], its k_new, v_new [B, Hkv, d]; caches [B, Hkv, L, d]. Stores k_new,
    v_new at position lengths[b] - 1 of row b, which then attends to its first lengths[b] positions, the first plen[b]
    of them in row src[b] with prefix = (src, plen) [B] int32 (a prompt's samples share one copy). bf16 on CUDA: a
    split-K flash-decoding kernel that reads only those positions and does the store too (one launch less per layer).
    Elsewhere two batched matmuls over the (strided, not copied) rows with a length mask. No host sync."""
    if TRITON and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        return _flash_decode(q, k_new, v_new, k_cache, v_cache, lengths, prefix)
    (B, H, d), (hkv, L) = q.shape, k_cache.shape[1:3]
    rows, last = torch.arange(B, device=q.device), lengths.long() - 1
    k_cache[rows, :, last], v_cache[rows, :, last] = k_new, v_new
    if prefix is not None:
        shared = (torch.arange(L, device=q.device)[None, :] < prefix[1][:, None])[:, None, :, None]
        k_cache, v_cache = (torch.where(shared, c[prefix[0].long()], c) for c in (k_cache, v_cache))
    scores = torch.matmul(q.view(B, hkv, H // hkv, d), k_cache.transpose(-1, -2)).float() * d ** -0.5  # [B, hkv, g, L]
    scores = scores.masked_fill(torch.arange(L, device=q.device) >= lengths[:, None, None, None], float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v_cache.dtype), v_cache).reshape(B, H, d)  # [B, hkv, g, d] -> [B, H, d]


try:
    import triton
    import triton.language as tl
    TRITON = True
except ImportError:
    TRITON = False

if TRITON:
    @triton.jit
    def _flash_decode_split(Q, Kn, Vn, K, V, Lens, Src, Plen, Mo, Lo, Ao, O, scale, sq_b, sq_h, sn_b, sn_h, sk_b,
                            sk_h, sk_l, sv_b, sv_h, sv_l, so_b, so_h, G: tl.constexpr, D: tl.constexpr,
                            GP: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, DIRECT: tl.constexpr,
                            PREFIX: tl.constexpr):
        """Program (row b, kv head h, split s): the G query heads of h against the s-th of S equal, BLOCK-aligned parts
        of row b's keys; writes the part's running max, sum and unnormalised output (DIRECT, one part per row: the
        normalised output). The parts follow the row's length, read at run time, so one CUDA graph serves every length.
        The part holding the new position n - 1 first stores the new k, v there; a barrier makes them visible to all
        loads. PREFIX: positions below Plen[b] come from row Src[b], which sibling rows read at once (L2 hits)."""
        b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        row = b.to(tl.int64)  # a long cache's row offsets pass 2^31 elements
        n = tl.load(Lens + b)
        src, plen = row, n * 0
        if PREFIX:
            src, plen = tl.load(Src + b).to(tl.int64), tl.load(Plen + b)
        split = tl.cdiv(tl.cdiv(n, tl.num_programs(2)), BLOCK) * BLOCK
        gi, di = tl.arange(0, GP), tl.arange(0, DP)
        rows = (gi[:, None] < G) & (di[None, :] < D)
        q = tl.load(Q + b * sq_b + (h * G + gi)[:, None] * sq_h + di[None, :], mask=rows, other=0.0)
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        end = tl.minimum((s + 1) * split, n)
        if (s * split < n) & (n <= end):
            o = b * sn_b + h * sn_h + di
            tl.store(K + row * sk_b + h * sk_h + (n - 1) * sk_l + di, tl.load(Kn + o, mask=di < D), mask=di < D)
            tl.store(V + row * sv_b + h * sv_h + (n - 1) * sv_l + di, tl.load(Vn + o, mask=di < D), mask=di < D)
        tl.debug_barrier()
        for n0 in range(s * split, end, BLOCK):
            ni = n0 + tl.arange(0, BLOCK)
            ok = (ni[:, None] < end) & (di[None, :] < D)
            r = tl.where(ni < plen, src, row)[:, None]
            k = tl.load(K + r * sk_b + h * sk_h + ni[:, None] * sk_l + di[None, :], mask=ok, other=0.0)
            v = tl.load(V + r * sv_b + h * sv_h + ni[:, None] * sv_l + di[None, :], mask=ok, other=0.0)
            sc = tl.where((ni < end)[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        if DIRECT:  # the whole row in one part (every row has >= 1 key): no merge pass
            tl.store(O + b * so_b + (h * G + gi)[:, None] * so_h + di[None, :],
                     (acc / l[:, None]).to(O.dtype.element_ty), mask=rows)
        else:
            out = (b * tl.num_programs(1) + h) * tl.num_programs(2) + s
            tl.store(Mo + out * GP + gi, m, mask=gi < G)
            tl.store(Lo + out * GP + gi, l, mask=gi < G)
            tl.store(Ao + (out * GP + gi)[:, None] * DP + di[None, :], acc, mask=rows)

    @triton.jit
    def _flash_decode_merge(Mo, Lo, Ao, O, so_b, so_h, S: tl.constexpr, SP: tl.constexpr, G: tl.constexpr,
                            D: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr):
        """Program (row b, kv head h): merge the splits by their maxima (empty splits weigh 0)."""
        b, h = tl.program_id(0), tl.program_id(1)
        si, gi, di = tl.arange(0, SP), tl.arange(0, GP), tl.arange(0, DP)
        base = (b * tl.num_programs(1) + h) * S
        ok = (si < S)[:, None] & (gi < G)[None, :]
        m = tl.load(Mo + (base + si)[:, None] * GP + gi[None, :], mask=ok, other=float("-inf"))
        w = tl.exp(m - tl.max(m, 0)[None, :])
        l = tl.load(Lo + (base + si)[:, None] * GP + gi[None, :], mask=ok, other=0.0)
        a = tl.load(Ao + ((base + si)[:, None, None] * GP + gi[None, :, None]) * DP + di[None, None, :],
                    mask=ok[:, :, None] & (di < D)[None, None, :], other=0.0)
        o = tl.sum(a * w[:, :, None], 0) / tl.sum(l * w, 0)[:, None]
        tl.store(O + b * so_b + (h * G + gi)[:, None] * so_h + di[None, :], o.to(O.dtype.element_ty),
                 mask=(gi[:, None] < G) & (di[None, :] < D))


def _flash_decode(q, k_new, v_new, k_cache, v_cache, lengths, prefix=None, block: int | None = None,
                  warps: int = 4, stages: int = 2, split_factor: int = 2):
    """Split-K flash decoding: each row's keys in enough parts (S) that B * Hkv * S programs fill the GPU
    split_factor times; a large batch fills it with one part per row and needs no merge (22% faster at B=256).
    Blocks of 8192 / d keys (16 KB of k). Defaults: the fastest of benchmarks/bench_decode_attn.py on H200."""
    (B, H, d), (hkv, L) = q.shape, k_cache.shape[1:3]
    G, GP, DP = H // hkv, max(16, triton.next_power_of_2(H // hkv)), max(16, triton.next_power_of_2(d))
    block = block or 8192 // DP
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    S = max(1, min(triton.cdiv(L, block), triton.cdiv(split_factor * sms, B * hkv)))
    mo, lo = (torch.empty(B, hkv, S, GP, dtype=torch.float32, device=q.device) for _ in range(2))
    ao = torch.empty(B, hkv, S, GP, DP, dtype=torch.float32, device=q.device) if S > 1 else mo
    out = torch.empty_like(q)
    assert k_new.stride() == v_new.stride(), "k_new and v_new share strides (views of one qkv tensor)"
    src, plen = prefix if prefix is not None else (lengths, lengths)  # not read without PREFIX
    _flash_decode_split[(B, hkv, S)](q, k_new, v_new, k_cache, v_cache, lengths, src, plen, mo, lo, ao, out,
                                     d ** -0.5, *q.stride()[:2], *k_new.stride()[:2], *k_cache.stride()[:3],
                                     *v_cache.stride()[:3], *out.stride()[:2], G=G, D=d, GP=GP, DP=DP, BLOCK=block,
                                     DIRECT=S == 1, PREFIX=prefix is not None, num_warps=warps, num_stages=stages)
    if S > 1:
        _flash_decode_merge[(B, hkv)](mo, lo, ao, out, out.stride(0), out.stride(1), S=S,
                                      SP=triton.next_power_of_2(S), G=G, D=d, GP=GP, DP=DP)
    return out


@dataclass
class AttnContext:
    """How the tokens of one forward are arranged and where (if anywhere) their k/v go.

    train / log-probs: cu_seqlens + max_seqlen.  prefill: also `cache` and each token's cache row `slots` (positions
    from position_ids).  decode: `cache`, `lengths` and `prefix` as in decode_attention (one token per cache row 0..B-1,
    at position lengths-1), and max_seqlen >= max(lengths) to read only that many positions of each row (0: all)."""

    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    cache: "KVCache | None" = None
    slots: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    prefix: tuple | None = None
    positions: torch.Tensor | None = None  # set by Transformer.forward
    backend: str = "sdpa"


class KVCache:
    """One static buffer kv [layers, rows, 2, Hkv_local, max_len, d] (k then v): row b holds one sequence; a prefill's
    k and v go in with one indexed write, a decode step's inside decode_attention. k, v: views without the 2 axis."""

    def __init__(self, num_layers: int, rows: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        self.kv = torch.zeros(num_layers, rows, 2, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.k, self.v = self.kv[:, :, 0], self.kv[:, :, 1]
        self.rows, self.max_len = rows, max_len

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Share a prefilled prompt: copy the first `length` positions of rows src into rows dst."""
        self.kv[:, dst, :, :, :length] = self.kv[:, src, :, :, :length]

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, num_layers: int, tp: int, dtype) -> int:
        return 2 * num_layers * cfg.kv_heads_per_rank(tp) * cfg.head_dim * torch.finfo(dtype).bits // 8


# ----------------------------------------------------------------------------- the decoder


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: Layout, layer_idx: int, dtype=None, device=None):
        super().__init__()
        tp, hd = layout.tp, cfg.head_dim
        self.layer_idx = layer_idx  # index inside this stage (the KV cache's layer axis)
        self.h, self.hkv, self.hd = cfg.num_heads // tp, cfg.kv_heads_per_rank(tp), hd
        self.window, qkv = cfg.sliding_window, [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd]
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, sum(qkv), cfg.attention_bias, layout, qkv, dtype, device,
                                             unit=hd)
        self.o_proj = RowParallelLinear(cfg.num_heads * hd, cfg.hidden_size, False, layout, dtype, device)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        if cfg.qk_norm:  # shared across heads while each TP rank sees only its heads: the grads are partial sums
            self.q_norm.weight.tp_partial_grad = self.k_norm.weight.tp_partial_grad = True

    def forward(self, x, cos, sin, ctx: AttnContext):
        T = x.shape[0]
        qkv = self.qkv_proj(x).view(T, self.h + 2 * self.hkv, self.hd)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm is not None else ()
        qkv = fused(rope_qkv, qkv)(qkv, cos, sin, self.h, self.hkv, *norms)
        q, k, v = qkv.split([self.h, self.hkv, self.hkv], dim=1)
        c, i = ctx.cache, self.layer_idx
        if ctx.lengths is not None:  # decode: token b is the next token of cache row b (stored by the attention)
            L = ctx.max_seqlen or c.max_len  # attend over the first L positions only (L >= every length)
            o = decode_attention(q, k, v, c.k[i, :T, :, :L], c.v[i, :T, :, :L], ctx.lengths, ctx.prefix)
        else:
            if c is not None:  # prefill: the prompts' k/v into their cache rows `slots`, at their positions
                c.kv[i, ctx.slots, :, :, ctx.positions] = qkv[:, self.h:].view(T, 2, self.hkv, self.hd)
            o = varlen_attention(q, k, v, ctx.cu_seqlens, ctx.max_seqlen, ctx.backend, self.window)
        return self.o_proj(o.reshape(T, self.h * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: Layout, dtype=None, device=None):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * i, False, layout, [i, i], dtype, device)
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, False, layout, dtype, device)

    def forward(self, x):
        return self.down_proj(fused(silu_mul, x)(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: Layout, layer_idx: int, dtype=None, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, layout, layer_idx, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, layout, dtype, device)

    def forward(self, x, cos, sin, ctx: AttnContext):
        a, ln = self.self_attn(self.input_layernorm(x), cos, sin, ctx), self.post_attention_layernorm
        x, h = fused(add_rms_norm, x)(x, a, ln.weight, ln.eps)
        return x + self.mlp(h)


class Transformer(nn.Module):
    """One pipeline stage of the decoder, tensor-parallel over `layout.tp_group`.

    forward() maps token ids (first stage) or hidden states [T, D] (the others) to hidden states, final-normed on
    the last stage, where `logits()` / `values()` give vocab-parallel logits [T, V/tp] or fp32 values [T]."""

    def __init__(self, cfg: ModelConfig, layout: Layout | None = None, dtype=torch.float32, device=None,
                 value_head: bool = False, lm_head: bool = True):
        super().__init__()
        layout = layout or Layout()
        start, end = stage_layers(cfg.num_layers, layout.pp, layout.pp_rank, cfg.head_cost if lm_head else 0.0)
        self.cfg, self.layout, self.layer_start = cfg, layout, start
        kw = dict(dtype=dtype, device=device)
        first, last = layout.is_first_stage, layout.is_last_stage
        embedding = lambda: VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, layout, **kw,  # noqa: E731
                                                   padding_idx=cfg.pad_token_id)
        self.embed_tokens = embedding() if first else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, layout, i, **kw) for i in range(end - start))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw) if last else None
        tied = cfg.tie_word_embeddings and first  # tied on one stage: the same Parameter, counted once, updated once
        self.lm_head = (self.embed_tokens if tied else embedding()) if last and lm_head else None
        self.value_head = nn.Linear(cfg.hidden_size, 1, **kw) if (last and value_head) else None
        for p in self.value_head.parameters() if self.value_head is not None else ():
            p.tp_dim, p.tp_parts, p.tp_unit = None, None, 1
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)
        self.gradient_checkpointing, self.attn_backend = False, attention_backend(torch.device(device or "cpu"),
                                                                                  dtype=dtype)

    # --- forward passes
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        ctx.positions, ctx.backend = position_ids, self.attn_backend
        freqs = position_ids.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        ckpt = self.gradient_checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            x = checkpoint(layer, x, cos, sin, ctx, use_reentrant=False) if ckpt else layer(x, cos, sin, ctx)
        return self.norm(x) if self.norm is not None else x

    def packed(self, x, position_ids, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        """Training and log-prob path: packed sequences, no cache."""
        return self(x, position_ids, AttnContext(cu_seqlens=cu_seqlens, max_seqlen=int(max_seqlen)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits, in the compute dtype: on GPU every consumer (log-probs,
        sampling) upcasts row by row inside its fused kernel, so no fp32 [T, V] copy is made (CPU runs them eagerly)."""
        # copy_to_tp: each rank's logits slice sees all of `hidden`, so its gradient is summed over TP
        return F.linear(copy_to_tp(hidden, self.layout.tp_group), self.lm_head.weight)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.value_head(hidden).squeeze(-1).float()

    # --- construction
    def hf_names(self, name: str) -> list[str]:
        """The HF checkpoint tensor(s) behind one of our parameters (fused ones map to several)."""
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            pre = f"model.layers.{self.layer_start + int(i)}."
            mod, _, kind = rest.rpartition(".")  # e.g. "self_attn.qkv_proj", "weight"
            parent, _, proj = mod.rpartition(".")
            return [f"{pre}{parent}.{p}.{kind}" for p in HF_PIECES[proj]] if proj in HF_PIECES else [pre + rest]
        if name.startswith("lm_head."):
            return ["model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"]
        if name.startswith("value_head."):
            return [name]  # critic-only: not in an HF causal-LM checkpoint
        return ["model." + name]

    def _fill(self, params, full_tensor) -> None:
        """Copy into each (name, p) of `params` this rank's slice of its HF tensor(s).
        full_tensor(name, j, hf, shape) returns piece j (a tensor, or a lazy safetensors slice) in full."""
        t, r = self.layout.tp, self.layout.tp_rank
        for name, p in params:
            pieces, d = [], p.tp_dim
            for j, hf in enumerate(self.hf_names(name)):  # piece j in full; this rank reads its rows along d
                shape = [p.tp_parts[j] if k == d else size for k, size in enumerate(p.shape)]
                full = full_tensor(name, j, hf, shape)
                if d is not None:
                    full = full[(slice(None),) * d + (tp_rows(shape[d], t, r, p.tp_unit),)]
                pieces.append(full[:])
            with torch.no_grad():
                p.copy_(torch.cat(pieces, dim=d or 0))

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Layout-independent seeded weights: each full tensor has its own generator and is sliced like a checkpoint."""
        def draw(name, j, hf, shape):
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(hf.encode()) * 7919 + j)
            return torch.randn(shape, generator=g) * std if len(shape) > 1 else torch.full(shape, float("norm" in hf))
        self._fill(self.named_parameters(), draw)

    def load_hf(self, path: str) -> None:
        """Read this rank's slices straight from the safetensors files (never the whole model)."""
        if os.path.isfile(index := os.path.join(path, "model.safetensors.index.json")):
            if not isinstance(weight_map := read_json(index).get("weight_map"), dict):
                raise ValueError(f"{index}: no 'weight_map' (tensor name -> file)")
            where = {k: os.path.join(path, v) for k, v in weight_map.items()}
        else:
            if not (files := sorted(glob.glob(os.path.join(path, "*.safetensors")))):
                raise FileNotFoundError(f"model directory {path!r} has no *.safetensors weights "
                                        "(nor model.safetensors.index.json)")
            where = {}
            for fn in files:  # (transformers would read model.safetensors alone: a second copy must not win)
                for k in open_safetensors(fn).keys():
                    if k in where:
                        raise ValueError(f"{path}: tensor {k!r} is in both {os.path.basename(where[k])} and "
                                         f"{os.path.basename(fn)}; keep one, or add a model.safetensors.index.json")
                    where[k] = fn
        handles = {fn: open_safetensors(fn) for fn in sorted(set(where.values()))}
        held = {fn: set(h.keys()) for fn, h in handles.items()}  # (keys() builds a list each call)

        def read(name, j, hf, want):
            if hf not in where:
                raise KeyError(f"{path}: tensor {hf!r} (for {name}) is not in the checkpoint")
            if hf not in held[where[hf]]:  # a hand-edited or merged index
                raise KeyError(f"{index}: maps {hf!r} to {os.path.basename(where[hf])}, which does not hold it")
            sl = handles[where[hf]].get_slice(hf)
            if list(sl.get_shape()) != want:
                raise ValueError(f"{where[hf]}: tensor {hf!r} has shape {sl.get_shape()}, expected {want} "
                                 "from config.json")
            return sl
        # a value head is a fresh critic head, not in the checkpoint; load_model initialises it
        self._fill([(n, p) for n, p in self.named_parameters() if not n.startswith("value_head.")], read)
        if self.cfg.tie_word_embeddings and "lm_head.weight" in where and self.lm_head is not None:
            w = self.lm_head.weight  # this rank's rows of the embedding: the stored head's same rows must equal them
            stored = read("lm_head.weight", 0, "lm_head.weight", [w.tp_parts[0], *w.shape[1:]])
            if not torch.equal(stored[tp_rows(w.tp_parts[0], self.layout.tp, self.layout.tp_rank)].to(w), w):
                # transformers would untie them: not the model config.json describes
                raise ValueError(f"{path}: config.json has tie_word_embeddings=true, but the checkpoint's "
                                 "lm_head.weight differs from model.embed_tokens.weight; set it to false to load both")


def load_model(path: str, layout: Layout | None = None, dtype=torch.float32, device=None, random_init: bool = False,
               seed: int = 0, value_head: bool = False, lm_head: bool = True) -> Transformer:
    """Build this rank's stage of the model in `path` and fill it (checkpoint weights, or seeded random)."""
    cfg = ModelConfig.from_dir(path)
    model = Transformer(cfg, layout, dtype=dtype, device=device, value_head=value_head, lm_head=lm_head)
    model.init_random(seed) if random_init else model.load_hf(path)
    if model.value_head is not None:
        with torch.no_grad():  # small init so the critic starts near zero
            g = torch.Generator().manual_seed(seed + 17)
            model.value_head.weight.copy_(torch.randn(model.value_head.weight.shape, generator=g) * 1e-3)
            model.value_head.bias.zero_()
    return model
