"""What discovery costs at Monitor construction, against one plain forward
pass of the same probe batch on the same model (the reference, measured in
the same run).

Per model, CPU time of this process (time.process_time: a CPU clock, so a
busy machine slows the wall clock, not the figure), the median of --repeat
runs, one torch thread:
  forward    model(ids) under torch.no_grad(): the reference;
  names      foreshock.discover(model, observe=False): names and attributes;
  discover   foreshock.discover(model, example_input=the same batch): names
             plus the observed forward pass (observe.py: the torch function
             mode following every projection output, side effects undone);
and the ratios names/forward and discover/forward: what discovery adds is
about (discover - names) / forward extra forward passes.

Models: transformers classes built from configs (random weights, nothing
downloaded): LlamaForCausalLM at about 125M parameters (12 layers, d 768,
12 heads) and MixtralForCausalLM (8 layers, d 512, 8 experts top-2), plus
two zoo replicas (tests/integration/zoo) of other layouts, small. Runs
under the torch 2 venv (tests/python-venv.sh); the zoo members also under
Debian's torch 1.13 (--no-transformers).

    build-venv/bin/python tests/bench/bench_discovery.py [--repeat 5] [--no-transformers]
"""
import argparse
import logging
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(SOURCE, "client", "python"))
sys.path.insert(0, os.path.join(SOURCE, "tests", "integration"))

import torch  # noqa: E402

import foreshock  # noqa: E402

ZOO_MEMBERS = ("qwen2-moe", "t5")


def cpu_median(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def transformers_models():
    import transformers as tf
    llama = tf.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                           num_hidden_layers=12, num_attention_heads=12,
                           num_key_value_heads=12, max_position_embeddings=256)
    mixtral = tf.MixtralConfig(vocab_size=8000, hidden_size=512, intermediate_size=1024,
                               num_hidden_layers=8, num_attention_heads=8,
                               num_key_value_heads=4, num_local_experts=8,
                               num_experts_per_tok=2, max_position_embeddings=256)
    yield "transformers LlamaForCausalLM", tf.LlamaForCausalLM(llama)
    yield "transformers MixtralForCausalLM", tf.MixtralForCausalLM(mixtral)


def zoo_models():
    import zoo
    members = dict(zoo.members())
    for name in ZOO_MEMBERS:
        torch.manual_seed(0)
        model, inputs, _ = members[name]()
        yield f"zoo {name}", model, inputs


def measure(label, model, inputs, repeat):
    model.train()
    params = sum(p.numel() for p in model.parameters())

    def forward():
        with torch.no_grad():
            if isinstance(inputs, dict):
                model(**inputs)
            elif isinstance(inputs, tuple):
                model(*inputs)
            else:
                model(inputs)

    forward()  # first-call allocations out of the figures
    f = cpu_median(forward, repeat)
    n = cpu_median(lambda: foreshock.discover(model, observe=False), repeat)
    d = cpu_median(lambda: foreshock.discover(model, example_input=inputs), repeat)
    found = foreshock.discover(model, example_input=inputs)
    print(f"| {label} | {params / 1e6:.1f}M | {len(found.attention)} | {len(found.routers)} | "
          f"{f * 1e3:.0f} | {n * 1e3:.0f} | {d * 1e3:.0f} | {n / f:.2f} | {d / f:.2f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-transformers", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("foreshock").setLevel(logging.ERROR)
    print(f"torch {torch.__version__}, one thread, CPU time (median of {a.repeat})")
    print("| model | params | attention sites | routers | forward ms (reference) | "
          "names ms | discover ms | names / forward | discover / forward |")
    print("|---|---|---|---|---|---|---|---|---|")
    if not a.no_transformers:
        for label, model in transformers_models():
            ids = torch.randint(0, model.config.vocab_size, (1, 8))
            measure(label, model, ids, a.repeat)
            del model
    for label, model, inputs in zoo_models():
        measure(label, model, inputs, a.repeat)


if __name__ == "__main__":
    main()
