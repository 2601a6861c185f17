"""The sketches of docs/monitors.md, computed with torch on the device
the weights live on. Pure functions of their inputs; no host sync.

Attention (1.1), per query head h over a window with base t0:
    A = [dWq ; Wq(t0)]   B = [Wk(t0) ; dWk]   (2dh x d and 2dh x dk,
    dW = W(t) - W(t0); dk = d unless keys have their own input width)
    GA = A A^T, GB = B B^T, sent as upper triangles (row-major, row i holds
    columns i..n-1, n = 2dh). Additive over slices of d.
Router (3.1): GR = WR WR^T, upper triangle. Additive over slices of d.
Router tokens (3.2): n_tok, sum H, sum H^2, sum lse^2, top-k load[E], sum p[E].
"""
import contextlib

import torch

_TRIU = {}


def triu_indices(n, device):
    """Row-major upper-triangle indices of an n x n matrix (cached)."""
    key = (n, str(device))
    t = _TRIU.get(key)
    if t is None:
        t = torch.triu_indices(n, n, device=device)
        _TRIU[key] = t
    return t


@contextlib.contextmanager
def exact_matmul(device):
    """TF32 would round the Gram products to 10 mantissa bits on Ampere+
    GPUs; the monitors need float32 sums. Restores the global flag after."""
    if device.type != "cuda":
        yield
        return
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def attention_grams(wq, wk, wq0, wk0, n_heads, n_kv_heads, dh, dtype=torch.float32):
    """wq, wq0: [H*dh, d]; wk, wk0: [Hkv*dh, dk] (now and at the window base).
    Returns (ga [H, T], gb [Hkv, T]) with T = n(n+1)/2, n = 2*dh, in dtype,
    on the weights' device. Query head h pairs with key head
    h // (H // Hkv): gb row of that key head.

    d and dk differ when queries and keys come from inputs of different
    widths (nn.MultiheadAttention with kdim != embed_dim: q_proj_weight is
    [E, E], k_proj_weight [E, kdim]). The head's operator Wq^T Wk is then a
    d x dk bilinear form, not a square one; everything the monitors use is
    still defined: its nonzero singular values (and those of Delta1/2/3)
    are the square roots of lambda(GA GB) etc., where GA = A A^T reduces
    over d and GB = B B^T over dk, both 2dh x 2dh. So each side keeps its
    own input width; nothing pairs a column of Wq with a column of Wk."""
    d, dk = wq.shape[-1], wk.shape[-1]
    if wq0.shape != wq.shape or wk0.shape != wk.shape:
        raise ValueError(f"attention_grams: weights {tuple(wq.shape)}/{tuple(wk.shape)} but "
                         f"base {tuple(wq0.shape)}/{tuple(wk0.shape)}")
    if wq.shape[0] != n_heads * dh or wk.shape[0] != n_kv_heads * dh:
        raise ValueError(f"attention_grams: Wq {tuple(wq.shape)} / Wk {tuple(wk.shape)} do not "
                         f"hold {n_heads} / {n_kv_heads} heads of {dh} rows")
    q = wq.detach().to(dtype).reshape(n_heads, dh, d)
    q0 = wq0.detach().to(dtype).reshape(n_heads, dh, d)
    k = wk.detach().to(dtype).reshape(n_kv_heads, dh, dk)
    k0 = wk0.detach().to(dtype).reshape(n_kv_heads, dh, dk)
    a = torch.cat([q - q0, q0], dim=1)
    b = torch.cat([k0, k - k0], dim=1)
    with exact_matmul(wq.device):
        ga = torch.bmm(a, a.transpose(1, 2))
        gb = torch.bmm(b, b.transpose(1, 2))
    r, c = triu_indices(2 * dh, ga.device)
    return ga[:, r, c], gb[:, r, c]


def router_gram(wr, dtype=torch.float32):
    """wr: [E, d]. Upper triangle of WR WR^T, [E(E+1)/2]."""
    w = wr.detach().to(dtype)
    with exact_matmul(w.device):
        g = w @ w.t()
    r, c = triu_indices(w.shape[0], g.device)
    return g[r, c]


class TokenStats:
    """Per-layer decision-side sums, kept as device tensors so a forward
    hook adds to them without a host sync. n_tok is a Python int: it comes
    from tensor shapes, which the host knows."""

    def __init__(self, n_experts, device):
        self.n_experts = n_experts
        self.n_tok = 0
        z = dict(device=device, dtype=torch.float64)
        self.sums = torch.zeros(3, **z)              # sum_H, sum_H2, sum_lse2
        self.load = torch.zeros(n_experts, device=device, dtype=torch.int64)
        self.sum_p = torch.zeros(n_experts, **z)

    @torch.no_grad()
    def add(self, logits, top_k):
        """logits: [..., E] router logits of the tokens of one forward."""
        z = logits.detach().reshape(-1, self.n_experts).float()
        if z.shape[0] == 0:
            return
        lse = torch.logsumexp(z, dim=-1)
        p = torch.softmax(z, dim=-1)
        h = lse - (p * z).sum(dim=-1)
        hd, ld = h.double(), lse.double()
        self.sums += torch.stack([hd.sum(), (hd * hd).sum(), (ld * ld).sum()])
        idx = z.topk(top_k, dim=-1).indices.reshape(-1)
        # index_add_, not bincount: bincount syncs with the host on CUDA.
        self.load.index_add_(0, idx, torch.ones_like(idx))
        self.sum_p += p.double().sum(dim=0)
        self.n_tok += z.shape[0]
