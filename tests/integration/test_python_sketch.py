"""The PyTorch client's sketches against references computed here, for every
attention layout it recognises (GQA included) and for MoE routers.

For each layout the test builds per-head matrices Wq_h, Wk_g (and an update
dW) in float64, packs them into the layout's module weights itself, lets
foreshock.Monitor find the heads and sketch one window, and checks:
  - the Gram triangles equal A A^T, B B^T of the test's own matrices;
  - lambda(GA GB) of the sent Grams equals sigma^2 of the explicit
    Delta2 = dWq^T Wk + Wq^T dWk (float64 SVD), and so do erank/entropy;
  - the key head sent for each query head is h // (H / Hkv) (GQA);
  - router Grams equal WR WR^T, and the token statistics from the forward
    hooks equal a float64 recomputation (entropy, logsumexp, top-k loads),
    training forwards only.
Then one GQA model goes through libforeshock to the real daemon, whose
per-head qk.d2.erank / qk.d2.entropy / qk.d2.srank must match the SVD, and
whose step_update_ratio at step 1 must equal |W(1) - W(0)| / |W(0)| over
every q_proj and k_proj weight, computed here in float64 (none at step 0:
no step before it).
"""
import math
import os
import sys
import time
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402

REL_GRAM = 2e-5   # float32 Gram products vs float64 of the same float32 weights
REL_SPEC = 1e-3   # spectra relative to the largest value (float32 Grams, float64 solve)


def setup_paths(source_dir):
    sys.path.insert(0, os.path.join(source_dir, "client", "python"))
    sys.path.insert(0, os.path.join(source_dir, "client", "python", "experiments"))


# ---- reference maths (float64, independent of the client) ---------------------------------

def tri(m):
    n = m.shape[0]
    return np.concatenate([m[i, i:] for i in range(n)])


def untri(t, n):
    m = np.zeros((n, n))
    k = 0
    for i in range(n):
        m[i, i:] = t[k:k + n - i]
        k += n - i
    return m + np.triu(m, 1).T


def sym_product_eigs(g1, g2):
    """lambda(G1 G2) for symmetric PSD G1, G2 (docs/monitors.md 1.2's eigen route)."""
    lam, v = np.linalg.eigh(g1)
    lam = np.clip(lam, 0, None)
    s = v * np.sqrt(lam)
    c = s.T @ g2 @ s
    return np.sort(np.clip(np.linalg.eigvalsh((c + c.T) / 2), 0, None))[::-1]


def scalars(s):
    s = np.sort(np.asarray(s, dtype=np.float64))[::-1]
    s = s[s > s[0] * len(s) * np.finfo(np.float32).eps * 10] if s[0] > 0 else s[:0]
    p = s / s.sum()
    h = float(-(p * np.log(p)).sum())
    return {"entropy": h, "erank": math.exp(h), "srank": float(s.sum() / s[0])}


# ---- layouts, packed by the test ------------------------------------------------------------

class HeadSet:
    """Per-head float64 matrices of one layer, rounded through float32 so
    the reference sees exactly the weights the module holds."""

    def __init__(self, rng, h, kv, dh, d):
        r32 = lambda a: a.astype(np.float32).astype(np.float64)  # noqa: E731
        self.h, self.kv, self.dh, self.d = h, kv, dh, d
        self.q0 = [r32(rng.standard_normal((dh, d)) / math.sqrt(d)) for _ in range(h)]
        self.k0 = [r32(rng.standard_normal((dh, d)) / math.sqrt(d)) for _ in range(kv)]
        self.v = [r32(rng.standard_normal((dh, d)) / math.sqrt(d)) for _ in range(kv)]
        # Low-rank-ish updates with a spread spectrum (not all equal).
        self.q1 = [r32(q + 0.05 * rng.standard_normal((dh, 3)) @ rng.standard_normal((3, d)) /
                       math.sqrt(d) + 0.01 * rng.standard_normal((dh, d)) / math.sqrt(d))
                   for q in self.q0]
        self.k1 = [r32(k + 0.05 * rng.standard_normal((dh, 2)) @ rng.standard_normal((2, d)) /
                       math.sqrt(d) + 0.01 * rng.standard_normal((dh, d)) / math.sqrt(d))
                   for k in self.k0]

    def qk(self, t):
        return (self.q0, self.k0) if t == 0 else (self.q1, self.k1)

    def contiguous(self, t):
        q, k = self.qk(t)
        return np.concatenate(q + k + self.v)

    def grouped(self, t):
        q, k = self.qk(t)
        per, rows = self.h // self.kv, []
        for g in range(self.kv):
            rows += q[g * per:(g + 1) * per] + [k[g], self.v[g]]
        return np.concatenate(rows)

    def expected(self, head):
        g = head // (self.h // self.kv)
        dq, dk = self.q1[head] - self.q0[head], self.k1[g] - self.k0[g]
        a = np.concatenate([dq, self.q0[head]])
        b = np.concatenate([self.k0[g], dk])
        d2 = dq.T @ self.k0[g] + self.q0[head].T @ dk
        sv = np.linalg.svd(d2, compute_uv=False) ** 2
        return a @ a.T, b @ b.T, sv, g


def build_cases(torch, nn, foreshock):
    """(name, model factory(headsets) -> (model, setter(t)), (H, Hkv, dh, d), custom)."""
    T = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731

    class Conv1D(nn.Module):  # HF GPT-2's: weight [in, out]
        def __init__(self, nf, nx):
            super().__init__()
            self.nf = nf
            self.weight = nn.Parameter(torch.zeros(nx, nf))

    def stack(make_layer):
        def factory(sets):
            model = nn.Module()
            model.layers = nn.ModuleList()
            setters = []
            for hs in sets:
                m, s = make_layer(hs)
                blk = nn.Module()
                blk.attn = m
                model.layers.append(blk)
                setters.append(s)

            def set_t(t):
                with torch.no_grad():
                    for s in setters:
                        s(t)
            return model, set_t
        return factory

    def nanogpt(hs):
        m = nn.Module()
        m.c_attn = nn.Linear(hs.d, (hs.h + 2 * hs.kv) * hs.dh, bias=False)
        m.n_head = hs.h
        return m, lambda t: m.c_attn.weight.copy_(T(hs.contiguous(t)))

    def gpt2_conv1d(hs):
        m = nn.Module()
        rows = (hs.h + 2 * hs.kv) * hs.dh
        m.c_attn = Conv1D(rows, hs.d)
        m.num_heads, m.head_dim = hs.h, hs.dh
        return m, lambda t: m.c_attn.weight.copy_(T(hs.contiguous(t).T))

    def llama(hs):
        m = nn.Module()
        m.q_proj = nn.Linear(hs.d, hs.h * hs.dh, bias=False)
        m.k_proj = nn.Linear(hs.d, hs.kv * hs.dh, bias=False)
        m.v_proj = nn.Linear(hs.d, hs.kv * hs.dh, bias=False)
        m.config = types.SimpleNamespace(num_attention_heads=hs.h, num_key_value_heads=hs.kv,
                                         head_dim=hs.dh)

        def set_t(t):
            q, k = hs.qk(t)
            m.q_proj.weight.copy_(T(np.concatenate(q)))
            m.k_proj.weight.copy_(T(np.concatenate(k)))
        return m, set_t

    def phi3(hs):
        m = nn.Module()
        m.qkv_proj = nn.Linear(hs.d, (hs.h + 2 * hs.kv) * hs.dh, bias=False)
        m.num_heads, m.num_key_value_heads, m.head_dim = hs.h, hs.kv, hs.dh
        return m, lambda t: m.qkv_proj.weight.copy_(T(hs.contiguous(t)))

    def megatron(hs):
        m = nn.Module()
        m.linear_qkv = nn.Linear(hs.d, (hs.h + 2 * hs.kv) * hs.dh, bias=False)
        m.num_attention_heads_per_partition = hs.h
        m.num_query_groups_per_partition = hs.kv
        m.hidden_size_per_attention_head = hs.dh
        return m, lambda t: m.linear_qkv.weight.copy_(T(hs.grouped(t)))

    def neox(hs):
        m = nn.Module()
        m.query_key_value = nn.Linear(hs.d, 3 * hs.h * hs.dh, bias=True)
        m.num_attention_heads, m.head_size = hs.h, hs.dh
        return m, lambda t: m.query_key_value.weight.copy_(T(hs.grouped(t)))

    def mha(hs):
        m = nn.MultiheadAttention(hs.d, hs.h, bias=False)
        return m, lambda t: m.in_proj_weight.copy_(T(hs.contiguous(t)))

    class Einsum(nn.Module):
        """Weights as [d, heads, dh] (JAX ports): no layout the client knows."""

        def __init__(self, hs):
            super().__init__()
            self.wq = nn.Parameter(torch.zeros(hs.d, hs.h, hs.dh))
            self.wk = nn.Parameter(torch.zeros(hs.d, hs.kv, hs.dh))

    def custom_factory(sets):
        model = nn.Module()
        model.blocks = nn.ModuleList(Einsum(hs) for hs in sets)

        def set_t(t):
            with torch.no_grad():
                for blk, hs in zip(model.blocks, sets):
                    q, k = hs.qk(t)
                    blk.wq.copy_(T(np.stack(q, 1).transpose(2, 1, 0)))
                    blk.wk.copy_(T(np.stack(k, 1).transpose(2, 1, 0)))
        specs = []
        for i, (blk, hs) in enumerate(zip(model.blocks, sets)):
            get = (lambda b=blk, h=hs: (b.wq.permute(1, 2, 0).reshape(h.h * h.dh, h.d),
                                        b.wk.permute(1, 2, 0).reshape(h.kv * h.dh, h.d)))
            specs.append(foreshock.AttentionSpec(layer=i, n_heads=hs.h, n_kv_heads=hs.kv,
                                                 head_dim=hs.dh, get=get, name=f"blocks.{i}"))
        return model, set_t, specs

    return [
        ("nanogpt c_attn", stack(nanogpt), (4, 4, 8, 24), False),
        ("gpt2 Conv1D c_attn", stack(gpt2_conv1d), (3, 3, 8, 12), False),  # d < 2dh
        ("llama q_proj/k_proj GQA", stack(llama), (8, 2, 4, 20), False),
        ("phi3 qkv_proj GQA", stack(phi3), (4, 2, 8, 16), False),
        ("megatron linear_qkv GQA", stack(megatron), (6, 2, 4, 16), False),
        ("neox query_key_value", stack(neox), (3, 3, 4, 12), False),
        ("nn.MultiheadAttention", stack(mha), (2, 2, 6, 12), False),
        ("custom accessor GQA", custom_factory, (4, 2, 4, 10), True),
    ]


def sketch_once(torch, foreshock, model, set_t, specs, run="t", transport=None, **kw):
    """Weights at t0 on step 0, at t1 on step 1: one window-1 sketch."""
    from foreshock.testing import RecordingTransport
    rec = transport or RecordingTransport()
    set_t(0)
    mon = foreshock.Monitor(model, run=run, windows=(1,), every=1, transport=rec,
                            attention=specs, routers=[], **kw)
    mon.step(0, loss=1.0)
    set_t(1)
    mon.step(1, loss=0.9)
    mon.close(10)
    return rec


def check_layouts(torch, nn, foreshock):
    rng = np.random.default_rng(7)
    for name, factory, (h, kv, dh, d), custom in build_cases(torch, nn, foreshock):
        sets = [HeadSet(rng, h, kv, dh, d) for _ in range(2)]
        if custom:
            model, set_t, specs = factory(sets)
        else:
            model, set_t = factory(sets)
            specs = None
            found = foreshock.find_attention(model)
            check([(s.layer, s.n_heads, s.n_kv_heads, s.head_dim) for s in found] ==
                  [(i, h, kv, dh) for i in range(2)],
                  f"{name}: found {[(s.name, s.n_heads, s.n_kv_heads, s.head_dim) for s in found]}")
        rec = sketch_once(torch, foreshock, model, set_t, specs, route="gram")
        rep = rec.by_step().get(1)
        check(rep is not None and len(rep.attention) == 2 * h,
              f"{name}: expected {2 * h} head sketches at step 1")
        worst_g, worst_s = 0.0, 0.0
        for g in rep.attention:
            hs = sets[g.layer]
            ga_x, gb_x, sv, key_head = hs.expected(g.head)
            check(g.window == 1 and g.dh == dh and (g.shard_index, g.shard_count) == (0, 1),
                  f"{name}: window/dh/shard {g.window}/{g.dh}/{g.shard_index},{g.shard_count}")
            check(g.kv_head == (key_head if kv != h else None),
                  f"{name}: head {g.head} sent kv_head {g.kv_head}, expected {key_head}")
            for got, want in ((g.ga, tri(ga_x)), (g.gb, tri(gb_x))):
                err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
                worst_g = max(worst_g, err)
                check(err < REL_GRAM, f"{name}: layer {g.layer} head {g.head}: Gram rel err {err}")
            n = 2 * dh
            lam = sym_product_eigs(untri(g.ga.astype(np.float64), n),
                                   untri(g.gb.astype(np.float64), n))
            ref = np.sort(np.concatenate([sv, np.zeros(max(0, n - len(sv)))]))[::-1][:n]
            err = np.abs(lam - ref).max() / ref[0]
            worst_s = max(worst_s, err)
            check(err < REL_SPEC, f"{name}: head {g.head}: sigma^2(Delta2) rel err {err}")
            a, b = scalars(lam), scalars(ref)
            for k in ("erank", "entropy", "srank"):
                check(abs(a[k] - b[k]) <= REL_SPEC * max(1.0, abs(b[k])),
                      f"{name}: head {g.head}: {k} {a[k]} vs SVD {b[k]}")
        print(f"  {name:28s} H={h} Hkv={kv} dh={dh} d={d}: {len(rep.attention)} heads, "
              f"max Gram rel err {worst_g:.1e}, max spectrum rel err {worst_s:.1e}", flush=True)


def check_routers(torch, nn, foreshock):
    import torch.nn.functional as F
    E, d = 6, 10

    class Mixtral(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(d, E, bias=False)
            self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(E))
            self.num_experts_per_tok = 2

        def forward(self, x):
            return self.gate(x)

    class MoEGate(nn.Module):  # DeepSeek: returns routing decisions, not logits
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(E, d))

        def forward(self, x):
            s = F.linear(x, self.weight).softmax(-1)
            w, i = s.topk(3, dim=-1)
            return i, w, None

    class DeepSeek(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = MoEGate()
            self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(E))
            self.num_experts_per_tok = 3

        def forward(self, x):
            return self.gate(x)

    torch.manual_seed(3)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module(), nn.Module()])
    model.layers[0].mlp = Mixtral()
    model.layers[1].mlp = DeepSeek()
    specs = foreshock.find_routers(model)
    check([(s.layer, s.n_experts, s.top_k) for s in specs] == [(0, E, 2), (1, E, 3)],
          f"routers found: {[(s.name, s.layer, s.n_experts, s.top_k) for s in specs]}")
    from foreshock.testing import RecordingTransport
    rec = RecordingTransport()
    mon = foreshock.Monitor(model, run="r", windows=(1,), every=1, transport=rec, attention=[])
    xs = [torch.randn(3, 5, d), torch.randn(2, 7, d)]
    for x in xs:  # two training forwards between steps: summed
        for blk in model.layers:
            blk.mlp(x)
    model.eval()
    for blk in model.layers:  # an eval forward: not counted
        blk.mlp(torch.randn(4, 4, d) * 100)
    model.train()
    mon.step(1)
    mon.close(10)
    rep = rec.by_step()[1]
    toks = {t.layer: t for t in rep.router_tokens}
    grams = {g.layer: g for g in rep.router_grams}
    check(sorted(toks) == [0, 1] and sorted(grams) == [0, 1], "router tokens/grams per layer")
    for layer, (w, k) in enumerate(((model.layers[0].mlp.gate.weight, 2),
                                    (model.layers[1].mlp.gate.weight, 3))):
        w64 = w.detach().double().numpy()
        gr = w64 @ w64.T
        err = np.abs(grams[layer].gram - tri(gr)).max() / np.abs(gr).max()
        check(err < REL_GRAM, f"router {layer}: Gram rel err {err}")
        z = np.concatenate([x.reshape(-1, d).double().numpy() @ w64.T for x in xs])
        m = z.max(1, keepdims=True)
        lse = (m + np.log(np.exp(z - m).sum(1, keepdims=True)))[:, 0]
        p = np.exp(z - lse[:, None])
        hh = lse - (p * z).sum(1)
        load = np.zeros(E)
        for row in np.argsort(-z, axis=1)[:, :k]:
            load[row] += 1
        t = toks[layer]
        check(t.n_tok == z.shape[0], f"router {layer}: n_tok {t.n_tok} != {z.shape[0]}")
        check(np.array_equal(t.load.astype(np.float64), load), f"router {layer}: load {t.load} "
              f"!= {load}")
        for got, want, what in ((t.sum_h, hh.sum(), "sum_h"), (t.sum_h2, (hh ** 2).sum(), "sum_h2"),
                                (t.sum_lse2, (lse ** 2).sum(), "sum_lse2")):
            check(abs(got - want) <= 1e-4 * max(1.0, abs(want)), f"router {layer}: {what} {got} "
                  f"vs {want}")
        check(np.allclose(t.sum_p, p.sum(0), rtol=1e-4, atol=1e-5), f"router {layer}: sum_p")
    print("  routers (Mixtral gate, DeepSeek MoEGate): Grams and token statistics match", flush=True)


def check_step_ratio(torch, nn, foreshock):
    """step_update_ratio over the weights that moved: one layer of two
    frozen, then both moving, then a step that moved nothing (a skipped
    step: 0), then a step() skipped (no value: no step before it)."""
    from foreshock.testing import RecordingTransport
    rng = np.random.default_rng(5)
    h, kv, dh, d = 4, 2, 8, 16
    cases = {c[0]: c for c in build_cases(torch, nn, foreshock)}
    model, set_t = cases["llama q_proj/k_proj GQA"][1]([HeadSet(rng, h, kv, dh, d)
                                                        for _ in range(2)])
    set_t(0)
    qk = [[p for n, p in model.named_parameters() if n.endswith(("q_proj.weight",
                                                                  "k_proj.weight"))
           and f".{layer}." in f".{n}"] for layer in range(2)]
    check(all(len(ps) == 2 for ps in qk), f"q/k weights by layer: {[len(ps) for ps in qk]}")
    rec = RecordingTransport()
    mon = foreshock.Monitor(model, run="ratio", windows=(1,), every=1, transport=rec, routers=[])
    want = {}

    def move(step, layers, scale):
        before = [[p.detach().double().clone() for p in qk[i]] for i in range(2)]
        with torch.no_grad():
            for i in layers:
                for p in qk[i]:
                    p.add_(scale * torch.from_numpy(rng.standard_normal(tuple(p.shape))).float())
        dn = on = 0.0
        for i in layers:
            for p, b in zip(qk[i], before[i]):
                dn += float(((p.detach().double() - b) ** 2).sum())
                on += float((b ** 2).sum())
        want[step] = math.sqrt(dn / on) if on else 0.0
        mon.step(step, loss=1.0)
    mon.step(0, loss=1.0)
    move(1, [0], 0.01)        # layer 1 frozen: the ratio of layer 0 alone
    move(2, [0, 1], 0.02)     # unfrozen: both
    move(3, [], 0.0)          # nothing moved: 0
    mon.step(5, loss=1.0)     # step 4 never reported: no ratio at 5
    mon.close(10)
    got = {r.step: r.scalars.get("step_update_ratio") for r in rec.reports}
    check(got.get(0) is None and got.get(5) is None, f"ratio without a previous step: {got}")
    for step, w in want.items():
        g = got.get(step)
        check(g is not None and abs(g - w) <= 1e-6 * max(w, 1e-12),
              f"step {step}: step_update_ratio {g}, want {w}")
    print(f"  step_update_ratio: one layer frozen {got[1]:.5f}, both moving {got[2]:.5f}, none "
          f"0, no value without the step before (float64 reference)", flush=True)


def check_daemon(args, workdir, torch, nn, foreshock):
    """One GQA model through libforeshock into the real daemon."""
    from fsapi import Api
    rng = np.random.default_rng(11)
    h, kv, dh, d = 8, 2, 8, 24
    cases = {c[0]: c for c in build_cases(torch, nn, foreshock)}
    sets = [HeadSet(rng, h, kv, dh, d) for _ in range(2)]
    model, set_t = cases["llama q_proj/k_proj GQA"][1](sets)
    daemon = fstest.Daemon(args.build_dir, workdir)
    try:
        os.environ["FORESHOCK_LIB"] = os.path.join(args.build_dir, "libforeshock.so")
        def qk():
            return [p.detach().double().clone() for n, p in model.named_parameters()
                    if n.endswith(("q_proj.weight", "k_proj.weight"))]
        set_t(0)
        w0 = qk()
        mon = foreshock.Monitor(model, endpoint=daemon.endpoint, run="sketch-gqa", windows=(1,),
                                every=1, routers=[])
        mon.step(0, loss=1.0)
        set_t(1)
        w1 = qk()
        mon.step(1, loss=0.9)
        check(len(w0) == 2 * len(sets), f"{len(w0)} q/k weights, want {2 * len(sets)}")
        ref_ratio = math.sqrt(sum(float(((b - a) ** 2).sum()) for a, b in zip(w0, w1)) /
                              sum(float((a ** 2).sum()) for a in w0))
        st = mon.close(60)
        check(st["acked"] == 2 and st["dropped"] == 0, f"client stats {st}")
        api = Api(daemon.http)
        want = {name: 2 * h for name in ("qk.d2.erank", "qk.d2.entropy", "qk.d2.srank")}
        deadline = time.monotonic() + 60
        while True:
            vals = {}
            for name in want:
                for key, pts in api.values("sketch-gqa", name=name).items():
                    if key[2] is not None and key[2] >= 0 and 1 in pts:
                        vals[(name, key[1], key[2])] = pts[1]
            if len(vals) == sum(want.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        check(len(vals) == sum(want.values()),
              f"daemon has {len(vals)} of {sum(want.values())} per-head values")
        worst = 0.0
        for (name, layer, head), v in vals.items():
            ref = scalars(sets[layer].expected(head)[2])[name.split(".")[-1]]
            err = abs(v - ref) / max(1.0, abs(ref))
            worst = max(worst, err)
            check(err < REL_SPEC, f"daemon {name} layer {layer} head {head}: {v} vs SVD {ref}")
        print(f"  daemon: {len(vals)} per-head values of qk.d2.erank/entropy/srank match the "
              f"float64 SVD (max rel err {worst:.1e})", flush=True)
        sur = [pts for key, pts in api.values("sketch-gqa", name="step_update_ratio").items()]
        check(len(sur) == 1 and sorted(sur[0]) == [1],
              f"step_update_ratio: want one series with step 1 only, got {sur}")
        err = abs(sur[0][1] - ref_ratio) / ref_ratio
        check(err < 1e-5, f"step_update_ratio {sur[0][1]} vs float64 {ref_ratio}")
        print(f"  daemon: step_update_ratio {sur[0][1]:.6g} equals |W(1)-W(0)|/|W(0)| over "
              f"the q/k weights (rel err {err:.1e})", flush=True)
    finally:
        daemon.stop()


def main(args, workdir):
    setup_paths(args.source_dir)
    import torch
    import torch.nn as nn
    import foreshock
    torch.set_num_threads(1)
    check_layouts(torch, nn, foreshock)
    check_routers(torch, nn, foreshock)
    check_step_ratio(torch, nn, foreshock)
    check_daemon(args, workdir, torch, nn, foreshock)


if __name__ == "__main__":
    fstest.preload_sanitizers()
    fstest.run_main(main)
