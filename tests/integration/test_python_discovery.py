"""Discovery of attention Q/K weights and MoE routers on a zoo of small
models written here, each in a different naming convention (no daemon,
no libforeshock: a RecordingTransport stands in).

For every zoo member the test asserts exactly
  - the attention layers found: (layer, H, Hkv, dh) per layer;
  - that the per-head Q/K rows each spec's get() returns are the rows the
    test slices by hand from the module's weight for that layout (query
    head h, key head g), so discovery is not just counting;
  - the routers found: (layer, E, top_k), and that get() is the weight;
  - the ONE summary record the Monitor logs at start: its level (WARNING
    when something was skipped, guessed or nothing found) and what it says
    (counts, skipped modules with their reasons, the argument that fixes it).
For two members the router forward hook runs too (the Linear router's
output is its logits; the nn.Parameter router's are recomputed from the
MoE module's input), and for the skipped one the suggested fix
(Monitor(n_heads=)) is applied and checked.
"""
import dataclasses
import logging
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def zoo(torch, nn, F):
    """[(name, build() -> model, expectations)]."""
    members = []

    def member(name, **exp):
        def deco(build):
            members.append((name, build, exp))
            return build
        return deco

    def rows(w, start, n):
        return w[start:start + n]

    def contiguous(w, h, kv, dh):
        return ([rows(w, i * dh, dh) for i in range(h)],
                [rows(w, (h + g) * dh, dh) for g in range(kv)])

    def grouped(w, h, kv, dh):
        per = h // kv
        qs, ks = [], []
        for g in range(kv):
            base = g * (per + 2) * dh
            qs += [rows(w, base + j * dh, dh) for j in range(per)]
            ks.append(rows(w, base + per * dh, dh))
        return qs, ks

    def separate(wq, wk, h, kv, dh):
        return [rows(wq, i * dh, dh) for i in range(h)], [rows(wk, g * dh, dh) for g in range(kv)]

    # 1. The reported failure: head count in `nheads`, router a plain
    # Linear(d, E) with the experts as flattened parameters (no container).
    class UserAttn(nn.Module):
        def __init__(self, d, nheads):
            super().__init__()
            self.nheads = nheads
            self.qkv = nn.Linear(d, 3 * d)
            self.out = nn.Linear(d, d)

    class UserMoE(nn.Module):
        def __init__(self, d, n_exp, f, k):
            super().__init__()
            self.router = nn.Linear(d, n_exp, bias=False)
            self.w_in = nn.Parameter(torch.randn(n_exp * f, d))
            self.w_out = nn.Parameter(torch.randn(n_exp * f, d))
            self.k = k

        def forward(self, x):
            return self.router(x)

    @member("user MoE GPT (nheads, router Linear without experts container)",
            attention=[(0, 4, 4, 8), (1, 4, 4, 8)], routers=[(0, 4, 1), (1, 4, 1)],
            level=logging.INFO, says=["2 attention layers x 4 heads", "2 MoE routers (4 "
                                      "experts, top-1)", "nheads", "no experts container"],
            tokens=True)
    def user_moe():
        model = nn.Module()
        model.blocks = nn.ModuleList()
        for _ in range(2):
            b = nn.Module()
            b.attn, b.moe = UserAttn(32, 4), UserMoE(32, 4, 16, 1)
            model.blocks.append(b)
        model.heads_ = lambda: [contiguous(b.attn.qkv.weight, 4, 4, 8) for b in model.blocks]
        model.routers_ = lambda: [b.moe.router.weight for b in model.blocks]
        model.moes_ = [b.moe for b in model.blocks]
        return model

    # 2. LLaMA-style: RMSNorm, q/k/v/o_proj, GQA from num_key_value_heads on
    # the config, SwiGLU MLP with gate_proj (not a router).
    class RMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

    class LlamaAttn(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.config = cfg
            self.head_dim = cfg.hidden_size // cfg.num_attention_heads
            self.num_key_value_groups = cfg.num_attention_heads // cfg.num_key_value_heads
            h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
            self.q_proj = nn.Linear(d, h * self.head_dim, bias=False)
            self.k_proj = nn.Linear(d, kv * self.head_dim, bias=False)
            self.v_proj = nn.Linear(d, kv * self.head_dim, bias=False)
            self.o_proj = nn.Linear(h * self.head_dim, d, bias=False)

    class SwiGLU(nn.Module):
        def __init__(self, d, f):
            super().__init__()
            self.gate_proj = nn.Linear(d, f, bias=False)
            self.up_proj = nn.Linear(d, f, bias=False)
            self.down_proj = nn.Linear(f, d, bias=False)

    @member("LLaMA GQA (q/k/v/o_proj, RMSNorm, SwiGLU gate_proj)",
            attention=[(i, 8, 2, 4) for i in range(3)], routers=[], level=logging.INFO,
            says=["3 attention layers x 8 heads", "GQA 2 KV heads (4 query heads per KV head)",
                  "routers: none found"], not_says=["gate_proj", "SKIPPED"])
    def llama():
        cfg = types.SimpleNamespace(hidden_size=32, num_attention_heads=8,
                                    num_key_value_heads=2, intermediate_size=86)
        model = nn.Module()
        model.model = nn.Module()
        model.model.layers = nn.ModuleList()
        for _ in range(3):
            b = nn.Module()
            b.input_layernorm, b.post_attention_layernorm = RMSNorm(32), RMSNorm(32)
            b.self_attn, b.mlp = LlamaAttn(cfg), SwiGLU(32, 86)
            model.model.layers.append(b)
        model.heads_ = lambda: [separate(b.self_attn.q_proj.weight, b.self_attn.k_proj.weight,
                                         8, 2, 4) for b in model.model.layers]
        model.routers_ = lambda: []
        return model

    # 3. Mixtral-style: block_sparse_moe.gate Linear(d, E) + experts (w1/w2/w3);
    # heads and top_k only on the root model's config.
    class Expert(nn.Module):
        def __init__(self, d, f):
            super().__init__()
            self.w1 = nn.Linear(d, f, bias=False)
            self.w2 = nn.Linear(f, d, bias=False)
            self.w3 = nn.Linear(d, f, bias=False)

    class SparseMoE(nn.Module):
        def __init__(self, d, n_exp):
            super().__init__()
            self.gate = nn.Linear(d, n_exp, bias=False)
            self.experts = nn.ModuleList(Expert(d, 24) for _ in range(n_exp))

    @member("Mixtral (block_sparse_moe.gate + experts, root config)",
            attention=[(0, 4, 1, 8), (1, 4, 1, 8)], routers=[(0, 6, 2), (1, 6, 2)],
            level=logging.INFO, says=["GQA 1 KV heads", "2 MoE routers (6 experts, top-2)",
                                      "config.num_experts_per_tok"])
    def mixtral():
        model = nn.Module()
        model.config = types.SimpleNamespace(hidden_size=32, num_attention_heads=4,
                                             num_key_value_heads=1, num_local_experts=6,
                                             num_experts_per_tok=2)
        model.layers = nn.ModuleList()
        for _ in range(2):
            b = nn.Module()
            b.self_attn = nn.Module()
            for n, r in (("q_proj", 32), ("k_proj", 8), ("v_proj", 8)):
                setattr(b.self_attn, n, nn.Linear(32, r, bias=False))
            b.self_attn.o_proj = nn.Linear(32, 32, bias=False)
            b.block_sparse_moe = SparseMoE(32, 6)
            model.layers.append(b)
        model.heads_ = lambda: [separate(b.self_attn.q_proj.weight, b.self_attn.k_proj.weight,
                                         4, 1, 8) for b in model.layers]
        model.routers_ = lambda: [b.block_sparse_moe.gate.weight for b in model.layers]
        return model

    # 4. nn.MultiheadAttention and a router that is an nn.Parameter [E, d];
    # top_k on the parent block.
    class ParamMoE(nn.Module):
        def __init__(self, d, n_exp):
            super().__init__()
            self.gate = nn.Parameter(torch.randn(n_exp, d) / d ** 0.5)
            self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n_exp))

        def forward(self, x):
            p = F.linear(x, self.gate).softmax(-1)
            return x + sum(p[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))

    @member("nn.MultiheadAttention + router as nn.Parameter",
            attention=[(0, 4, 4, 4), (1, 4, 4, 4)], routers=[(0, 6, 3), (1, 6, 3)],
            level=logging.INFO, says=["nn.MultiheadAttention.num_heads", "moe_top_k"],
            tokens=True)
    def param_router():
        model = nn.Module()
        model.h = nn.ModuleList()
        for _ in range(2):
            b = nn.Module()
            b.attn = nn.MultiheadAttention(16, 4, batch_first=True)
            b.moe, b.moe_top_k = ParamMoE(16, 6), 3
            model.h.append(b)
        model.heads_ = lambda: [contiguous(b.attn.in_proj_weight, 4, 4, 4) for b in model.h]
        model.routers_ = lambda: [b.moe.gate for b in model.h]
        model.moes_ = [b.moe for b in model.h]
        return model

    # 5. Fused c_attn (GQA), head counts only on a config dataclass of the root.
    @dataclasses.dataclass
    class GPTConfig:
        n_embd: int = 48
        n_head: int = 6
        n_kv_head: int = 2

    @member("fused c_attn GQA, heads only on the root config",
            attention=[(i, 6, 2, 8) for i in range(2)], routers=[], level=logging.INFO,
            says=["config.n_head", "GQA 2 KV heads"])
    def fused_config():
        model = nn.Module()
        model.config = GPTConfig()
        model.transformer = nn.Module()
        model.transformer.h = nn.ModuleList()
        for _ in range(2):
            b = nn.Module()
            b.attn = nn.Module()
            b.attn.c_attn = nn.Linear(48, (6 + 2 * 2) * 8)
            model.transformer.h.append(b)
        model.heads_ = lambda: [contiguous(b.attn.c_attn.weight, 6, 2, 8)
                                for b in model.transformer.h]
        model.routers_ = lambda: []
        return model

    # 6. Nothing to monitor: a CNN, an LSTM, and a GLU block whose gate is
    # named `gate` (its `value` sibling has the same shape: not a router).
    @member("nothing to monitor (CNN, LSTM, GLU `gate`)", attention=[], routers=[],
            level=logging.WARNING, says=["found NOTHING to monitor", "attention=[",
                                         "routers=[", "not routers: glu.gate",
                                         "value has the same shape"])
    def nothing():
        model = nn.Module()
        model.conv = nn.Conv2d(3, 8, 3)
        model.bn = nn.BatchNorm2d(8)
        model.lstm = nn.LSTM(8, 16)
        model.glu = nn.Module()
        model.glu.gate = nn.Linear(16, 4)
        model.glu.value = nn.Linear(16, 4)
        model.glu.out = nn.Linear(4, 16)
        model.head = nn.Linear(16, 10)
        model.heads_ = lambda: []
        model.routers_ = lambda: []
        return model

    # 7. Skipped: q/k/v/o with no head count anywhere (only d_model); a
    # DeepSpeed-style gate.wg router without a top-k attribute (default 2).
    class TopKGate(nn.Module):
        def __init__(self, d, n_exp):
            super().__init__()
            self.wg = nn.Linear(d, n_exp, bias=False)

    @member("skipped: no head count; DeepSpeed gate.wg without top_k",
            attention=[], routers=[(0, 4, 2), (1, 4, 2)], level=logging.WARNING,
            says=["SKIPPED attention blocks.0.attn, blocks.1.attn: q_proj/k_proj: head count "
                  "unknown", "q rows 32, k rows 32 do not determine it", "pass n_heads=",
                  "top-k assumed 2", "fix: pass top_k=", "blocks.0.moe.gate.wg"],
            fixed=dict(kw=dict(n_heads=4), attention=[(0, 4, 4, 8), (1, 4, 4, 8)]))
    def skipped():
        model = nn.Module()
        model.d_model = 32
        model.blocks = nn.ModuleList()
        for _ in range(2):
            b = nn.Module()
            b.attn = nn.Module()
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(b.attn, n, nn.Linear(32, 32, bias=False))
            b.moe = nn.Module()
            b.moe.gate = TopKGate(32, 4)
            b.moe.experts = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
            model.blocks.append(b)
        model.heads_ = lambda: [separate(b.attn.q_proj.weight, b.attn.k_proj.weight, 4, 4, 8)
                                for b in model.blocks]
        model.routers_ = lambda: [b.moe.gate.wg.weight for b in model.blocks]
        return model

    # 8. Megatron-style grouped linear_qkv: only the head dim (`hd`); H and Hkv
    # from linear_proj's input size (H*dh = 32 != d = 24).
    @member("grouped linear_qkv, head dim `hd` + linear_proj",
            attention=[(i, 4, 2, 8) for i in range(2)], routers=[], level=logging.INFO,
            says=["output projection input 32"])
    def megatron():
        model = nn.Module()
        model.decoder = nn.Module()
        model.decoder.layers = nn.ModuleList()
        for _ in range(2):
            b = nn.Module()
            b.self_attention = nn.Module()
            b.self_attention.hd = 8
            b.self_attention.linear_qkv = nn.Linear(24, (4 + 2 * 2) * 8)
            b.self_attention.linear_proj = nn.Linear(32, 24)
            model.decoder.layers.append(b)
        model.heads_ = lambda: [grouped(b.self_attention.linear_qkv.weight, 4, 2, 8)
                                for b in model.decoder.layers]
        model.routers_ = lambda: []
        return model

    # 9. Falcon-style multi-query: query_key_value + dense, num_heads and the
    # multi_query flag, no head dim (from dense's input size).
    @member("Falcon multi_query (query_key_value + dense)",
            attention=[(i, 4, 1, 8) for i in range(2)], routers=[], level=logging.INFO,
            says=["GQA 1 KV heads (4 query heads per KV head)"])
    def falcon():
        model = nn.Module()
        model.h = nn.ModuleList()
        for _ in range(2):
            b = nn.Module()
            b.self_attention = nn.Module()
            b.self_attention.num_heads, b.self_attention.multi_query = 4, True
            b.self_attention.query_key_value = nn.Linear(40, (4 + 2) * 8, bias=False)
            b.self_attention.dense = nn.Linear(32, 40, bias=False)
            model.h.append(b)
        model.heads_ = lambda: [grouped(b.self_attention.query_key_value.weight, 4, 1, 8)
                                for b in model.h]
        model.routers_ = lambda: []
        return model

    # 10. T5/Switch-style: q/k/v/o, head count in a dict config of the root;
    # router.classifier beside an experts ModuleDict, top-k `moe_top_k` in the
    # dict (a bare `k` there is not a top-k).
    @member("T5/Switch (dict config, router.classifier)",
            attention=[(i, 4, 4, 6) for i in range(2)], routers=[(0, 8, 1), (1, 8, 1)],
            level=logging.INFO, says=["config.num_heads", "config.moe_top_k"])
    def switch():
        model = nn.Module()
        model.config = {"num_heads": 4, "d_model": 20, "moe_top_k": 1, "k": 7}
        model.block = nn.ModuleList()
        for _ in range(2):
            b = nn.Module()
            b.attention = nn.Module()
            for n in ("q", "k", "v"):
                setattr(b.attention, n, nn.Linear(20, 24, bias=False))
            b.attention.o = nn.Linear(24, 20, bias=False)
            b.mlp = nn.Module()
            b.mlp.router = nn.Module()
            b.mlp.router.classifier = nn.Linear(20, 8, bias=False)
            b.mlp.experts = nn.ModuleDict({f"expert_{i}": nn.Linear(20, 20) for i in range(8)})
            model.block.append(b)
        model.heads_ = lambda: [separate(b.attention.q.weight, b.attention.k.weight, 4, 4, 6)
                                for b in model.block]
        model.routers_ = lambda: [b.mlp.router.classifier.weight for b in model.block]
        return model

    return members


def check_heads(name, specs, want, torch):
    got = [(s.layer, s.n_heads, s.n_kv_heads, s.head_dim) for s in specs]
    check(got == want, f"{name}: attention found {got} ({[s.name for s in specs]}), "
          f"expected {want}")


def check_rows(name, specs, hand, torch):
    """Each spec's per-head rows are the rows sliced by hand from the weight."""
    check(len(hand) == len(specs), f"{name}: {len(specs)} specs for {len(hand)} layers")
    for spec, (qs, ks) in zip(specs, hand):
        wq, wk = spec.get()
        dh, d = spec.head_dim, qs[0].shape[1]
        check(len(qs) == spec.n_heads and len(ks) == spec.n_kv_heads,
              f"{name}: {spec.name}: {spec.n_heads}/{spec.n_kv_heads} heads")
        check(tuple(wq.shape) == (spec.n_heads * dh, d) and
              tuple(wk.shape) == (spec.n_kv_heads * dh, d),
              f"{name}: {spec.name}: Wq {tuple(wq.shape)}, Wk {tuple(wk.shape)}")
        for h in range(spec.n_heads):
            check(torch.equal(wq[h * dh:(h + 1) * dh], qs[h]),
                  f"{name}: {spec.name}: query head {h} rows are not the layout's")
        for g in range(spec.n_kv_heads):
            check(torch.equal(wk[g * dh:(g + 1) * dh], ks[g]),
                  f"{name}: {spec.name}: key head {g} rows are not the layout's")


def check_member(torch, nn, F, foreshock, cap, name, build, exp):
    from foreshock.testing import RecordingTransport
    torch.manual_seed(len(name))
    model = build()
    # find_attention/find_routers and the Monitor agree.
    check_heads(name, foreshock.find_attention(model), exp["attention"], torch)
    n_cap = len(cap.records)
    mon = foreshock.Monitor(model, run="zoo", windows=(1,), every=1,
                            transport=RecordingTransport())
    summary = cap.records[n_cap:]
    check(len(summary) == 1, f"{name}: {len(summary)} log records at start, expected one: "
          f"{[r.getMessage() for r in summary]}")
    rec, text = summary[0], summary[0].getMessage()
    check(rec.levelno == exp["level"], f"{name}: summary at {rec.levelname}:\n{text}")
    for s in exp.get("says", []):
        check(s in text, f"{name}: summary does not say {s!r}:\n{text}")
    for s in exp.get("not_says", []):
        check(s not in text, f"{name}: summary says {s!r}:\n{text}")

    check_heads(name, mon.attention, exp["attention"], torch)
    if mon.attention:
        check_rows(name, mon.attention, model.heads_(), torch)

    got = [(r.layer, r.n_experts, r.top_k) for r in mon.routers]
    check(got == exp["routers"], f"{name}: routers found {got} "
          f"({[r.name for r in mon.routers]}), expected {exp['routers']}")
    check(got == [(r.layer, r.n_experts, r.top_k) for r in foreshock.find_routers(model)],
          f"{name}: find_routers disagrees with the Monitor")
    for spec, w in zip(mon.routers, model.routers_()):
        check(spec.get() is w or torch.equal(spec.get(), w), f"{name}: {spec.name}: get() is "
              "not the router weight")

    if exp.get("tokens"):
        x = torch.randn(3, 5, model.moes_[0].experts[0].in_features
                        if hasattr(model.moes_[0], "experts") else 32)
        with torch.no_grad():
            for moe in model.moes_:
                moe(x)
        mon.step(1)
        mon.close(10)
        rep = mon.transport.by_step()[1]
        toks = {t.layer: t for t in rep.router_tokens}
        check(sorted(toks) == [r.layer for r in mon.routers], f"{name}: token stats for "
              f"{sorted(toks)}")
        for spec in mon.routers:
            t = toks[spec.layer]
            w = spec.get().detach().double()
            z = x.reshape(-1, w.shape[1]).double() @ w.T
            load = torch.zeros(spec.n_experts, dtype=torch.float64)
            for row in z.topk(spec.top_k, dim=1).indices:
                load[row] += 1
            check(t.n_tok == 15 and list(t.load) == load.tolist(),
                  f"{name}: router {spec.layer}: n_tok {t.n_tok}, load {list(t.load)} vs "
                  f"{load.tolist()}")
    else:
        mon.close(10)

    fixed = exp.get("fixed")
    if fixed:
        n_cap = len(cap.records)
        mon = foreshock.Monitor(model, run="zoo", transport=RecordingTransport(), **fixed["kw"])
        mon.close(10)
        check_heads(name + f" with {fixed['kw']}", mon.attention, fixed["attention"], torch)
        check_rows(name + f" with {fixed['kw']}", mon.attention, model.heads_(), torch)
        fixed_text = cap.records[n_cap].getMessage()
        check("SKIPPED attention" not in fixed_text, f"{name}: still skipped with "
              f"{fixed['kw']}:\n{fixed_text}")
    print(f"  {name:62s} {len(exp['attention'])} attention, {len(exp['routers'])} routers; "
          f"summary {rec.levelname}", flush=True)
    return text


def check_optimizer_lr(torch, nn, foreshock):
    """Monitor(optimizer=) sends the rate a scheduler set when step() gets no
    lr=; an explicit lr= wins. The daemon's warm-up and `lr` rule need it."""
    from foreshock.testing import RecordingTransport
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4)
    rec = RecordingTransport()
    mon = foreshock.Monitor(model, run="lr", attention=[], routers=[], transport=rec,
                            optimizer=opt)
    want = {}
    for step in range(1, 4):
        opt.step()
        sched.step()
        want[step] = opt.param_groups[0]["lr"]
        mon.step(step, loss=1.0)
    mon.step(4, loss=1.0, lr=0.01)
    want[4] = 0.01
    mon.close(10)
    got = {s: r.scalars.get("lr") for s, r in rec.by_step().items()}
    check(got == want, f"lr sent per step {got}, want {want}")
    try:
        foreshock.Monitor(model, run="lr", attention=[], routers=[], transport=RecordingTransport(),
                          optimizer=object())
        check(False, "optimizer= without param_groups accepted")
    except ValueError:
        pass
    print(f"  optimizer=: the scheduler's rate is sent when step() has no lr= ({got})", flush=True)


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import foreshock
    torch.set_num_threads(1)
    cap = Capture()
    logger = logging.getLogger("foreshock")
    logger.addHandler(cap)
    logger.setLevel(logging.DEBUG)
    check_optimizer_lr(torch, nn, foreshock)
    members = zoo(torch, nn, F)
    check(len(members) >= 8, "zoo too small")
    shown = {}
    for name, build, exp in members:
        shown[name] = check_member(torch, nn, F, foreshock, cap, name, build, exp)
    for n in shown:
        if n.startswith(("skipped", "nothing", "user")):
            print(f"\n  summary logged for {n}:\n    " + shown[n].replace("\n", "\n    "),
                  flush=True)


if __name__ == "__main__":
    fstest.run_main(main)
