"""Writes seed frames for the decoder fuzzer into a directory: a Hello, a
scalar Report, a Report with a Gram and a spectrum sketch, router sketches.
Usage: /usr/bin/python3 tests/fuzz/make_corpus.py SOURCE_DIR OUT_DIR"""
import os
import struct
import subprocess
import sys
import tempfile


def main(source_dir, out_dir):
    tmp = tempfile.mkdtemp()
    proto = os.path.join(source_dir, "proto")
    subprocess.run(["protoc", f"--proto_path={proto}", f"--python_out={tmp}",
                    os.path.join(proto, "foreshock.proto")], check=True)
    sys.path.insert(0, tmp)
    import foreshock_pb2 as pb

    frames = []
    f = pb.Frame()
    f.hello.protocol_version = 1
    f.hello.run_id = "run-1"
    f.hello.rank = 1
    f.hello.world_size = 2
    f.hello.model.n_layers = 2
    frames.append(f)

    f = pb.Frame()
    f.report.seq, f.report.step = 1, 0
    f.report.scalars.loss = 2.5
    f.report.scalars.layer_weight_norm.extend([1.0, 2.0])
    frames.append(f)

    f = pb.Frame()
    r = f.report
    r.seq, r.step = 2, 10
    a = r.attention.add()
    a.layer, a.head, a.window = 0, 1, 10
    a.gram.dh = 2
    a.gram.ga = struct.pack("<10f", *range(10))
    a.gram.gb = struct.pack("<10f", *range(10))
    s = r.attention.add()
    s.layer, s.head, s.window = 1, 0, 10
    s.spectrum.d2.extend([3.0, 1.0, 0.5, 0.1])
    s.spectrum.d3.extend([0.2, 0.1])
    g = r.router_gram.add()
    g.layer, g.n_experts = 0, 2
    g.gram = struct.pack("<3f", 1.0, 0.5, 1.0)
    t = r.router_tokens.add()
    t.layer, t.n_experts, t.n_tok = 0, 2, 100
    t.sum_h, t.sum_h2, t.sum_lse2 = 60.0, 40.0, 9.0
    t.load.extend([60, 40])
    t.sum_p.extend([55.0, 45.0])
    frames.append(f)

    os.makedirs(out_dir, exist_ok=True)
    for i, fr in enumerate(frames):
        body = fr.SerializeToString()
        with open(os.path.join(out_dir, f"seed-{i}"), "wb") as out:
            out.write(struct.pack(">I", len(body)) + body)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
