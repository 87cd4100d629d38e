"""Tests of `laplace.attention`: the Laplacian head V - P V against ground truths.

The fused (SDPA) path is checked against the reference path that forms P explicitly, forward
and gradients, in float64 so tolerances can be tight; the reference path is in turn checked
against attention written out by hand, against explicit (I - P) V inside any timm ViT, and against
a closed form (uniform P gives V minus the running mean of V). The KV cache must reproduce the
full causal forward token by token.
"""
import math
from functools import partial

import pytest
import timm
import torch
import torch.nn as nn

import laplace
from laplace.attention import LaplacianAttention, RMSNorm
from laplace.gpt import GPT, KVCache
from laplace.vit import vit
from conftest import randomize_

DIM, HEADS = 32, 4
HEAD_DIM = DIM // HEADS

# The configurations the models use: ViT (qkv bias, no QK-norm), the first author's ViT (timm's
# QK-norm: a LayerNorm with weights over each head's q and k) and GPT (parameter-free QK-norm, rotary).
CONFIGS = {
    "vit": dict(qkv_bias=True, proj_bias=True, qk_norm=False),
    "vit_qk": dict(qkv_bias=True, proj_bias=True, qk_norm=True, norm_layer=partial(nn.LayerNorm, eps=1e-6)),
    "gpt": dict(qkv_bias=False, proj_bias=False, qk_norm=True, norm_layer=RMSNorm),
}


def Attention(dim, heads, k=0, mode="fixed", fused=True, **kwargs):
    """A LaplacianAttention with k and the fused / reference path chosen (timm's `fused_attn`)."""
    attn = LaplacianAttention(dim, heads, num_laplacian_heads=k, laplacian_mode=mode, **kwargs)
    attn.fused_attn = fused
    return attn


def rope_table(start: int, n: int, head_dim: int = HEAD_DIM, dtype=torch.float64):
    """(cos, sin) for positions start..start+n, as the GPT builds them."""
    half = head_dim // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
    freqs = torch.outer(torch.arange(start, start + n, dtype=torch.float64), inv_freq)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def make_pair(k: int, mode: str = "fixed", config: str = "vit", seed: int = 0):
    """A fused and a reference Attention in float64 holding the same random weights."""
    torch.manual_seed(seed)
    fused = Attention(DIM, HEADS, k, mode, fused=True, **CONFIGS[config]).double()
    with torch.no_grad():  # QK-norm weights away from LayerNorm's identity init
        for name, p in fused.named_parameters():
            if "_norm." in name:
                p.add_(0.3 * torch.randn_like(p))
    if mode == "learned":
        # Spread the gates so every head mixes P V and V - P V and their gradients are not tiny.
        with torch.no_grad():
            fused.laplacian_gate.copy_(torch.randn(HEADS, dtype=torch.float64))
    ref = Attention(DIM, HEADS, k, mode, fused=False, **CONFIGS[config]).double()
    ref.load_state_dict(fused.state_dict())
    return fused, ref


def forward_and_grads(module, x, causal, rope, w):
    """Output and gradients w.r.t. the input and every parameter of a fixed linear loss."""
    x = x.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = module(x, is_causal=causal, rope=rope)
    (out * w).sum().backward()
    grads = {"input": x.grad}
    grads.update({n: p.grad for n, p in module.named_parameters()})
    return out.detach(), grads


@pytest.mark.cuda
@pytest.mark.parametrize("config", ["vit", "vit_qk", "gpt"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("k,mode", [(0, "fixed"), (1, "fixed"), (3, "fixed"), (HEADS, "fixed"),
                                    (2, "learned")])
def test_fused_matches_reference_forward_and_grads(config, causal, k, mode, device):
    fused, ref = (m.to(device) for m in make_pair(k, mode, config))
    torch.manual_seed(1)
    B, N = 2, 7
    x = torch.randn(B, N, DIM, dtype=torch.float64).to(device)
    w = torch.randn(B, N, DIM, dtype=torch.float64).to(device)
    rope = tuple(t.to(device) for t in rope_table(0, N)) if config == "gpt" else None
    out_f, g_f = forward_and_grads(fused, x, causal, rope, w)
    out_r, g_r = forward_and_grads(ref, x, causal, rope, w)
    torch.testing.assert_close(out_f, out_r, rtol=1e-10, atol=1e-12)
    assert g_f.keys() == g_r.keys()
    expected_params = {"qkv.weight", "proj.weight"} | ({"laplacian_gate"} if mode == "learned" else set())
    assert expected_params <= g_f.keys()
    for name in g_f:
        assert g_f[name] is not None and g_f[name].abs().sum() > 0, name
        torch.testing.assert_close(g_f[name], g_r[name], rtol=1e-9, atol=1e-11, msg=name)


def test_laplacian_heads_change_the_output():
    """Guard for the tests above: k = 0 and k = all must differ, else they prove little."""
    fused0, _ = make_pair(0)
    fused_all = Attention(DIM, HEADS, HEADS, qkv_bias=True).double()
    fused_all.load_state_dict(fused0.state_dict())
    x = torch.randn(2, 5, DIM, dtype=torch.float64)
    assert not torch.allclose(fused0(x), fused_all(x))


@pytest.mark.parametrize("causal", [False, True])
def test_k0_is_plain_softmax_attention(causal):
    """k = 0 is textbook attention: softmax(q k^T / sqrt(d)) v, heads concatenated, projected."""
    torch.manual_seed(0)
    attn = Attention(DIM, HEADS, 0, qkv_bias=True).double()
    B, N = 2, 6
    x = torch.randn(B, N, DIM, dtype=torch.float64)
    W, b = attn.qkv.weight, attn.qkv.bias
    q, k, v = (x @ W.T + b).split(DIM, dim=-1)  # each [B, N, C]
    heads = []
    for h in range(HEADS):
        s = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
        scores = q[..., s] @ k[..., s].transpose(1, 2) / math.sqrt(HEAD_DIM)  # [B, N, N]
        if causal:
            scores = scores.masked_fill(torch.ones(N, N).triu(1).bool(), float("-inf"))
        heads.append(scores.softmax(-1) @ v[..., s])
    expected = torch.cat(heads, dim=-1) @ attn.proj.weight.T + attn.proj.bias
    torch.testing.assert_close(attn(x, is_causal=causal), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("k", [HEADS, 2])
def test_uniform_attention_gives_v_minus_running_mean(fused, causal, k):
    """Zero query/key weights make P uniform over the visible tokens, so a Laplacian head
    returns V minus the mean of V (causal: minus the running mean) and a standard head the
    mean itself: the heat-diffusion step of the paper in closed form."""
    torch.manual_seed(0)
    attn = Attention(DIM, HEADS, k, qkv_bias=True, fused=fused).double()
    with torch.no_grad():
        attn.qkv.weight[:2 * DIM] = 0.0  # rows of q and k
        attn.qkv.bias[:2 * DIM] = 0.0
        attn.proj.weight.copy_(torch.eye(DIM))
        attn.proj.bias.zero_()
    B, N = 2, 6
    x = torch.randn(B, N, DIM, dtype=torch.float64)
    v = x @ attn.qkv.weight[2 * DIM:].T + attn.qkv.bias[2 * DIM:]  # [B, N, C]
    if causal:
        mean = v.cumsum(dim=1) / torch.arange(1, N + 1, dtype=torch.float64).view(1, N, 1)
    else:
        mean = v.mean(dim=1, keepdim=True).expand_as(v)
    lap = (torch.arange(DIM) >= (HEADS - k) * HEAD_DIM).view(1, 1, DIM)  # last k heads' channels
    expected = torch.where(lap, v - mean, mean)
    torch.testing.assert_close(attn(x, is_causal=causal), expected, rtol=1e-10, atol=1e-12)
    if not causal and k == HEADS:
        # Every Laplacian output is then centred: the sequence mean is removed exactly.
        assert attn(x).mean(dim=1).abs().max() < 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_return_attn_is_row_stochastic_and_off_the_normal_path(causal, monkeypatch):
    fused, _ = make_pair(2)
    x = torch.randn(2, 6, DIM, dtype=torch.float64)
    out, P = fused(x, is_causal=causal, return_attn=True)
    assert P.shape == (2, HEADS, 6, 6)
    assert (P >= 0).all()
    torch.testing.assert_close(P.sum(-1), torch.ones(2, HEADS, 6, dtype=torch.float64))
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)  # key index > query index
    if causal:
        assert (P[..., future] == 0).all()
    else:
        assert (P[..., future] > 0).all()  # bidirectional: future tokens are attended to
    # The normal path gives a tensor, equal to the analysis path's output, and never forms P:
    # make the explicit-softmax path raise and the fused forward must still run.
    def no_reference(*args, **kwargs):
        raise AssertionError("the fused path formed P explicitly")
    monkeypatch.setattr(fused, "_reference", no_reference)
    plain = fused(x, is_causal=causal)
    assert isinstance(plain, torch.Tensor)
    torch.testing.assert_close(plain, out, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("k,mode", [(0, "fixed"), (2, "fixed"), (HEADS, "fixed"), (2, "learned")])
def test_kv_cache_matches_full_causal_forward(fused, k, mode):
    """Prompt, then a multi-token chunk after the prefix, then one token at a time: the
    concatenated outputs equal one causal forward over the whole sequence (GPT config, so
    rotary positions must be offset by the cache position)."""
    f, r = make_pair(k, mode, "gpt")
    attn = f if fused else r
    B, N = 2, 12
    x = torch.randn(B, N, DIM, dtype=torch.float64)
    full = attn(x, is_causal=True, rope=rope_table(0, N))
    cache = KVCache(1, B, HEADS, HEAD_DIM, max_len=N, dtype=torch.float64)
    pieces, t = [], 0
    for n in [5, 3] + [1] * (N - 8):  # prompt, chunk, single tokens
        pieces.append(attn(x[:, t:t + n], is_causal=True, rope=rope_table(t, n),
                           kv_cache=cache, layer_idx=0))
        cache.advance(n)
        t += n
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="overflow"):
        cache.attend(0, torch.zeros(B, HEADS, 1, HEAD_DIM), torch.zeros(B, HEADS, 1, HEAD_DIM), True)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match=r"num_laplacian_heads=5 is outside 0\.\.4"):
        Attention(DIM, HEADS, 5)
    with pytest.raises(ValueError, match=r"num_laplacian_heads=-1 is outside"):
        Attention(DIM, HEADS, -1)
    with pytest.raises(ValueError, match="laplacian_mode='bogus'"):
        Attention(DIM, HEADS, 1, "bogus")
    with pytest.raises(AssertionError, match="divisible"):  # timm's check
        Attention(30, HEADS)
    shape = dict(img_size=16, patch_size=8, embed_dim=DIM, depth=3, num_heads=HEADS)
    with pytest.raises(ValueError, match="2 entries but the model has 3 layers"):
        vit(num_laplacian_heads=[1, 2], **shape)
    with pytest.raises(ValueError, match=r"num_laplacian_heads=5 in layer 1 is outside 0\.\.4"):
        vit(num_laplacian_heads=[0, 5, 1], **shape)
    with pytest.raises(ValueError, match="laplacian_mode"):
        vit(laplacian_mode="sometimes", **shape)
    with pytest.raises(ValueError, match="laplacian_mode"):
        laplace.attn_layer(1, "sometimes")
    with pytest.raises(ValueError, match="4 entries but the model has 2 layers"):
        GPT(vocab_size=16, depth=2, width=DIM, num_heads=HEADS, num_laplacian_heads=[0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"num_laplacian_heads=-1 is outside 0\.\.4"):
        GPT(vocab_size=16, depth=2, width=DIM, num_heads=HEADS, num_laplacian_heads=-1)


def _tiny_vit(counts, fused, mode="fixed"):
    torch.manual_seed(0)
    return vit(img_size=16, patch_size=4, embed_dim=DIM, depth=len(counts),
                             num_heads=HEADS, num_classes=5, num_laplacian_heads=counts,
                             laplacian_mode=mode, fused_attn=fused)


def _tiny_gpt(counts, fused, mode="fixed"):
    torch.manual_seed(0)
    return GPT(vocab_size=37, depth=len(counts), width=DIM, num_heads=HEADS,
               num_laplacian_heads=counts, laplacian_mode=mode, max_seq_len=64, fused_attn=fused)


def _check_counts(model, counts):
    assert model.num_laplacian_heads == counts
    for i, (blk, k) in enumerate(zip(model.blocks, counts)):
        assert blk.attn.num_laplacian_heads == k, i
        # The Laplacian heads are the LAST k of the layer.
        expected = torch.tensor([0.0] * (HEADS - k) + [1.0] * k)
        assert torch.equal(blk.attn.gates(), expected), i


def test_per_layer_counts_vit_fused_matches_reference():
    counts = [0, 1, 4, 2]
    fused = randomize_(_tiny_vit(counts, True)).double()
    ref = _tiny_vit(counts, False).double()
    ref.load_state_dict(fused.state_dict())
    _check_counts(fused, counts)
    _check_counts(ref, counts)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    outs, grads = [], []
    for m in (fused, ref):
        m(x).square().sum().backward()
        outs.append(m(x).detach())
        grads.append({n: p.grad for n, p in m.named_parameters()})
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-9, atol=1e-10)
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-8, atol=1e-10, msg=n)
    # The per-layer list is honoured, not replaced by a uniform count.
    uniform = _tiny_vit([2] * 4, True).double()
    uniform.load_state_dict(fused.state_dict())
    assert not torch.allclose(uniform(x), outs[0])


def test_per_layer_counts_gpt_fused_matches_reference():
    counts = [4, 0, 3]
    fused = randomize_(_tiny_gpt(counts, True)).double()
    ref = _tiny_gpt(counts, False).double()
    ref.load_state_dict(fused.state_dict())
    _check_counts(fused, counts)
    _check_counts(ref, counts)
    idx = torch.randint(0, 37, (2, 9))
    losses = [m(idx, targets=idx.roll(-1, dims=1)) for m in (fused, ref)]
    torch.testing.assert_close(fused(idx), ref(idx), rtol=1e-9, atol=1e-10)
    for loss in losses:
        loss.backward()
    for (n, p), (_, q) in zip(fused.named_parameters(), ref.named_parameters()):
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-8, atol=1e-10, msg=n)


def _n_params(m):
    return sum(p.numel() for p in m.parameters())


def test_laplacian_heads_add_no_parameters():
    a0, a_all = Attention(DIM, HEADS, 0), Attention(DIM, HEADS, HEADS)
    assert _n_params(a0) == _n_params(a_all)
    assert a0.state_dict().keys() == a_all.state_dict().keys()
    for build in (_tiny_vit, _tiny_gpt):
        m0, m_all = build([0] * 3, True), build([HEADS] * 3, True)
        assert _n_params(m0) == _n_params(m_all)
        assert m0.state_dict().keys() == m_all.state_dict().keys()
        # Learned mode: one gate per head per layer, nothing else.
        learned = build([2] * 3, True, mode="learned")
        assert _n_params(learned) - _n_params(m0) == 3 * HEADS
        extra = set(learned.state_dict()) - set(m0.state_dict())
        assert extra == {f"blocks.{i}.attn.laplacian_gate" for i in range(3)}
        # The gates start where they can move, leaning as k says: the last 2 heads Laplacian.
        a = torch.sigmoid(learned.blocks[0].attn.laplacian_gate)
        torch.testing.assert_close(a, torch.sigmoid(torch.tensor([-1.0] * (HEADS - 2) + [1.0] * 2)))
        assert (a * (1 - a)).min() > 0.19  # sigmoid's slope: 0.018 at the old start +-4


def _saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward of fn(), each storage counted once, parameters left out."""
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        if not isinstance(t, nn.Parameter) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn().sum()
    return total


@pytest.mark.parametrize("config", ["vit", "gpt"])
def test_laplacian_heads_keep_one_merged_copy_more_than_k0(config, device):
    """What plain autograd keeps for the README's line: at k = 0 the head merge is a view of SDPA's
    output (token-major: ViT's q is a view of qkv, the GPT's rotary runs on [B, N, H, D]), so the
    projection keeps nothing SDPA does not; at k > 0 the concatenation is a new tensor the
    projection keeps: one [B, N, C] more, whatever k (the subtraction itself keeps nothing)."""
    x = torch.randn(2, 17, DIM, device=device)
    rope = tuple(t.to(device) for t in rope_table(0, 17, dtype=torch.float32)) if config == "gpt" else None
    sizes = {}
    for k in (0, 1, HEADS):
        torch.manual_seed(0)
        m = Attention(DIM, HEADS, k, **CONFIGS[config]).to(device)
        sizes[k] = _saved_bytes(lambda: m(x, rope=rope))
    assert sizes[1] == sizes[HEADS] == sizes[0] + x.numel() * x.element_size(), sizes


def explicit_attention(attn: LaplacianAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer written out with I - P as a matrix: head h outputs (I - P_h) V_h if it is one of
    the last k, else P_h V_h; the heads are concatenated and projected."""
    B, N, C = x.shape
    q, k, v = attn.qkv(x).view(B, N, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k = attn.q_norm(q), attn.k_norm(k)
    P = ((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])).softmax(-1)  # [B, H, N, N]
    eye = torch.eye(N, dtype=x.dtype)
    lap = (torch.arange(attn.num_heads) >= attn.num_heads - attn.num_laplacian_heads).view(1, -1, 1, 1)
    heads = torch.where(lap, (eye - P) @ v, P @ v)
    return attn.proj(heads.transpose(1, 2).reshape(B, N, C))


@pytest.mark.parametrize("name", ["vit_small_patch16_224", "deit3_small_patch16_224"])
def test_attn_layer_gives_any_timm_vit_explicit_laplacian_heads(name):
    """laplace.attn_layer(k) in timm's own models: every layer's output is explicit (I - P) V on
    its last k heads, P V on the others; set_laplacian_heads gives per-layer counts."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, depth=3, img_size=32, patch_size=8, num_classes=4,
                              attn_layer=laplace.attn_layer(3)).double().eval()
    assert [blk.attn.num_laplacian_heads for blk in model.blocks] == [3, 3, 3]
    laplace.set_laplacian_heads(model, [0, 6, 2])
    seen = []
    hooks = [blk.attn.register_forward_hook(lambda m, args, out: seen.append((m, args[0], out))) for blk in model.blocks]
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32, dtype=torch.float64))
    for h in hooks:
        h.remove()
    assert [m.num_laplacian_heads for m, _, _ in seen] == [0, 6, 2]
    for m, x, out in seen:
        torch.testing.assert_close(out, explicit_attention(m, x), rtol=1e-10, atol=1e-12)


def test_zoo_vits_are_timms_and_registered_with_timm():
    model = laplace.create_model("vitt_3L", depth=2, img_size=32, patch_size=8, num_classes=4)
    assert isinstance(model, timm.models.vision_transformer.VisionTransformer)
    assert model.num_laplacian_heads == [3, 3]
    same = timm.create_model("vitt_3L", depth=2, img_size=32, patch_size=8, num_classes=4)
    assert same.state_dict().keys() == model.state_dict().keys() and same.num_laplacian_heads == [3, 3]


# The paper's attention shapes: ViT-S/16 at 224 px (6 heads of 64, 197 tokens, 5 Laplacian) and
# the GPT d20 (10 heads of 128, causal, 5 Laplacian; 256 of its 2048 positions).
FLASH_SHAPES = {"vit": (384, 6, 5, 197, False), "gpt": (1280, 10, 5, 256, True)}


@pytest.mark.cuda
@pytest.mark.parametrize("config", ["vit", "gpt"])
def test_flash_kernel_runs_the_layer(config, device):
    """SDPA restricted to its flash kernel (the one a GPU picks in bf16 without a mask) runs the
    layer with Laplacian heads, forward and backward, and gives the math kernel's result: nothing
    of ours (a mask, a dtype, a layout) pushes training off flash. (scripts/gpu_check.sh runs it.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dim, heads, k, n, causal = FLASH_SHAPES[config]
    torch.manual_seed(0)
    m = Attention(dim, heads, k, **CONFIGS[config]).to(device)
    x = torch.randn(2, n, dim, device=device)
    rope = tuple(t.to(device) for t in rope_table(0, n, dim // heads, torch.float32)) if config == "gpt" else None
    results = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        # bf16 as trained on a GPU; float32 on the CPU, whose bf16 matmuls here take seconds
        with sdpa_kernel(backend), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = m(xi, is_causal=causal, rope=rope)
        out.float().square().mean().backward()
        results.append((out.float(), xi.grad, m.qkv.weight.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


@pytest.mark.slow
def test_compiled_attention_matches_eager():
    """torch.compile traces the Laplacian step: outputs and gradients as in eager mode."""
    torch.manual_seed(0)
    eager = Attention(DIM, HEADS, 2, **CONFIGS["vit"])
    compiled = Attention(DIM, HEADS, 2, **CONFIGS["vit"])
    compiled.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled)
    x = torch.randn(2, 9, DIM)
    w = torch.randn(2, 9, DIM)
    grads = []
    for m in (eager, compiled):
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        (out * w).sum().backward()
        grads.append((out.detach(), xi.grad, *[p.grad for p in m.parameters()]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
