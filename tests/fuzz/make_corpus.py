"""Writes seed frames for the decoder fuzzer into a directory: Hellos (one
with every newer field: local_ranks, capabilities, resume_step, client_name,
detect_from_step, attempt), a scalar Report, a Report with a Gram and a
spectrum sketch, router sketches. With a second directory, seed recordings
for the recording fuzzer there too (FSC_RECORD_MAGIC, a Hello, reports, a
Bye; one cut short; one with a NaN time and a step of 2^63).
Usage: /usr/bin/python3 tests/fuzz/make_corpus.py SOURCE_DIR OUT_DIR [RECORDING_DIR]"""
import os
import struct
import subprocess
import sys
import tempfile


def main(source_dir, out_dir, rec_dir=None):
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
    h = f.hello
    h.protocol_version, h.run_id, h.rank, h.world_size = 1, "run-2", 3, 8
    h.attempt, h.resume_step, h.detect_from_step = 2, 40, 10
    h.client_name = "libforeshock/0.1.0"
    h.local_ranks.extend([2, 3])
    h.capabilities = 1
    h.model.n_layers, h.model.n_heads, h.model.n_kv_heads, h.model.d_head = 2, 4, 2, 8
    h.model.n_experts, h.model.top_k = 4, 2
    h.model.moe_layers.extend([1])
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
        with open(os.path.join(out_dir, f"seed-{i}"), "wb") as out:
            out.write(framed(fr))
    if rec_dir:
        write_recordings(pb, frames, rec_dir)


def framed(fr):
    body = fr.SerializeToString()
    return struct.pack(">I", len(body)) + body


def write_recordings(pb, frames, rec_dir):
    """A recording is FSC_RECORD_MAGIC, then frames: a Hello, its reports."""
    magic = b"FSREC01\n"
    hellos = [f for f in frames if f.WhichOneof("body") == "hello"]
    reports = [f for f in frames if f.WhichOneof("body") == "report"]
    bye = pb.Frame()
    bye.bye.SetInParent()
    timed = pb.Frame()
    timed.CopyFrom(reports[0])
    timed.report.step, timed.report.time_unix = 7, 1.7e9
    whole = magic + framed(hellos[1]) + b"".join(framed(r) for r in reports + [timed, bye])
    # What the daemon refuses even as a placeholder (issue 22): libforeshock
    # must refuse it at packing, or the fuzzer's placeholder check fires.
    nan, huge = pb.Frame(), pb.Frame()
    nan.CopyFrom(timed)
    nan.report.time_unix = float("nan")
    huge.CopyFrom(timed)
    huge.report.step = 1 << 63
    refused = magic + framed(hellos[0]) + framed(nan) + framed(huge) + framed(timed)
    os.makedirs(rec_dir, exist_ok=True)
    for name, data in (("plain", magic + framed(hellos[0]) + framed(reports[0])),
                       ("full", whole), ("cut", whole[:-7]), ("refused", refused)):
        with open(os.path.join(rec_dir, name), "wb") as out:
            out.write(data)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
