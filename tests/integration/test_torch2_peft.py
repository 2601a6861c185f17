"""Real PEFT adapters (torch 2.x venv, tests/python-venv.sh): LoRA
fine-tuning freezes the base weights, so the attention's Q/K update lives
only in the adapters; discovery must monitor the weight the forward
multiplies by (client/python/foreshock/effective.py), not the frozen base.

Each case wraps a small transformers class (random weights, nothing
downloaded) with peft.get_peft_model, moves every adapter parameter away
from its initial value (lora_B starts at zero, DoRA's magnitude at the
weight's norm: untouched, both would hide a wrong sum), and checks
foreshock.discover(model): one spec per attention with the class's H, Hkv
and dh, and get() equal (to float32 rounding) to the Q and K rows of the
weight PEFT itself produces when it merges the adapters into a copy
(merge_and_unload: PEFT's own sum, DoRA's rescaling included). Cases:
  llama-lora       LoRA on q/k/v_proj of LlamaForCausalLM (GQA 4/2)
  llama-dora       the same with use_dora=True
  llama-two        two adapters active at once (add_adapter, set_adapter)
  gpt2-conv1d      LoRA on GPT-2's fused c_attn, a Conv1D stored [in, out]
                   (fan_in_fan_out=True)
Then each trains STEPS AdamW steps of the adapters alone with Monitor
defaults into the real daemon: nothing may raise, every report is
acknowledged, no module is disabled, and the daemon holds per-head qk
series for every head.
"""
import copy
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402

D, H, HKV, DH, LAYERS, VOCAB, FFN = 32, 4, 2, 8, 2, 64, 64
STEPS, WINDOWS, EVERY = 8, (2, 4), 2
BATCH, SEQ = 2, 12
TOL = 1e-5  # float32: PEFT's merge and the client's sum round differently


def llama(transformers):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN,
                                   num_hidden_layers=LAYERS, num_attention_heads=H,
                                   num_key_value_heads=HKV, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def gpt2(transformers):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=D, n_layer=LAYERS, n_head=H,
                                  n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def llama_rows(model):
    """module name -> (H, Hkv, Wq, Wk) of a merged LlamaForCausalLM."""
    return {f"model.layers.{i}.self_attn": (H, HKV, b.self_attn.q_proj.weight,
                                            b.self_attn.k_proj.weight)
            for i, b in enumerate(model.model.layers)}


def gpt2_rows(model):
    """module name -> (H, H, Wq, Wk) of a merged GPT2LMHeadModel (c_attn
    stored [in, out]: q is its first D columns, k the next D)."""
    out = {}
    for i, b in enumerate(model.transformer.h):
        w = b.attn.c_attn.weight.t()
        out[f"transformer.h.{i}.attn"] = (H, H, w[:D], w[D:2 * D])
    return out


def perturb(torch, model, seed):
    """Every adapter parameter moved off its initial value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def build(torch, transformers, peft, name):
    """(peft model, the reference rows from PEFT's own merge)."""
    torch.manual_seed(3)
    if name == "gpt2-conv1d":
        base, rows = gpt2(transformers), gpt2_rows
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                              fan_in_fan_out=True)
    else:
        base, rows = llama(transformers), llama_rows
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                              use_dora=name == "llama-dora")
    model = peft.get_peft_model(base, cfg)
    if name == "llama-two":
        model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=4,
                                                    target_modules=["q_proj", "k_proj"]))
        model.base_model.set_adapter(["default", "second"])
    perturb(torch, model, 7)
    merged = copy.deepcopy(model).merge_and_unload()
    return model, rows(merged)


def compare(foreshock, torch, model, want):
    """Mismatches of discover(model) against the merged rows."""
    found = foreshock.discover(model)
    bad = []
    for mod, (h, kv, wq, wk) in want.items():
        mod = "base_model.model." + mod  # the PeftModel's names of the merged model's module
        a = [s for s in found.attention if s.name == mod or s.name.startswith(mod + ".")]
        if len(a) != 1:
            bad.append(f"{mod}: {len(a)} specs ({[s.name for s in found.attention]})")
            continue
        a = a[0]
        if (a.n_heads, a.n_kv_heads, a.head_dim) != (h, kv, DH):
            bad.append(f"{mod}: H/Hkv/dh {a.n_heads}/{a.n_kv_heads}/{a.head_dim}, "
                       f"want {h}/{kv}/{DH}")
            continue
        gq, gk = a.get()
        for side, got, ref in (("Q", gq, wq), ("K", gk, wk)):
            err = (got.detach() - ref.detach()).abs().max().item()
            if got.shape != ref.shape or err > TOL:
                bad.append(f"{mod}: {side} rows differ from PEFT's merged weight "
                           f"(max abs diff {err:.3g})")
    if len(found.attention) != len(want):
        bad.append(f"{len(found.attention)} attention specs, want {len(want)}")
    if found.routers:
        bad.append(f"routers found in a dense model: {[r.name for r in found.routers]}")
    return found, bad


def train(torch, foreshock, model, name, daemon):
    """STEPS AdamW steps on the trainable (adapter) parameters."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    mon = foreshock.Monitor(model, endpoint=daemon.endpoint, run=name, windows=WINDOWS,
                            every=EVERY, optimizer=opt)
    g = torch.Generator().manual_seed(11)
    model.train()
    for step in range(1, STEPS + 1):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(step, loss=out.loss)
    return mon.close(60), mon.discovery


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python", "experiments"))
    os.environ["FORESHOCK_LIB"] = os.path.join(os.path.abspath(args.build_dir), "libforeshock.so")
    import torch
    try:
        import peft
        import transformers
    except ImportError:
        raise fstest.Skip(f"peft or transformers is not installed for {sys.executable} (the "
                          "torch 2.x venv: tests/python-venv.sh, cmake -DFORESHOCK_VENV_PYTHON=...)")
    import foreshock
    from fsapi import Api
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    print(f"  torch {torch.__version__}, transformers {transformers.__version__}, "
          f"peft {peft.__version__}", flush=True)
    daemon = fstest.Daemon(args.build_dir, workdir)
    api = Api(daemon.http)
    failures = []
    try:
        for name in ("llama-lora", "llama-dora", "llama-two", "gpt2-conv1d"):
            model, want = build(torch, transformers, peft, name)
            found, bad = compare(foreshock, torch, model, want)
            failures += [f"{name}: {b}" for b in bad]
            print(f"  {name}: {len(found.attention)} attention specs, "
                  f"{'exact' if not bad else f'{len(bad)} mismatch(es)'}", flush=True)
            st, disc = train(torch, foreshock, model, name, daemon)
            check(st["acked"] == STEPS and st["dropped"] == 0 and
                  not st.get("disabled_modules"),
                  f"{name}: training with the Monitor: {st}")
            heads = {(a.layer, a.head_offset + h) for a in disc.attention
                     for h in range(a.n_heads)}
            last = STEPS - STEPS % EVERY

            def have(name=name, heads=heads):
                vals = api.values(name, name="qk.d2.erank")
                return {(int(k[1]), int(k[2])) for k, pts in vals.items() if last in pts} == heads
            fstest.wait_until(have, 60, f"{name}: the daemon's qk series at step {last} for "
                              f"heads {sorted(heads)}", 0.2)
        check(not failures, "discovery differs from PEFT's merged weights:\n  " +
              "\n  ".join(failures))
        check(daemon.stop() == 0, "daemon did not exit 0")
    finally:
        fstest.kill_started(daemon)


if __name__ == "__main__":
    fstest.run_main(main)
