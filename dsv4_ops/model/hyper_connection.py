"""mHC: manifold-constrained hyper-connections (dsv4_architecture.md §8).

The residual is `hc_mult` parallel streams `X: [B, S, N, D]`. Around each block (attention, MoE) a
`HyperConnection` collapses the streams into the block input (`pre`) and expands the block output back
(`post`), mixing the old streams with a doubly-stochastic `comb` (Sinkhorn). `HyperHead` is the final
collapse before the model's norm. Parameter names match HF (`DeepseekV4HyperConnection`,
`DeepseekV4HyperHead`), so their state_dicts load as-is.

All mixing weights are computed in fp32 whatever the stream dtype. NOTE: keep these parameters in fp32
(HF lists attn_hc / ffn_hc / hc_head in `_keep_in_fp32_modules_strict`); a blanket `model.to(bf16)`
would round them, and the `.float()` casts below cannot undo that.
"""
import torch
from torch import nn

from .. import ops
from .linear import fp32_linear


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    # unweighted RMSNorm, same op order as HF's DeepseekV4UnweightedRMSNorm
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """One mHC site. Usage inside a decoder layer (x: [B, S, N, D] streams):

        u, post, comb = hc.collapse(x)              # u: [B, S, D] block input
        x = hc.expand(block(norm(u)), x, post, comb)
    """

    def __init__(self, dim: int, hc_mult: int = 4, sinkhorn_iters: int = 20, hc_eps: float = 1e-6,
                 norm_eps: float = 1e-6):
        super().__init__()
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        n_mix = (2 + hc_mult) * hc_mult  # pre (N) + post (N) + comb (N*N)
        self.fn = nn.Parameter(torch.randn(n_mix, hc_mult * dim, dtype=torch.float32) * 0.02)
        self.base = nn.Parameter(torch.zeros(n_mix, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))  # pre, post, comb

    def collapse(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, S, N, D] -> (u [B, S, D] in x.dtype, post [B, S, N] fp32, comb [B, S, N, N] fp32)."""
        N = self.hc_mult
        mix = fp32_linear(_rms_normalize(x.flatten(2).float(), self.norm_eps), self.fn)  # [B, S, (2+N)*N]
        pre_w, post_w, comb_w = mix.split([N, N, N * N], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([N, N, N * N])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (N, N)) * comb_s + comb_b.view(N, N), dim=-1) + self.hc_eps
        # Sinkhorn: one column normalisation, then (iters - 1) x (row, column); an op, so that on
        # GPU the 39 normalisations are one kernel (Inductor would emit one per normalisation)
        comb = ops.sinkhorn(comb, self.sinkhorn_iters, self.hc_eps)
        u = (pre.unsqueeze(-1) * x).sum(dim=2)  # fp32 (pre promotes)
        return u.to(x.dtype), post, comb

    @staticmethod
    def expand(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """y: [B, S, D] block output, x: [B, S, N, D] the streams `collapse` saw -> new streams [B, S, N, D].

        X'_k = post_k * y + sum_j comb[j, k] X_j (comb applied transposed; it is not symmetric).
        Mixed in fp32 and cast once (the official reference's hc_post); HF instead casts post/comb
        to the stream dtype first; identical in fp32.
        """
        comb_t = comb.transpose(-1, -2)
        if torch.compiler.is_compiling():
            # an N-term sum per output (N = 4): Inductor fuses it into the line's kernel, where a matmul
            # is a cuBLAS GEMM of inner size 4; eager keeps the matmul (the sum would materialise [.., N, N, D])
            mixed = (comb_t.unsqueeze(-1) * x.float().unsqueeze(-3)).sum(-2)
        else:
            mixed = torch.matmul(comb_t, x.float())
        out = post.unsqueeze(-1) * y.unsqueeze(-2) + mixed
        return out.to(x.dtype)


class HyperHead(nn.Module):
    """Final stream collapse: [B, S, N, D] -> [B, S, D] (no post / comb, no Sinkhorn)."""

    def __init__(self, dim: int, hc_mult: int = 4, hc_eps: float = 1e-6, norm_eps: float = 1e-6):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.randn(hc_mult, hc_mult * dim, dtype=torch.float32) * 0.02)
        self.hc_base = nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mix = fp32_linear(_rms_normalize(x.flatten(2).float(), self.norm_eps), self.hc_fn)  # [B, S, N]
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)
