"""model.py against transformers: logits, packing, gradients, errors."""
import json
import os
import tempfile

import pytest
import torch

import helpers
import model
from model import ModelConfig, load_model, rope_inv_freq

torch.manual_seed(0)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module", params=helpers.FAMILIES)
def ckpt(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return helpers.make_checkpoint(str(d), request.param, with_tokenizer=False)


def packed(seqs):
    lens = torch.tensor([len(s) for s in seqs])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    pos = torch.cat([torch.arange(n) for n in lens.tolist()])
    return torch.cat(seqs), pos, cu, int(lens.max())


def test_logits_match_transformers(ckpt):
    ref = helpers.hf_model(ckpt)
    ours = load_model(ckpt)
    ids = torch.randint(0, ref.config.vocab_size, (2, 37))
    with torch.no_grad():
        want = ref(ids).logits
        got = torch.stack([ours.logits(ours.packed(*packed([row]))) for row in ids])
    assert rel_err(got, want) <= 1e-5


def test_config_keys_read_as_transformers_reads_them(tmp_path):
    # Qwen2 keeps its q/k/v biases whatever attention_bias says: the logits still match transformers
    path = helpers.make_checkpoint(str(tmp_path / "q"), "qwen2", with_tokenizer=False)
    cfg = json.load(open(os.path.join(path, "config.json")))
    (tmp_path / "q" / "config.json").write_text(json.dumps({**cfg, "attention_bias": False}))
    ids, ours = torch.randint(0, cfg["vocab_size"], (1, 21)), load_model(path)
    with torch.no_grad():
        want, got = helpers.hf_model(path)(ids).logits[0], ours.logits(ours.packed(*packed([ids[0]])))
    assert rel_err(got, want) <= 1e-5
    mistral = {**cfg, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    assert ModelConfig.from_hf({**mistral, "sliding_window": 16, "use_sliding_window": False}).sliding_window == 16
    assert ModelConfig.from_hf({k: v for k, v in mistral.items() if k != "sliding_window"}).sliding_window == 4096
    assert ModelConfig.from_hf({**mistral, "sliding_window": None}).sliding_window is None
    # Qwen2 slides only with use_sliding_window, and then only the layers transformers' layer_types mark (from
    # max_window_layers on, 28 by default, unless the file lists them): a window only if some layer slides
    from transformers import Qwen2Config
    base, L, windows = {k: v for k, v in cfg.items() if k not in ("layer_types", "max_window_layers")}, 4, []
    for extra in ({}, {"use_sliding_window": True}, {"use_sliding_window": True, "max_window_layers": 2},
                  {"use_sliding_window": True, "max_window_layers": 2, "layer_types": ["full_attention"] * L},
                  {"use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"] * (L // 2)},
                  # the default max_window_layers (28) at its boundary: 28 layers none slide, 29 the last one does
                  {"use_sliding_window": True, "num_hidden_layers": 28},
                  {"use_sliding_window": True, "num_hidden_layers": 29}):
        hf = Qwen2Config.from_dict(c := {**base, "num_hidden_layers": L, "sliding_window": 16, **extra})
        windows.append(ModelConfig.from_hf(c).sliding_window)
        assert windows[-1] == (hf.sliding_window if "sliding_attention" in hf.layer_types else None), extra
    assert windows == [None, None, 16, None, 16, None, 16]
    # rope_scaling, when present, replaces rope_parameters (transformers 5), its theta too (no top-level one: 1e4)
    both = {**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert ModelConfig.from_hf(both).rope_theta == 5e5
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    got = ModelConfig.from_hf({**both, "rope_scaling": llama3})
    assert got.rope_scaling == llama3 and got.rope_theta == 1e4


def test_packed_equals_alone_and_left_padded(ckpt):
    model = load_model(ckpt)
    seqs = [torch.randint(0, 256, (n,)) for n in (5, 17, 11)]
    with torch.no_grad():
        pack = model.logits(model.packed(*packed(seqs))).log_softmax(-1)
        alone = [model.logits(model.packed(*packed([s]))).log_softmax(-1) for s in seqs]
        assert rel_err(pack, torch.cat(alone)) <= 1e-5
        # left-padded batch through transformers with correct position ids
        ref = helpers.hf_model(ckpt)
        L = 17
        ids = torch.stack([torch.cat([torch.zeros(L - len(s), dtype=torch.long), s]) for s in seqs])
        mask = torch.stack([torch.cat([torch.zeros(L - len(s)), torch.ones(len(s))]) for s in seqs]).long()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        hf = ref(ids, attention_mask=mask, position_ids=pos).logits.log_softmax(-1)
        hf = torch.cat([hf[i, L - len(s):] for i, s in enumerate(seqs)])
        assert rel_err(pack, hf) <= 1e-5


@pytest.mark.parametrize("family", ["qwen3", "llama3", "qwen2_tied"])
def test_gradients_match_transformers_and_checkpointing(family, tmp_path):
    path = helpers.make_checkpoint(str(tmp_path), family, with_tokenizer=False)
    ref = helpers.hf_model(path)
    ours = load_model(path)
    seqs = [torch.randint(0, 256, (n,)) for n in (9, 14)]
    seqs[1][[3, 8]] = 256  # the checkpoints' pad_token_id, mid-sequence: transformers' padding_idx row gets no grad
    ids, pos, cu, mx = packed(seqs)
    tgt = torch.roll(ids, -1)

    saved = []  # tensors autograd keeps for the backward, per loss_of call

    def loss_of(m):
        m.zero_grad()
        saved.append(0)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.__setitem__(-1, saved[-1] + 1) or t,
                                                      lambda t: t):
            loss = torch.nn.functional.cross_entropy(m.logits(m.packed(ids, pos, cu, mx)), tgt)
        loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    g1 = loss_of(ours)
    ours.gradient_checkpointing = True
    g2 = loss_of(ours)
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n
    # and checkpointing is applied: a checkpointed layer keeps only its inputs (packed by checkpoint's own hooks),
    # not its ~40 intermediates, so only the tensors outside the 4 layers remain (embedding, final norm, head, loss)
    assert saved[1] * 4 < saved[0], saved
    # transformers: the same loss over the same packed tokens, one sequence at a time
    ref.zero_grad()
    total = 0
    for s, t in zip(seqs, torch.split(tgt, [len(s) for s in seqs])):
        total = total + torch.nn.functional.cross_entropy(ref(s[None]).logits[0], t, reduction="sum")
    (total / len(ids)).backward()
    hf = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        want = torch.cat([hf[h].grad for h in ours.hf_names(n)], dim=p.tp_dim or 0)
        assert rel_err(g1[n], want) <= 1e-4, n


def test_bf16_loads_and_runs(tmp_path):
    path = helpers.make_checkpoint(str(tmp_path), "qwen2", with_tokenizer=False)
    m32, m16 = load_model(path), load_model(path, dtype=torch.bfloat16)
    x = packed([torch.randint(0, 256, (12,))])
    with torch.no_grad():
        a, b = m32.logits(m32.packed(*x)), m16.logits(m16.packed(*x))
    assert b.dtype == torch.bfloat16 == next(m16.parameters()).dtype  # consumers upcast inside their kernels
    assert rel_err(b.float(), a) < 0.05


def test_sharded_safetensors_index(tmp_path):
    path = helpers.make_checkpoint(str(tmp_path), "llama", with_tokenizer=False, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    ref = helpers.hf_model(path)
    ours = load_model(path)
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        assert rel_err(ours.logits(ours.packed(*packed([ids[0]]))), ref(ids).logits[0]) <= 1e-5


def test_random_init_is_seeded(tmp_path):
    path = helpers.make_checkpoint(str(tmp_path), "qwen3", with_tokenizer=False)
    a, b = load_model(path, random_init=True, seed=3), load_model(path, random_init=True, seed=3)
    c = load_model(path, random_init=True, seed=4)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q)
        if p.dim() > 1:
            assert not torch.equal(p, r), n
    # every matrix its own draw: 22 layers, where names like layers.12 and layers.21 are anagrams
    deep = load_model(helpers.make_checkpoint(str(tmp_path / "deep"), "qwen2", with_tokenizer=False,
                                              num_hidden_layers=22), random_init=True)
    firsts = {n: p.flatten()[:8].tolist() for n, p in deep.named_parameters() if p.dim() > 1}
    assert len({tuple(v) for v in firsts.values()}) == len(firsts)


def test_errors_name_the_problem(tmp_path):
    path = helpers.make_checkpoint(str(tmp_path / "ok"), "qwen2", with_tokenizer=False)
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(str(empty))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))
    cfg = json.load(open(os.path.join(path, "config.json")))
    bad = tmp_path / "arch"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        load_model(str(bad))
    wrong = tmp_path / "shape"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    os.symlink(os.path.join(path, "model.safetensors"), wrong / "model.safetensors")
    with pytest.raises(ValueError, match="gate_proj.*shape.*expected"):
        load_model(str(wrong))


def test_num_params_matches_transformers(ckpt):
    ref = helpers.hf_model(ckpt)
    cfg = ModelConfig.from_dir(ckpt)
    assert cfg.num_params() == sum(p.numel() for p in ref.parameters() if p.dim() == 2)  # matmul weights


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("hkv", [8, 2])  # MHA and GQA (without varlen_attn's enable_gqa, _FlashGQA calls aten itself)
def test_cuda_attention_backends_match_sdpa_forward_and_backward(hkv):
    lens, H, d = [37, 128, 5, 90], 8, 64
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
    q, k, v = (torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (H, hkv, hkv))
    dout = torch.randn(sum(lens), H, d, device="cuda", dtype=torch.bfloat16)
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = model.varlen_attention(*ref, cu, max(lens), "sdpa")
    want_grads = torch.autograd.grad(want, ref, dout.float())
    ran = 0
    for backend in ("flash", "varlen"):
        try:
            model.attention_backend(torch.device("cuda"), backend)
        except ValueError:
            continue
        got = model.varlen_attention(q, k, v, cu, max(lens), backend)
        grads = torch.autograd.grad(got, (q, k, v), dout)
        for a, b in zip((got, *grads), (want, *want_grads)):
            assert rel_err(a.float(), b) < 2e-2, backend
        ran += 1
    assert ran >= 1


def test_fp32_takes_sdpa_on_cuda():
    """The flash kernels refuse fp32 ("FlashAttention only support fp16 and bf16"): an fp32 model on a GPU (actor.dtype:
    fp32) attends with SDPA, and asking for a flash backend names the dtype."""
    cuda = torch.device("cuda")
    assert model.attention_backend(cuda, dtype=torch.float32) == "sdpa"
    with pytest.raises(ValueError, match="'varlen' is not available on cuda in torch.float32; available: \\['sdpa'\\]"):
        model.attention_backend(cuda, "varlen", dtype=torch.float32)
    if torch.cuda.is_available():  # the first forward of an fp32 run failed in the flash kernel before
        path = helpers.make_checkpoint(tempfile.mkdtemp(), "qwen2", with_tokenizer=False)
        ours, ids = load_model(path, dtype=torch.float32, device="cuda"), packed([torch.arange(9), torch.arange(5)])
        want = load_model(path).packed(*ids)
        got = ours.packed(*(t.cuda() if torch.is_tensor(t) else t for t in ids))
        assert ours.attn_backend == "sdpa" and rel_err(got.cpu(), want) < 1e-4


# ----------------------------------------------------------------------------- config formats, loading and init


def rewrite_config(path, edit):
    f = os.path.join(path, "config.json")
    c = json.load(open(f))
    edit(c)
    with open(f, "w") as fh:
        json.dump(c, fh)
    return c


def logits_match_transformers(path, n=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (1, n), generator=g)
    ours, ref = load_model(path), helpers.hf_model(path)
    with torch.no_grad():
        return rel_err(ours.logits(ours.packed(*packed([ids[0]]))), ref(ids).logits[0])


def test_llama3_rope_frequencies_match_transformers_in_all_three_bands():
    """Llama 3.1's real rope settings (d=128, theta 5e5, factor 8, 1/4, 8192) put frequencies in all three bands:
    kept (short wavelengths), divided by factor (long), and blended in between. The test checkpoints' llama3
    config has no frequency in the blended band, so the blend formula went unchecked."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = LlamaConfig(vocab_size=32, hidden_size=1024, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=8, num_key_value_heads=8, rope_scaling=rope)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)
    cfg = ModelConfig.from_hf({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    wavelen = 2 * torch.pi / base
    blended = (wavelen > 8192 / 4) & (wavelen < 8192 / 1)
    assert blended.sum() >= 3 and (wavelen < 8192 / 4).any() and (wavelen > 8192).any()  # all three bands
    got = rope_inv_freq(cfg)
    assert torch.equal(got, want), (got - want).abs().max()  # fp32 op for op: bit for bit


def test_rope_matches_transformers_bit_for_bit_and_over_2k_positions(tmp_path):
    """The frequencies were computed in fp64 and rounded: an ulp off transformers' fp32 ones for ~30% of them, which
    grew to 1.65e-5 of the logits at 2,048 positions (theta 1e6, d=128), past the 1e-5 parity bound."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    hf = Qwen3Config(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                     num_key_value_heads=1, head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    want, _ = Qwen3RotaryEmbedding.compute_default_rope_parameters(hf)
    assert torch.equal(rope_inv_freq(ModelConfig.from_hf({**hf.to_dict(), "architectures": ["Qwen3ForCausalLM"]})),
                       want)
    path = helpers.make_checkpoint(str(tmp_path), "qwen3", with_tokenizer=False, head_dim=128, num_attention_heads=1,
                                   num_key_value_heads=1, num_hidden_layers=2, max_position_embeddings=4096,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert logits_match_transformers(path, n=2048) <= 1e-5


def test_legacy_config_format_matches_transformers(tmp_path):
    """config.json as transformers 4 wrote it (Qwen2.5, Llama 3.1 on the Hub): a top-level rope_theta and a
    rope_scaling with the legacy "type" key, no rope_parameters. The helpers' checkpoints all use the transformers 5
    format, so reading the top-level theta / the "type" key went untested (ignoring them silently used theta 10000 /
    no llama3 scaling)."""
    for family, theta in (("qwen2", 1e6), ("llama3", None)):
        path = helpers.make_checkpoint(str(tmp_path / family), family, with_tokenizer=False)

        def legacy(c):
            rp = dict(c.pop("rope_parameters"))
            c["rope_theta"] = theta or rp["rope_theta"]
            del rp["rope_theta"]
            if rp.pop("rope_type") == "default":
                c["rope_scaling"] = None
            else:
                c["rope_scaling"] = {**rp, "type": "llama3"}  # the legacy spelling of rope_type
        rewrite_config(path, legacy)
        assert logits_match_transformers(path) <= 1e-5, family
    # a legacy-spelled unsupported type is rejected, not silently read as default rope
    c = json.load(open(os.path.join(path, "config.json")))
    with pytest.raises(ValueError, match="rope type 'linear' is not supported"):
        ModelConfig.from_hf({**c, "rope_scaling": {"type": "linear", "factor": 4.0}})


def test_missing_optional_keys_take_transformers_defaults(tmp_path):
    """A minimal config.json (no num_key_value_heads: MHA; no rope settings: theta 10000; no rms_norm_eps: 1e-6; no
    tie_word_embeddings: untied; no head_dim) reads as transformers reads it."""
    path = helpers.make_checkpoint(str(tmp_path), "llama", with_tokenizer=False, num_key_value_heads=4)
    keys = ("num_key_value_heads", "rope_parameters", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "head_dim")
    c = rewrite_config(path, lambda c: [c.pop(k, None) for k in keys])
    assert not set(keys) & set(c)
    assert logits_match_transformers(path) <= 1e-5


def test_defaults_and_rope_overrides_read_as_transformers_reads_them(tmp_path):
    """Where transformers' config classes differ: a missing num_key_value_heads is 8 for Mistral (32 for Qwen2/3), a
    missing head_dim 128 for Qwen3, a missing sliding_window 4096; rope_scaling replaces rope_parameters, theta
    included; Mistral ignores attention_bias and mlp_bias, Qwen3 mlp_bias; model_type, not architectures, decides;
    llama3 rope takes original_max_position_embeddings from the top level, or max_position_embeddings."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    for i, (family, kw, edit) in enumerate((
            ("mistral", dict(num_attention_heads=16, num_key_value_heads=8), lambda c: c.pop("num_key_value_heads")),
            ("qwen3", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128), lambda c: c.pop("head_dim")),
            ("llama", {}, lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                             rope_scaling={**llama3, "original_max_position_embeddings": 32})),
            ("mistral", {}, lambda c: c.update(attention_bias=True, mlp_bias=True)),
            ("qwen3", {}, lambda c: c.update(mlp_bias=True)),
            # llama3 without original_max_position_embeddings: max_position_embeddings; a top-level one wins
            ("llama", dict(max_position_embeddings=64), lambda c: c.update(rope_scaling=dict(llama3))),
            ("llama", {}, lambda c: c.update(rope_scaling={**llama3, "original_max_position_embeddings": 32},
                                             original_max_position_embeddings=64)),
            ("qwen2", {}, lambda c: c.update(architectures=["LlamaForCausalLM"])))):  # (last: c is used below)
        path = helpers.make_checkpoint(str(tmp_path / str(i)), family, with_tokenizer=False, **kw)
        c = rewrite_config(path, edit)
        assert logits_match_transformers(path) <= 1e-5, (i, family)
    from transformers import Qwen3Config
    c = {k: v for k, v in c.items() if k not in ("sliding_window", "layer_types")}
    c.update(use_sliding_window=True, max_window_layers=2)
    assert ModelConfig.from_hf(c).sliding_window == Qwen3Config.from_dict(c).sliding_window == 4096


def test_qwen2_accepts_attention_bias_true(tmp_path):
    """Qwen2's q/k/v biases are the only ones it has: attention_bias=true (some Qwen2 configs write it) must load,
    not be rejected like Llama's o_proj bias."""
    path = helpers.make_checkpoint(str(tmp_path), "qwen2", with_tokenizer=False)
    rewrite_config(path, lambda c: c.update(attention_bias=True))
    assert logits_match_transformers(path) <= 1e-5


def test_mlp_bias_is_rejected(tmp_path):
    """mlp_bias=true: the MLP here has no biases, so loading would silently drop the checkpoint's."""
    path = helpers.make_checkpoint(str(tmp_path), "llama", with_tokenizer=False)
    c = json.load(open(os.path.join(path, "config.json")))
    with pytest.raises(ValueError, match="mlp_bias=true is not supported"):
        ModelConfig.from_hf({**c, "mlp_bias": True})


# ----------------------------------------------------------------------------- model.py: loading and init


def test_multi_file_checkpoint_without_index(tmp_path):
    """Several *.safetensors files and no model.safetensors.index.json: every tensor is read from its own file."""
    from safetensors.torch import load_file, save_file
    path = helpers.make_checkpoint(str(tmp_path), "llama", with_tokenizer=False)
    ids = torch.randint(0, 256, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = helpers.hf_model(path)(ids).logits[0]  # (transformers itself needs the index for several files)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    names = sorted(tensors)
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({k: tensors[k] for k in part}, os.path.join(path, f"part-{i}.safetensors"), metadata={"format": "pt"})
    ours = load_model(path)
    with torch.no_grad():
        assert rel_err(ours.logits(ours.packed(*packed([ids[0]]))), want) <= 1e-5


def test_random_init_norms_are_ones_and_biases_zeros(tmp_path):
    """init_random: matrices drawn with std 0.02; RMSNorm weights 1 (as transformers initialises them), biases 0."""
    path = helpers.make_checkpoint(str(tmp_path), "qwen3", with_tokenizer=False)
    m = load_model(path, random_init=True, seed=1)
    q2 = load_model(helpers.make_checkpoint(str(tmp_path / "q2"), "qwen2", with_tokenizer=False), random_init=True)
    vecs = {n: p for mod in (m, q2) for n, p in mod.named_parameters() if p.dim() == 1}
    assert any("q_norm" in n for n in vecs) and any("bias" in n for n in vecs)
    for n, p in vecs.items():
        assert torch.equal(p, torch.full_like(p, 0.0 if n.endswith("bias") else 1.0)), n
    for n, p in m.named_parameters():
        if p.dim() > 1:
            assert abs(p.std().item() - 0.02) < 0.004, n


def test_value_head_starts_near_zero(tmp_path):
    """load_model(value_head=True): the critic's head is initialised small (weight std 1e-3, bias exactly 0), so
    the critic's first values are near zero; nn.Linear's default would leave a bias of up to 1/sqrt(64) = 0.125.
    For a checkpoint's weights and for random_init alike (the head is never in the checkpoint)."""
    path = helpers.make_checkpoint(str(tmp_path), "qwen2", with_tokenizer=False)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    for kw in (dict(), dict(random_init=True)):
        m = load_model(path, value_head=True, **kw)
        w, b = m.value_head.weight, m.value_head.bias
        assert w.shape == (1, 64) and torch.equal(b, torch.zeros(1)), kw
        assert 0.7e-3 < w.std().item() < 1.3e-3, kw  # 64 draws (seeded): the estimate's own sd is ~9%
        with torch.no_grad():
            v = m.values(m.packed(*packed([ids])))
        # final-normed hidden states have RMS ~1: values ~ N(0, (1e-3 * 8)^2), all 40 well inside 0.05 (6 sigma)
        assert v.shape == (40,) and v.abs().max().item() < 0.05, kw


def test_rms_norm_matches_transformers_bit_for_bit_in_bf16():
    """RMSNorm in bf16 normalises in fp32, casts to bf16, then scales by the bf16 weight, as transformers does:
    scaling in fp32 before the cast rounds differently. fp32 models cannot tell the orders apart, and the bf16 model
    test allows 5%: compare bit for bit with transformers' norm modules, and the q/k-norm path of rope_qkv (with a
    zero rotation, cos 1 and sin 0, which leaves its input exact) with Qwen3's."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 128, generator=g) * 3).bfloat16()
    w = (1 + torch.randn(128, generator=g) * 0.3).bfloat16()
    ref = LlamaRMSNorm(128, eps=1e-6).bfloat16()
    with torch.no_grad():
        ref.weight.copy_(w)
        want = ref(x)
    ours = model.RMSNorm(128, 1e-6, dtype=torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(w)
        got = ours(x)
    assert want.dtype == got.dtype == torch.bfloat16
    assert torch.equal(model.rms_norm(x, w, 1e-6), want) and torch.equal(got, want)
    # q/k norms: [T, h + 2 hkv, d] heads, q heads normed by wq, k heads by wk, v untouched
    T, h, hkv, d = 16, 4, 2, 32
    qkv = (torch.randn(T, h + 2 * hkv, d, generator=g) * 3).bfloat16()
    wq, wk = ((1 + torch.randn(d, generator=g) * 0.3).bfloat16() for _ in range(2))
    qn, kn = Qwen3RMSNorm(d, eps=1e-6).bfloat16(), Qwen3RMSNorm(d, eps=1e-6).bfloat16()
    with torch.no_grad():
        qn.weight.copy_(wq)
        kn.weight.copy_(wk)
        q, k, v = qkv.split([h, hkv, hkv], 1)
        want = torch.cat([qn(q), kn(k), v], 1)
    got = model.rope_qkv(qkv, torch.ones(T, d // 2), torch.zeros(T, d // 2), h, hkv, wq, wk, 1e-6)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_sequence_of_exactly_the_sliding_window_runs_and_matches_transformers(tmp_path):
    """A token attends to the `sliding_window` newest positions, itself included (transformers: q - k < window), so a
    sequence of exactly window tokens is plain causal attention and must run: in the packed path and in generation
    (prompt + max_new_tokens == window)."""
    W = 24
    path = helpers.make_checkpoint(str(tmp_path), "mistral", with_tokenizer=False, sliding_window=W)
    assert logits_match_transformers(path, n=W) <= 1e-5
    from rollout import Generator, SamplingParams
    ours, ref = load_model(path).eval(), helpers.hf_model(path)
    prompt = torch.randint(0, 256, (W - 6,), generator=torch.Generator().manual_seed(3)).tolist()
    got = Generator(ours, max_rows=1).generate([prompt], SamplingParams(temperature=0, max_new_tokens=6))
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, min_new_tokens=6,
                            eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, W - 6, dtype=torch.long))
    assert got[0].token_ids == want[0, len(prompt):].tolist()
