"""The spectra of docs/monitors.md 1.2 from a head's Grams, computed with
torch on the device the Grams are on: what the daemon computes from a
GramSketch (daemon/monitor_qk.c), done by the trainer so that it sends a
SpectrumSketch (6 dh floats and five doubles per head) instead of two Gram
triangles (2 (2dh)(2dh+1)/2 floats: 263 KB at dh 128).

Precision contract (the daemon's): the Grams are the same float32 (the
Monitor's gram_dtype) products the Gram route sends; everything from there
on is float64. The spectra travel as float32, which moves each sigma^2 by at
most half an ulp (6e-8 relative); the four squared norms and c_qk travel as
float64.

Per head, with GA = [[Qdd, Qdw], [Qwd, Qww]], GB = [[Kww, Kwd], [Kdw, Kdd]]
(n = 2 dh):
    d2 = lambda(GA GB)      d1 = lambda(GA W GB W^T), W = [[I, I], [0, I]]
    d3 = lambda(Qdd Kdd)    w  = lambda(Qww Kww)
    norms: tr Qdd, tr Qww, tr Kww, tr Kdd;  c_qk = tr(Qdd Kdd) / (tr Qdd tr Kdd)
lambda(G1 G2), G1 and G2 symmetric PSD: G1 / max diag = L L^T by Cholesky
(batched over heads), C = L^T (G2 / max diag) L, lambda(C) by eigvalsh.
Where Cholesky fails or a pivot falls below m eps (G1 singular: a frozen
update), the eigen route of docs/monitors.md 1.2 instead: G1 = V diag(l) V^T,
eigenvalues below m eps dropped (the null directions, as the daemon's
pivoted Cholesky drops them), L = V diag(sqrt l). For d2 and d1 the Grams
are balanced first (D = diag(I, s I), s = sqrt(tr Qdd / tr Qww), GA' = D GA
D, GB' = D^-1 GB D^-1, a similarity): at warm-up learning rates the dWq
directions of GA would otherwise sit 1e-16 below its Wq directions and be
lost as rounding. Which Gram is factored, which spectra are absent (all
zero: a frozen update) and what counts as non-finite follow monitor_qk.c,
so that both routes store the same series.
"""
import torch

# Columns of the packed result, per head: d2 | d1 | d3 | w | norms(4) | cqk | flags.
FLAG_NONFINITE = 1.0     # a Gram value, a trace or a result was not finite
N_NORMS = 4

_UNPACK = {}


def _unpack_index(n, device):
    """Index into a row-major upper triangle (row i holds columns i..n-1)
    for every (i, j) of the full n x n matrix, row-major (cached)."""
    key = (n, str(device))
    idx = _UNPACK.get(key)
    if idx is None:
        i = torch.arange(n, device=device).reshape(n, 1).expand(n, n)
        j = torch.arange(n, device=device).reshape(1, n).expand(n, n)
        r, c = torch.minimum(i, j), torch.maximum(i, j)
        # Row r starts at r n - r (r - 1) / 2; column c is (c - r) further.
        idx = (r * n - r * (r - 1) // 2 + (c - r)).reshape(-1)
        _UNPACK[key] = idx
    return idx


def unpack(tri, n):
    """[..., n(n+1)/2] upper triangles -> [..., n, n] symmetric matrices."""
    idx = _unpack_index(n, tri.device)
    return tri.index_select(-1, idx).reshape(tri.shape[:-1] + (n, n))


def _diag(g):
    return torch.diagonal(g, dim1=-2, dim2=-1)


def _safe_eigvalsh(c):
    """Eigenvalues (ascending) of a batch of symmetric matrices; a matrix
    whose solver does not converge gives a NaN row, the others are kept
    (the daemon's -EDOM: that spectrum absent, the rest valid)."""
    try:
        return torch.linalg.eigvalsh(c)
    except RuntimeError:
        out = torch.full(c.shape[:-1], float("nan"), dtype=c.dtype, device=c.device)
        for i in range(c.shape[0]):
            try:
                out[i] = torch.linalg.eigvalsh(c[i])
            except RuntimeError:
                pass
        return out


class _Factor:
    """G1 / fscale = F F^T for the heads in idx (F m x m; the columns of
    dropped null directions are zero)."""

    def __init__(self, g1, idx):
        m = g1.shape[-1]
        self.idx = idx
        a = g1.index_select(0, idx)
        self.fscale = _diag(a).amax(-1)
        a = a / self.fscale[:, None, None]
        tol = m * torch.finfo(torch.float64).eps
        f, info = torch.linalg.cholesky_ex(a)
        piv = _diag(f)
        bad = (info != 0) | ~(piv * piv >= tol).all(-1)
        # The one host sync of the factor: which heads need the eigen route.
        bad_idx = bad.nonzero().reshape(-1)
        if bad_idx.numel():
            lam, v = torch.linalg.eigh(a.index_select(0, bad_idx))
            lam = torch.where(lam > tol, lam, torch.zeros_like(lam))
            f = f.clone()
            f[bad_idx] = v * lam.sqrt()[:, None, :]
        self.f = f

    def project(self, g2):
        """lambda(G1 G2) of the factored heads, descending, clamped at 0,
        scaled back; a row of NaN where the solver failed, a value of inf
        where the result overflowed. g2: all heads (rows picked by idx)."""
        b = g2.index_select(0, self.idx)
        gmax = _diag(b).amax(-1)
        ok = gmax > 0.0
        b = b / torch.where(ok, gmax, torch.ones_like(gmax))[:, None, None]
        c = self.f.transpose(-1, -2) @ b @ self.f
        c = 0.5 * (c + c.transpose(-1, -2))
        scale = self.fscale * gmax
        e = _safe_eigvalsh(c).flip(-1) * scale[:, None]
        e = e.clamp(min=0.0)   # NaN stays NaN
        # Only this last product can overflow (both Grams were divided by
        # their largest diagonal): inf marks the row, as monitor_qk.c's
        # -ERANGE does.
        e = torch.where(torch.isfinite(scale)[:, None], e, torch.full_like(e, float("inf")))
        # G2 without a positive diagonal: the product has no spectrum.
        return torch.where(ok[:, None], e, torch.zeros_like(e))


def _pair(g1, g2, run, m):
    """lambda(G1 G2) for the heads where `run`; zeros (absent) elsewhere."""
    out = torch.zeros(g1.shape[0], m, dtype=torch.float64, device=g1.device)
    run = run & (_diag(g1).amax(-1) > 0.0)
    idx = run.nonzero().reshape(-1)
    if idx.numel():
        out[idx] = _Factor(g1, idx).project(g2)
    return out


def _apply_w(g2, s, h, right):
    """d1's Gram: with W' = D^-1 W D = [[I, s I], [0, I]] (W of docs/monitors.md
    1.2, balanced), d1 = lambda(GA' W' GB' W'^T). G2 = [[P, Q], [Q^T, R]]
    becomes W'^T G2 W' where G2 is GA' (`right`), W' G2 W'^T where it is
    GB'; blockwise, O(dh^2) per head, as monitor_qk.c's w_right / w_left."""
    p, q, qt, r = g2[:, :h, :h], g2[:, :h, h:], g2[:, h:, :h], g2[:, h:, h:]
    s = s[:, None, None]
    sym = q + qt
    left_out = torch.cat([torch.cat([p + s * sym + s * s * r, q + s * r], dim=2),
                          torch.cat([qt + s * r, r], dim=2)], dim=1)
    right_out = torch.cat([torch.cat([p, q + s * p], dim=2),
                           torch.cat([qt + s * p, r + s * s * p + s * sym], dim=2)], dim=1)
    return torch.where(right[:, None, None], right_out, left_out)


def qk_spectra(ga, gb, dh):
    """Per head, from full float64 Grams ga, gb [N, 2dh, 2dh] (gb already
    the key head each query head reads): a float64 tensor [N, 6 dh + 6] on
    the same device, columns
        [0, 2dh) d2, [2dh, 4dh) d1, [4dh, 5dh) d3, [5dh, 6dh) w  (sigma^2,
        descending; all zero when absent or when the solver failed)
        6dh .. 6dh+3   tr Qdd, tr Qww, tr Kww, tr Kdd
        6dh+4          c_qk (NaN when absent)
        6dh+5          flags (FLAG_NONFINITE)
    """
    h, n = dh, 2 * dh
    nh = ga.shape[0]
    dev = ga.device
    ga = ga.to(torch.float64)
    gb = gb.to(torch.float64)
    finite = torch.isfinite(ga).all(-1).all(-1) & torch.isfinite(gb).all(-1).all(-1)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    # Non-finite heads are computed on zeros (every spectrum absent) and
    # flagged; the daemon then stores nothing for them.
    ga = torch.where(finite[:, None, None], ga, zero)
    gb = torch.where(finite[:, None, None], gb, zero)
    da, db = _diag(ga), _diag(gb)
    qd, qw = da[:, :h].sum(-1), da[:, h:].sum(-1)
    kw, kd = db[:, :h].sum(-1), db[:, h:].sum(-1)
    finite &= torch.isfinite(qd) & torch.isfinite(qw) & torch.isfinite(kw) & torch.isfinite(kd)
    live_q, live_k = qd > 0.0, kd > 0.0

    out = torch.zeros(nh, 6 * h + 6, dtype=torch.float64, device=dev)
    qdd, kdd = ga[:, :h, :h], gb[:, h:, h:]
    qww, kww = ga[:, h:, h:], gb[:, :h, :h]

    # c_qk = sum_ij (Qdd_ij / tr Qdd)(Kdd_ij / tr Kdd): each factor at most 1.
    both = live_q & live_k
    one = torch.ones_like(qd)
    cqk = ((qdd / torch.where(live_q, qd, one)[:, None, None]) *
           (kdd / torch.where(live_k, kd, one)[:, None, None])).sum((-1, -2))
    out[:, 6 * h + 4] = torch.where(both & torch.isfinite(cqk), cqk,
                                    torch.full_like(cqk, float("nan")))
    out[:, 4 * h:5 * h] = _pair(qdd, kdd, both & finite, h)
    out[:, 5 * h:6 * h] = _pair(qww, kww, (qw > 0.0) & (kw > 0.0) & finite, h)

    # d2, d1: balanced Grams, the factored side as in monitor_qk.c.
    run = (live_q | live_k) & finite
    s = torch.where(live_q & (qw > 0.0), (qd / torch.where(qw > 0.0, qw, one)).sqrt(), one)
    dvec = torch.cat([torch.ones(nh, h, dtype=torch.float64, device=dev),
                      s[:, None].expand(nh, h)], dim=1)
    scale = dvec[:, :, None] * dvec[:, None, :]
    ga_b, gb_b = ga * scale, gb / scale
    factor_b = (~live_k | ~(kw > 0.0)) & live_q & (qw > 0.0)
    g1 = torch.where(factor_b[:, None, None], gb_b, ga_b)
    g2 = torch.where(factor_b[:, None, None], ga_b, gb_b)
    g2_w = _apply_w(g2, s, h, factor_b)
    run = run & (_diag(g1).amax(-1) > 0.0)
    idx = run.nonzero().reshape(-1)
    if idx.numel():
        fac = _Factor(g1, idx)
        out[idx, 0:n] = fac.project(g2)
        out[idx, n:2 * n] = fac.project(g2_w)

    out[:, 6 * h:6 * h + 4] = torch.stack([qd, qw, kw, kd], dim=1)
    # A result that overflowed to inf is the daemon's -ERANGE: non-finite.
    spectra = out[:, :6 * h]
    finite &= ~torch.isinf(spectra).any(-1)
    # A solver that did not converge leaves that spectrum absent, the rest
    # valid (monitor_qk.c's -EDOM).
    out[:, :6 * h] = torch.nan_to_num(spectra, nan=0.0, posinf=0.0)
    out[:, 6 * h + 5] = torch.where(finite, zero, torch.full_like(qd, FLAG_NONFINITE))
    return out
