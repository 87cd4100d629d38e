"""Does each head smooth? A per-layer, per-head diagnostic of the paper's mechanism.

    from analysis.mechanism import mechanism_checkpoint, to_markdown
    res = mechanism_checkpoint("runs/.../ckpt/last.pt", max_tokens=100_000)
    print(to_markdown(res))

`python -m analysis` runs it with mechanism=true (the default): analysis.json gets a top-level
"mechanism", and mechanism.md and mechanism.{png,pdf} go to the analysis folder.

The paper's explanation: a Laplacian head outputs (I - P) X W_v W_o, P the row-softmax
attention; that output has zero attention-weighted mean, and it smooths the tokens (lowers
their within-sequence variance) only if training makes M = W_v W_o a negative diffusion
(its symmetric part negative). Per layer and head, on the validation data of the analysis
(`analysis.geometry.eval_split`, the same fixed subset, capped by max_tokens):

    X       the attention's input [N, D] per sequence (the block's normed residual stream), every
            token the attention mixes (ViT: the class token too; GPT: every position).
    P_h     the head's attention matrix as the model forms it (causal mask, rotary, QK-norm):
            the reference path of laplace/attention.py, asked for with return_attn=True.
    O_h     the head's contribution to the attention output, after its slice of the output
            projection, no bias: a V + (1 - 2a) P V (a = 0 standard, 1 Laplacian, the learned
            gate otherwise) times W_o,h. Sum over heads + proj bias = the module's output
            (`recon_err` is the largest relative deviation seen; LayerScale (ViT ls1) and the
            residual come after it and are not part of O_h).
    S_h     P_h X - X = -(X - P_h X): the direction that moves each token to its
            attention-weighted mean.
    cos_smooth   <O, S> / sqrt(<O, O> <S, S>), Frobenius over all tokens of all sequences;
                 > 0: the head pushes tokens toward their attention-weighted means (smooths).
    cos_token    the mean over tokens of the per-token cosine (tokens where O or S is 0, e.g.
                 a GPT's first position, are left out).
    dvar    (W(X + O_h) - W(X)) / W(X), W = mean over sequences of sum_t |x_t - mean(x)|^2:
            the relative change of the within-sequence variance if O_h alone were added to
            X. < 0: smooths.
    out_norm     sqrt(<O, O> / <X, X>): the head's output scale relative to its input.
    M_h = W_v,h W_o,h (D x D, rank <= d_head, row-vector convention: x -> x M), its symmetric
    part Sym = (M + M^T) / 2 has at most 2 d_head nonzero eigenvalues (computed from a
    2 d_head x 2 d_head matrix, `sym_eigenvalues`):
        neg_mass     sum |negative eigenvalues| / sum |eigenvalues|: 1 = negative definite
                     on its range, a pure diffusion for a Laplacian head.
        trace_fro    trace(M) / ||M||_F, signed and scale-free.
        eig_min, eig_max.
    type    "softmax", "laplacian" or "learned a=0.73"; gate: a.

Streamed over batches in float64 (per head O(D^2) numbers), the weights' part once per head.
Memory: one layer's P of one batch at a time ([B, H, N, N] in the model's dtype, as its reference
path forms it; lower mechanism_batch_size for long sequences); the float64 part is folded in
chunks of sequences of about 256 MiB (`HeadAccumulator.CHUNK_ELEMENTS`).
"""
from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import DataLoader

from laplace.zoo import features

TYPES = ("softmax", "laplacian", "learned")
#: The per-head numbers pooled by `summary` (and read by analysis.runs as mechanism.<key>.<type>).
SUMMARY_KEYS = ("cos_smooth", "cos_token", "dvar", "neg_mass", "trace_fro")


def head_type(a: float, mode: str) -> str:
    """ "softmax" / "laplacian" (fixed mode, a = 0 / 1), "learned a=0.xx"."""
    if mode == "learned":
        return f"learned a={a:.2f}"
    return "laplacian" if a == 1.0 else "softmax"


def type_group(t: str) -> str:
    """The group of a head type in summaries: softmax, laplacian or learned."""
    return "learned" if t.startswith("learned") else t


def _weights(attn) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """(W_v [D, D] torch layout (out, in), b_v or None, W_o [D, D]) in float64."""
    D = attn.proj.weight.shape[0]
    w = attn.qkv.weight.detach().double()
    b = attn.qkv.bias
    return w[2 * D:3 * D], None if b is None else b.detach().double()[2 * D:3 * D], attn.proj.weight.detach().double()


def sym_eigenvalues(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The (up to 2 d) nonzero eigenvalues of Sym = (A B + (A B)^T) / 2, A [D, d], B [d, D], ascending.

    With U = [A, B^T] and J = [[0, I], [I, 0]], A B + B^T A^T = U J U^T, whose nonzero eigenvalues
    are those of G^1/2 J G^1/2 (G = U^T U, 2d x 2d): no D x D eigen-problem."""
    U = torch.cat([A, B.T], dim=1)
    d = A.shape[1]
    g, Q = torch.linalg.eigh(U.T @ U)
    R = Q * g.clamp_min(0).sqrt()  # G^1/2 = R Q^T
    J = torch.zeros(2 * d, 2 * d, dtype=A.dtype, device=A.device)
    J[:d, d:] = J[d:, :d] = torch.eye(d, dtype=A.dtype, device=A.device)
    H = (R.T @ J @ R) / 2  # similar to G^1/2 J G^1/2 / 2 (conjugated by Q)
    e = torch.linalg.eigvalsh((H + H.T) / 2)
    keep = e.abs() > 1e-10 * e.abs().max()  # U's rank may be below 2d (e.g. 2d > D): its zeros are not Sym's
    return e[keep] if keep.any() else e


def weight_spectrum(attn) -> list[dict]:
    """Per head: neg_mass, trace_fro, eig_min, eig_max of M_h = W_v,h W_o,h (see the module docstring)."""
    Wv, _, Wo = _weights(attn)
    dh = attn.head_dim
    out = []
    for h in range(attn.num_heads):
        A = Wv[h * dh:(h + 1) * dh].T  # [D, dh]: v = x A
        B = Wo[:, h * dh:(h + 1) * dh].T  # [dh, D]: o = y B
        e = sym_eigenvalues(A, B)
        M = A @ B
        fro = M.norm().item()
        total = e.abs().sum().item()
        out.append({"neg_mass": (e.clamp_max(0).abs().sum().item() / total) if total > 0 else float("nan"),
                    "trace_fro": M.trace().item() / fro if fro > 0 else float("nan"),
                    "eig_min": e.min().item(), "eig_max": e.max().item()})
    return out


def head_outputs(attn, x: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """O [B, H, N, D] in float64: every head's term of attn(x) given its P [B, H, N, N]
    (sum over heads + attn.proj.bias = the module's output)."""
    B, N, D = x.shape
    H, dh = attn.num_heads, attn.head_dim
    Wv, bv, Wo = _weights(attn)
    v = x.double() @ Wv.T
    if bv is not None:
        v = v + bv
    v = v.view(B, N, H, dh).transpose(1, 2)  # [B, H, N, dh]
    pv = P.double() @ v
    a = attn.gates().detach().double().view(1, H, 1, 1)
    y = a * v + (1 - 2 * a) * pv  # (1 - a) PV + a (V - PV)
    return torch.einsum("bhnd,ehd->bhne", y, Wo.view(D, H, dh))


class HeadAccumulator:
    """The data part of one attention layer's per-head numbers, folded batch by batch (float64)."""

    def __init__(self, attn):
        # The sums live on the attention's device: no host sync per batch, one in compute().
        dev = attn.proj.weight.device
        z = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=dev)  # noqa: E731
        self.attn = attn
        H = attn.num_heads
        self.os, self.oo, self.ss, self.cos_sum, self.cos_n, self.dw = (z(H) for _ in range(6))
        self.xx, self.wx, self._err = z(), z(), z()
        self.sequences = self.tokens = 0

    @property
    def recon_err(self) -> float:
        """The largest relative deviation of the heads' sum from the module's output seen."""
        return self._err.item()

    #: float64 elements of one chunk's largest tensor ([b, H, N, max(N, D)]): about 256 MiB
    CHUNK_ELEMENTS = 2 ** 25

    @torch.no_grad()
    def update(self, x: torch.Tensor, P: torch.Tensor, out: Optional[torch.Tensor] = None):
        """x [B, N, D] the attention's input, P [B, H, N, N] its heads' matrices, out (optional)
        its output, checked against the heads' sum (recon_err). Folded in chunks of sequences
        (CHUNK_ELEMENTS) so that the float64 copies stay small."""
        B, N, D = x.shape
        step = max(1, self.CHUNK_ELEMENTS // (self.attn.num_heads * N * max(N, D)))
        for i in range(0, B, step):
            self._update(x[i:i + step], P[i:i + step], None if out is None else out[i:i + step])

    def _update(self, x: torch.Tensor, P: torch.Tensor, out: Optional[torch.Tensor]):
        x64, P64 = x.double(), P.double()
        O = head_outputs(self.attn, x64, P64)
        if out is not None:
            bias = self.attn.proj.bias
            full = O.sum(1) + (0 if bias is None else bias.double())
            err = (full - out.double()).norm() / out.double().norm().clamp_min(1e-30)
            self._err = torch.maximum(self._err, err)
        S = P64 @ x64[:, None]
        S -= x64[:, None]  # [B, H, N, D]: P X - X
        ip, oo, ss = (O * S).sum(-1), (O * O).sum(-1), (S * S).sum(-1)  # [B, H, N]
        del S
        self.os += ip.sum((0, 2))
        self.oo += oo.sum((0, 2))
        self.ss += ss.sum((0, 2))
        prod = oo * ss
        ok = prod > 1e-300
        self.cos_sum += torch.where(ok, ip / prod.clamp_min(1e-300).sqrt(), 0).sum((0, 2))
        self.cos_n += ok.sum((0, 2)).double()
        # W(X + O) - W(X) = 2 <Xc, Oc> + |Oc|^2 = 2 <Xc, O> + |O|^2 - N |mean O|^2 (Xc: X less its sequence mean)
        N = x.shape[1]
        Xc = x64 - x64.mean(1, keepdim=True)
        cross = torch.einsum("bnd,bhnd->bh", Xc, O)
        mean_o = O.mean(2)  # [B, H, D]
        self.dw += (2 * cross + oo.sum(2) - N * (mean_o * mean_o).sum(-1)).sum(0)
        self.wx += (Xc * Xc).sum()
        self.xx += (x64 * x64).sum()
        self.sequences += x.shape[0]
        self.tokens += x.shape[0] * N

    def compute(self) -> list[dict]:
        """Per head: the data numbers (cos_smooth, cos_token, dvar, out_norm) + `weight_spectrum`'s + type, gate."""
        attn = self.attn
        gates = attn.gates().detach().float().cpu().tolist()
        nan = float("nan")
        os, oo, ss, cos_sum, cos_n, dw = (t.tolist() for t in (self.os, self.oo, self.ss, self.cos_sum,
                                                               self.cos_n, self.dw))
        wx, xx = self.wx.item(), self.xx.item()
        heads = []
        for h, spec in enumerate(weight_spectrum(attn)):
            den = math.sqrt(oo[h] * ss[h])
            heads.append({
                "head": h, "type": head_type(gates[h], attn.laplacian_mode), "gate": gates[h],
                "cos_smooth": os[h] / den if den > 0 else nan,
                "cos_token": cos_sum[h] / cos_n[h] if cos_n[h] > 0 else nan,
                "dvar": dw[h] / wx if wx > 0 else nan,
                "out_norm": math.sqrt(oo[h] / xx) if xx > 0 else nan,
                **spec})
        return heads


def _hooks(model, accs: dict):
    """Hooks on every block's attention: ask for P (return_attn=True), fold (x, P, out) into the
    layer's accumulator, hand the block its usual output."""
    handles = []

    def ask(module, args, kwargs):
        return args, {**kwargs, "return_attn": True}

    for i, blk in enumerate(model.blocks):
        def fold(module, args, output, i=i):
            out, P = output
            accs[f"blocks.{i}"].update(args[0], P, out)
            return out

        handles += [blk.attn.register_forward_pre_hook(ask, with_kwargs=True), blk.attn.register_forward_hook(fold)]
    return handles


@torch.no_grad()
def head_mechanism(model, dataset, batch_size: int = 64, num_workers: int = 0, progress: bool = False,
                   accumulators: Optional[dict] = None) -> dict[str, list[dict]]:
    """Run `dataset` through `model.forward_features` and measure every head of every block.

    Args:
        model: a ViT or GPT (laplace.checkpoint.load_model), on its device, in eval mode.
        dataset: items (image, class) or (window, next tokens), e.g. `eval_split`'s.
        batch_size, num_workers: the DataLoader's.
        accumulators: a dict to receive the layers' `HeadAccumulator`s (for their counts).
    Returns {"blocks.<i>": [per-head dict, see the module docstring]}.
    """
    from tqdm.auto import tqdm

    dev = next(model.parameters()).device
    accs = {f"blocks.{i}": HeadAccumulator(blk.attn) for i, blk in enumerate(model.blocks)}
    handles = _hooks(model, accs)
    try:
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
        for x, _ in tqdm(loader, desc="mechanism", disable=not progress, leave=False):
            features(model, x.to(dev), norm=False)
    finally:
        for h in handles:
            h.remove()
    if accumulators is not None:
        accumulators.update(accs)
    return {name: acc.compute() for name, acc in accs.items()}


def summary(heads: dict[str, list[dict]]) -> dict:
    """Means of SUMMARY_KEYS over the heads of each type group (softmax, laplacian, learned):
    {"<key>.<group>": mean over all layers, "blocks.<i>": {"<key>.<group>": mean in that layer}}.
    NaNs are left out; a group without heads is absent."""
    def pool(hs):
        out = {}
        for key in SUMMARY_KEYS:
            for g in TYPES:
                vals = [h[key] for h in hs if type_group(h["type"]) == g and math.isfinite(h[key])]
                if vals:
                    out[f"{key}.{g}"] = statistics.fmean(vals)
        return out

    res = pool([h for hs in heads.values() for h in hs])
    res.update({layer: pool(hs) for layer, hs in heads.items()})
    return res


def mechanism_model(model, dataset, batch_size: int = 64, num_workers: int = 0, progress: bool = False) -> dict:
    """`head_mechanism` with its summary, counts and time: what analysis.json holds as "mechanism"."""
    t0 = time.perf_counter()
    accs: dict = {}
    heads = head_mechanism(model, dataset, batch_size, num_workers, progress, accs)
    first = next(iter(accs.values()))
    return {"heads": heads, "summary": summary(heads), "n_sequences": first.sequences, "n_tokens": first.tokens,
            "recon_err": max(a.recon_err for a in accs.values()), "seconds": time.perf_counter() - t0,
            "batch_size": batch_size}


def mechanism_checkpoint(path, *, data=None, max_tokens: Optional[int] = None, batch_size: int = 64,
                         num_workers: int = 0, device: str = "auto", seed: int = 0, progress: bool = False,
                         loaded=None) -> dict:
    """Load a checkpoint (`analysis.geometry.load_for_analysis`), take its evaluation split
    (`eval_split`: the same subset as the geometry) and measure its heads (`mechanism_model`),
    adding model and checkpoint."""
    from analysis.geometry import eval_split, load_for_analysis

    model, ckpt, data_node = loaded or load_for_analysis(path, data, device)
    dataset, _ = eval_split(model, data_node, seed, max_tokens)
    res = mechanism_model(model, dataset, batch_size, num_workers, progress)
    return {"checkpoint": str(Path(path).resolve()), "model": ckpt["config"]["model"]["name"], **res}


# ----------------------------------------------------------------------------- outputs

def _f(v: float, digits: int = 3) -> str:
    return "nan" if not math.isfinite(v) else f"{v:+.{digits}f}"


def to_markdown(result: dict) -> str:
    """The per-head table (and the means per type) of a `mechanism_model` / `mechanism_checkpoint` result."""
    heads = result["heads"]
    title = result.get("model", "model")
    lines = [f"# Mechanism: does each head smooth? ({title})", "",
             f"{result.get('n_sequences', '?')} sequences, {result.get('n_tokens', '?')} tokens. "
             "cos_smooth: Frobenius cosine of the head's output O with P X - X (> 0: toward the attention-"
             "weighted mean); per-token cos: the mean per-token cosine; dvar: relative change of the within-"
             "sequence variance with O alone added to X (< 0: smooths); neg mass: share of negative eigen-mass "
             "of the symmetric part of W_v W_o; trace/||M||: trace(W_v W_o) / ||W_v W_o||_F.", "",
             "| layer | head | type | cos_smooth | per-token cos | dvar | neg eigen-mass | trace/\\|\\|M\\|\\| "
             "| eig min | eig max | \\|O\\|/\\|X\\| |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for layer, hs in heads.items():
        for h in hs:
            lines.append(f"| {layer} | {h['head']} | {h['type']} | {_f(h['cos_smooth'])} | {_f(h['cos_token'])} | "
                         f"{_f(h['dvar'], 4)} | {h['neg_mass']:.3f} | {_f(h['trace_fro'])} | {h['eig_min']:+.3g} | "
                         f"{h['eig_max']:+.3g} | {h['out_norm']:.3g} |")
    s = result.get("summary") or summary(heads)
    groups = [g for g in TYPES if f"cos_smooth.{g}" in s]
    lines += ["", "Means over the heads of each type (all layers):", "",
              "| type | " + " | ".join(SUMMARY_KEYS) + " |", "|---|" + "---|" * len(SUMMARY_KEYS)]
    for g in groups:
        lines.append(f"| {g} | " + " | ".join(_f(s.get(f"{k}.{g}", float("nan")), 4) for k in SUMMARY_KEYS) + " |")
    return "\n".join(lines) + "\n"


def draw_mechanism(result: dict, stem: Path) -> list[Path]:
    """Heatmaps layer x head of cos_smooth, dvar and neg eigen-mass; Laplacian heads outlined
    (learned: the gate a printed in the cell). Writes stem.{png,pdf}; returns the paths."""
    import numpy as np
    from matplotlib.patches import Rectangle

    from analysis.plots import plt, save

    heads = result["heads"]
    layers = list(heads)
    H = max(len(hs) for hs in heads.values())
    grid = {k: np.full((len(layers), H), np.nan) for k in ("cos_smooth", "dvar", "neg_mass")}
    for i, layer in enumerate(layers):
        for h in heads[layer]:
            for k in grid:
                grid[k][i, h["head"]] = h[k]
    dmax = np.nanmax(np.abs(grid["dvar"])) if np.isfinite(grid["dvar"]).any() else 1.0
    panels = (("cos_smooth", "cos_smooth = cos(O, PX - X)\n> 0: smooths", "RdBu", -1, 1),
              ("dvar", "dvar: rel. change of within-seq. variance\n< 0: smooths", "RdBu_r", -dmax, dmax),
              ("neg_mass", "negative eigen-mass\nof sym(W_v W_o)", "viridis", 0, 1))
    fig, axes = plt.subplots(1, 3, figsize=(3 * max(2.5, 0.6 * H + 1.2), max(2.2, 0.45 * len(layers) + 1.4)),
                             squeeze=False)
    for ax, (key, title, cmap, lo, hi) in zip(axes[0], panels):
        im = ax.imshow(grid[key], cmap=cmap, vmin=lo, vmax=hi, aspect="auto")
        fig.colorbar(im, ax=ax, shrink=0.8)
        for i, layer in enumerate(layers):
            for h in heads[layer]:
                v = grid[key][i, h["head"]]
                ax.text(h["head"], i, "nan" if not np.isfinite(v) else f"{v:.2f}", ha="center", va="center", fontsize=6)
                if type_group(h["type"]) == "laplacian" or (type_group(h["type"]) == "learned" and h["gate"] > 0.5):
                    ax.add_patch(Rectangle((h["head"] - 0.5, i - 0.5), 1, 1, fill=False, ec="k", lw=1.8))
        ax.set_xticks(range(H))
        ax.set_yticks(range(len(layers)), layers, fontsize=7)
        ax.set_xlabel("head", fontsize=8)
        ax.set_title(title, fontsize=8)
    fig.suptitle(f"{result.get('model', '')}: per-head smoothing (outlined: Laplacian heads, learned: gate a > 0.5)",
                 fontsize=9)
    fig.tight_layout()
    return save(fig, stem)


def record_summary(analysis: Optional[dict]) -> dict:
    """The per-head smoothing diagnostic of one analysis.json, as analysis.runs records carry it, pooled per
    head type: {"<key>.<type>": mean over the heads of all layers, "blocks.<i>": {"<key>.<type>": ...}}
    with key in cos_smooth, cos_token, dvar, neg_mass, trace_fro and type in softmax, laplacian,
    learned. {} when the analysis ran without it."""
    s = ((analysis or {}).get("mechanism") or {}).get("summary") or {}
    ok = lambda v: isinstance(v, (int, float)) and math.isfinite(v)  # noqa: E731
    return {k: ({kk: float(vv) for kk, vv in v.items() if ok(vv)} if isinstance(v, dict) else float(v))
            for k, v in s.items() if isinstance(v, dict) or ok(v)}
