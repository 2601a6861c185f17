"""foreshock.Monitor: two lines in a training loop.

    mon = foreshock.Monitor(model, endpoint="127.0.0.1:7781", run="exp-42")
    for step in ...:
        ... loss.backward(); optimizer.step()
        mon.step(step, loss=loss, grad_norm=gn, lr=lr)
    mon.close()

What step() does on the training thread (the measured overhead):
  - every `every` steps, for each window delta whose base snapshot exists,
    the Gram sketches of every attention head from W(t) and the snapshot
    W(t - delta), batched over heads, on the weights' device;
  - the router Grams and the per-layer |W| / update ratio at those steps;
  - a copy (a clone on the device) of the Q/K/router weights at the steps
    that a later sketch will use as its base;
  - with a sharded model, one async all_reduce of all partial Grams over
    the trainer's `shard_group` (or each rank sends its partial Grams and
    the daemon sums them: shard_reduce="daemon");
  - hands the device tensors to a background thread and returns. On CUDA
    the device-to-host copies are queued on the current stream into
    pinned memory and the thread waits on an event, so step() never
    synchronises with the GPU; loss/grad_norm may be passed as tensors
    for the same reason.
The background thread turns the tensors into a report and gives it to
libforeshock. On the spectrum route (the default wherever a rank holds
whole heads, or sums the d-shards of its Grams itself) it first computes
each head's spectra from its Grams (foreshock.spectra), so that a report
carries a few KB per head instead of two Gram triangles. By default
(spectra_on="host") they are solved on the host CPU: the Grams are copied
into pinned memory on a CUDA stream of the Monitor's own (ordered after the
Grams by an event; the training stream does not wait for the copy), and a
pool of `spectra_threads` threads, one OpenMP thread each, solves them in
float64, one attention spec per task. The eigenvalue solves on the GPU
(spectra_on="device": on that side stream) compete with training for SMs
and host syncs (client/python/README.md "Where it runs" has the
measurement); on the CPU they do not. With spectra_on="device" at most
`device_sketches` sketch steps wait on the device; past that bound a sketch
step's spectra are solved on the host. stats()["spectra_on_host"] counts
the sketch steps solved on the host. The background thread hands the
report to libforeshock, whose own I/O thread sends it. When the daemon is down,
reports wait in libforeshock's bounded replay buffer (replay_bytes); past
that bound a report is dropped, counted (stats()["dropped"]) and logged.
When the hand-off queue itself is full (the background thread cannot keep
up), the report is dropped and counted as "dropped_queue". Training never
waits for either.

Router token statistics are gathered by forward hooks on the routers into
device tensors (no host sync per layer) and sent, summed since the last
sketch step, with each sketch.

Nothing here raises into the training loop once Monitor(...) has returned
(step, flush, close, stats, advice, the router hooks that run inside the
model's forward, the sender thread): every stage runs under _guarded. A
failure that belongs to one monitored module (reading its weights, its
Grams, its spectra, its router hook, packing its sketches) disables that
module only, logged once at WARNING with the module's name and the error;
the others are still monitored. A failure of a whole stage (discovery, the
hand-off of a step, a report the transport refuses) is counted, logged at
most once per LOG_INTERVAL_S, and the step's report is dropped. Both show
in stats(): "failures" (counts by stage) and "disabled_modules". The one
exception that still propagates is the user's own on_advice handler's
(advice.py says why).
"""
import ctypes
import errno
import gc
import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import dtensor
from . import sketch as sk
from .advice import AdviceInbox
from .layouts import Discovery, discover, ranges_text
from . import spectra as spx
from ._lib import MAX_OPTIMIZER_LEN, optimizer_name_ok
from .report import AttentionGram, AttentionSpectrum, Report, RouterGram, RouterTokens

log = logging.getLogger("foreshock")

DEFAULT_PORT = 7781
DEFAULT_QUEUE_REPORTS = 1024       # hand-off queue between step() and the sender thread
DEFAULT_REPLAY_BYTES = 64 << 20    # libforeshock's replay buffer
DEFAULT_DEVICE_SKETCHES = 2        # sketch steps whose Grams may wait on the device for spectra
MAX_DEFAULT_SPECTRA_THREADS = 4    # default CPU threads solving spectra: min(this, cpu count)
ROUTES = ("spectrum", "gram")
SPECTRA_ON = ("host", "device")    # where the spectrum route solves spectra of CUDA Grams
LOG_INTERVAL_S = 10.0              # at most one drop/connection complaint per interval
_SCALARS = ("loss", "grad_norm", "lr", "loss_scale", "tokens", "step_time")
# Where a failure can happen, the keys of stats()["failures"]. Per module:
# sketch (reading the weights, snapshots, Grams, on the training thread),
# spectrum (the sender's solves), hook (a router's forward hook), pack
# (turning one module's results into report entries). Whole step:
# discovery, step (the training-thread hand-off), send (a report the
# transport refused or that could not be built), advice (reading advice).
STAGES = ("discovery", "sketch", "spectrum", "hook", "pack", "step", "send", "advice")
_FAILED = object()  # what _guarded returns when fn raised
# torch._foreach_copy_ (torch >= 2.1), looked up once: a getattr of a name
# the torch module lacks goes through its module __getattr__ and the import
# system (file-system stats) on every call, every training step.
_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)


# Wrappers that trainers put around the user's torch optimizer, by the name
# of a class in the wrapper's MRO (no import of their packages), and the
# attribute holding the optimizer inside: accelerate's (what the HF Trainer
# passes its callbacks), Lightning's (a class made per optimizer,
# "LightningAdamW", whose MRO holds LightningOptimizer), DeepSpeed's ZeRO and
# mixed-precision optimizers, torch's ZeroRedundancyOptimizer.
OPTIMIZER_WRAPPERS = {"AcceleratedOptimizer": "optimizer", "LightningOptimizer": "_optimizer",
                      "DeepSpeedOptimizer": "optimizer", "ZeroRedundancyOptimizer": "optim"}
MAX_OPTIMIZER_WRAPPING = 8         # wrappers peeled at most (a cycle ends there)
_optimizer_names_warned = set()    # class names refused once already, for the whole process
_optimizer_names_lock = threading.Lock()


def _unwrapped_optimizer(optimizer):
    """The optimizer inside the wrappers of OPTIMIZER_WRAPPERS; optimizer
    itself when it is none of them."""
    for _ in range(MAX_OPTIMIZER_WRAPPING):
        attr = next((OPTIMIZER_WRAPPERS[c.__name__] for c in type(optimizer).__mro__
                     if c.__name__ in OPTIMIZER_WRAPPERS), None)
        inner = getattr(optimizer, attr, None) if attr else None
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def optimizer_class_name(optimizer):
    """The class name of the torch optimizer a trainer steps (inside its
    wrappers), as Hello's model shape carries it; None when there is none
    or the name cannot go (over MAX_OPTIMIZER_LEN characters, not printable
    ASCII: said once per name with a warning). Never raises."""
    if optimizer is None:
        return None
    try:
        name = type(_unwrapped_optimizer(optimizer)).__name__
    except Exception as e:  # a wrapper's attribute that raised: the name is not worth a step
        log.warning("foreshock: the optimizer's class name is not sent: unwrapping %s "
                    "failed with %s: %s", type(optimizer).__name__, type(e).__name__, e)
        return None
    if optimizer_name_ok(name):
        return name
    with _optimizer_names_lock:
        first = name not in _optimizer_names_warned
        _optimizer_names_warned.add(name)
    if first:
        log.warning("foreshock: the optimizer's class name %r is not sent (the daemon takes "
                    "1..%d printable ASCII characters); pass optimizer_name= to name it",
                    name, MAX_OPTIMIZER_LEN)
    return None


def optimizer_of_model(model):
    """The class name of the torch optimizer that steps model's parameters,
    found among the live objects when the Monitor is given no optimizer=
    (an optimizer made before the Monitor, as most loops make it); None
    when there is none, or when optimizers of different classes share the
    parameters (Muon for matrices and AdamW for the rest: nothing is said
    rather than half of it). One pass over gc.get_objects(), at
    construction and, when that found none, once more at the first step().
    Never raises."""
    try:
        ids = {id(p) for p in model.parameters()}
        names = set()
        for o in gc.get_objects():
            # type(), not isinstance(): isinstance reads o.__class__, which
            # some lazy or deprecated objects answer with a warning.
            if issubclass(type(o), torch.optim.Optimizer) and any(
                    id(p) in ids for g in o.param_groups for p in g.get("params", ())):
                names.add(optimizer_class_name(o))
    except Exception as e:  # a foreign object's param_groups that raised
        log.info("foreshock: the optimizer was not looked for: %s: %s", type(e).__name__, e)
        return None
    names.discard(None)
    if len(names) > 1:
        log.info("foreshock: optimizers of classes %s step the model: none is named "
                 "(optimizer= or optimizer_name= says which)", sorted(names))
    return names.pop() if len(names) == 1 else None


_OMP_SETTERS = None   # omp_set_num_threads of each OpenMP runtime loaded, found once


def _omp_setters():
    """omp_set_num_threads of the OpenMP runtimes this process has loaded
    (torch's intra-op pool and its BLAS run on one of them); [] where
    /proc/self/maps is not there."""
    global _OMP_SETTERS
    if _OMP_SETTERS is None:
        found = []
        try:
            with open("/proc/self/maps") as f:
                paths = sorted({line.split()[-1] for line in f
                                if any(n in line for n in ("libgomp", "libiomp", "libomp"))})
        except OSError:
            paths = []
        for path in paths:
            if not path.startswith("/"):
                continue
            try:
                found.append(ctypes.CDLL(path).omp_set_num_threads)  # already loaded: no new load
            except (OSError, AttributeError):
                pass
        _OMP_SETTERS = found
    return _OMP_SETTERS


def _one_omp_thread():
    """A spectra worker's initializer: this thread's parallel regions get
    one thread. The OpenMP thread count is per thread (omp_set_num_threads
    sets the calling thread's), so neither the trainer's threads nor
    torch.get_num_threads() there change, as they would with
    torch.set_num_threads, which also sets the count every new thread
    starts from. torch.get_num_threads() first: torch sets a thread's count
    when the thread first asks, which would undo ours. Never raises."""
    try:
        torch.get_num_threads()
        for setter in _omp_setters():
            setter(1)
    except Exception:
        pass


def parse_endpoint(endpoint):
    """'host:port', 'host' or ':port' -> (host, port)."""
    if endpoint is None:
        return "127.0.0.1", DEFAULT_PORT
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        return endpoint, DEFAULT_PORT
    return (host or "127.0.0.1"), int(port)


_LOOPBACK = ("localhost", "::1", "[::1]")


def _is_loopback(host):
    return host in _LOOPBACK or host.startswith("127.")


def parse_ranks(text, world_size):
    """'4-7,9' -> [4, 5, 6, 7, 9] (sorted, distinct, each below world_size)."""
    out = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        lo = int(lo)
        hi = int(hi) if sep else lo
        if lo > hi or hi >= world_size:
            raise ValueError(f"local ranks '{text}': {part} is not within 0..{world_size - 1}")
        out.update(range(lo, hi + 1))
    return sorted(out)


def _torchrun_group(rank, world_size):
    """This node's ranks from torchrun's environment, or None."""
    try:
        local_rank = int(os.environ["LOCAL_RANK"])
        local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    first = rank - local_rank
    if local_world < 1 or first < 0 or first + local_world > world_size:
        return None
    return list(range(first, first + local_world))


def resolve_local_ranks(arg, endpoint, rank, world_size, node=None):
    """The local group to declare (a sorted list), or None. See Monitor;
    node: this node's ranks as a launcher other than torchrun knows them
    (Monitor's node_ranks), else torchrun's environment gives them."""
    if arg is None:
        env = os.environ.get("FORESHOCK_LOCAL_RANKS")
        if env:
            arg = False if env.strip().lower() == "none" else env
    if arg is None:
        if endpoint is None or world_size <= 1 or not _is_loopback(parse_endpoint(endpoint)[0]):
            return None
        group = node or _torchrun_group(rank, world_size)
        if group is None:
            log.warning("foreshock: rank %d of %d streams to a daemon on this node (%s) but "
                        "LOCAL_RANK/LOCAL_WORLD_SIZE are not set: pass local_ranks= (or set "
                        "FORESHOCK_LOCAL_RANKS), else router token statistics wait for ranks "
                        "this daemon never hears", rank, world_size, endpoint)
            return None
        return group if len(group) < world_size else None
    if arg is False or (not isinstance(arg, str) and not arg):
        return None
    if arg == "node":
        group = node or _torchrun_group(rank, world_size)
        if group is None:
            raise ValueError("local_ranks='node' needs torchrun's LOCAL_RANK and "
                             "LOCAL_WORLD_SIZE")
    elif isinstance(arg, str):
        group = parse_ranks(arg, world_size)
    else:
        group = sorted({int(r) for r in arg})
        if group[0] < 0 or group[-1] >= world_size:
            raise ValueError(f"local_ranks must be within 0..{world_size - 1}")
    if rank not in group:
        raise ValueError(f"local_ranks {ranges_text(group)} does not include this rank {rank}")
    return group


def _tls_args(tls, ca, cert, key, name):
    """The Client's TLS keywords from the arguments, else the environment."""
    env = os.environ.get
    ca = ca or env("FORESHOCK_TLS_CA") or None
    cert = cert or env("FORESHOCK_TLS_CERT") or None
    key = key or env("FORESHOCK_TLS_KEY") or None
    if tls is None:
        tls = env("FORESHOCK_TLS", "").lower() in ("1", "true", "yes")
    on = bool(tls or ca or cert or key or name)
    return {"tls": on, "tls_ca": ca, "tls_cert": cert, "tls_key": key,
            "tls_server_name": name} if on else {}


class _RateLimited:
    def __init__(self, interval):
        self.interval, self.last, self.suppressed = interval, -1e18, 0

    def __call__(self, level, msg, *args):
        now = time.monotonic()
        if now - self.last < self.interval:
            self.suppressed += 1
            return
        if self.suppressed:
            msg += " (%d similar messages suppressed)"
            args = args + (self.suppressed,)
        self.last, self.suppressed = now, 0
        log.log(level, msg, *args)


class _Deferred:
    """The libforeshock client, opened at the first step() when discovery
    waits for the first batch (its Hello carries the model shape)."""

    def __init__(self, make):
        self._make, self._t, self._error = make, None, None

    def open(self):
        """The client, made once; None when making it failed (logged once,
        and every report is then dropped and counted: step() never raises)."""
        if self._t is None and self._error is None:
            try:
                self._t = self._make()
            except Exception as e:
                self._error = e
                log.error("foreshock: could not open the connection to the daemon at the "
                          "first step: %s; reports of this run are dropped", e)
        return self._t

    def submit(self, rep):
        t = self.open()
        return t.submit(rep) if t is not None else -errno.EIO

    def stats(self):
        if self._t is not None:
            return self._t.stats()
        return {"last_error": str(self._error)} if self._error is not None else {}

    def flush(self, timeout_s=None):
        if self._t is not None:
            return self._t.flush(timeout_s)
        return -errno.EIO if self._error is not None else 0

    def close(self, timeout_s=0):
        if self._t is not None:
            self._t.close(timeout_s)

    def poll_advice(self):
        poll = getattr(self._t, "poll_advice", None)
        return poll() if poll is not None else []


# Pinned host buffers a Monitor keeps for its device-to-host copies (each
# the size of one sketch step's Grams: ~135 MB for 256 heads of 128 and two
# windows in float32, twice that in float64 with shard_reduce="trainer").
# Allocated lazily and reused: cudaHostAlloc of that size is slow and
# synchronises, so steady state must never call it.
PINNED_KEEP = 2
# Default bound of sketch jobs staged and not yet sent, on a CUDA model: a
# sketch step beyond it skips its Grams (sketches_skipped_busy), so the
# pinned pool always has a buffer and the sender never falls further behind.
DEFAULT_SKETCHES_IN_FLIGHT = PINNED_KEEP


class _Job:
    """What step() hands to the sender thread."""
    __slots__ = ("step", "time", "scalars", "attn", "routers", "tokens", "norms", "flat",
                 "layout", "work", "event", "on_device", "flags", "pinned", "in_flight")

    def __init__(self, step, t, scalars):
        self.step, self.time, self.scalars = step, t, scalars
        self.attn, self.routers, self.tokens = [], [], []
        self.norms = None
        self.flags = None  # [n_modules] float64, shard_reduce="trainer" only (_sketch)
        self.flat, self.layout, self.work, self.event = None, None, None, None
        self.on_device = False  # flat stays on the device for the sender's spectra
        self.pinned = None      # the pinned pool's buffer (uint8) flat is a view of
        self.in_flight = False  # counted in Monitor._sketch_jobs until released


def _call_kwargs(module):
    """torch 1.x hands a forward pre-hook the positional inputs only: the
    keyword arguments of the call are those of the Module._call_impl frame
    running the hook (None when that frame is not found)."""
    f = sys._getframe(2)  # _call_kwargs <- the hook <- Module._call_impl
    for _ in range(3):
        if f is None:
            return None
        if f.f_code.co_name == "_call_impl" and f.f_locals.get("self") is module:
            kw = f.f_locals.get("kwargs")
            return dict(kw) if isinstance(kw, dict) else None
        f = f.f_back
    return None


def _stack64(xs, dev):
    """0-d tensors xs as one float64 vector on dev: one stack and one
    conversion when they share a dtype and device (the usual case), one
    conversion each otherwise."""
    x0 = xs[0]
    if all(x.dtype == x0.dtype and x.device == x0.device for x in xs):
        return torch.stack(xs).to(dev, torch.float64)
    return torch.stack([x.to(dev, torch.float64) for x in xs])


def _clone(w):
    """A snapshot of one module's weights (a tensor or a (wq, wk) pair)."""
    if isinstance(w, tuple):
        return tuple(t.detach().clone() for t in w)
    return w.detach().clone()


def _norm_row(cur, old):
    """[3]: squared |W(t)|, |W(t)-W(t0)|, |W(t0)| of one module's tensors."""
    cur = cur if isinstance(cur, tuple) else (cur,)
    old = old if isinstance(old, tuple) else (old,)
    row = None
    for c, o in zip(cur, old):
        c64, o64 = c.detach().double(), o.detach().double()
        r = torch.stack([(c64 * c64).sum(), ((c64 - o64) ** 2).sum(), (o64 * o64).sum()])
        row = r if row is None else row + r.to(row.device)
    return row


def _router_tokens(r, acc):
    """One router's token statistics since the last sketch step."""
    sums = acc.sums.cpu().numpy()
    return RouterTokens(r.layer, r.n_experts, acc.n_tok, float(sums[0]), float(sums[1]),
                        float(sums[2]), acc.load.cpu().numpy().astype(np.uint64),
                        acc.sum_p.cpu().numpy().astype(np.float64))


def _zero_grams(a, dtype, device):
    """The Grams' slot of an attention spec that was not sketched."""
    t = a.head_dim * (2 * a.head_dim + 1)
    return (torch.zeros(a.n_heads, t, dtype=dtype, device=device),
            torch.zeros(a.n_kv_heads, t, dtype=dtype, device=device))


class Monitor:
    """Streams one rank's sketches of `model` to foreshockd.

    endpoint     "host:port" of the daemon's ingest listener (default
                 $FORESHOCK_ENDPOINT, else 127.0.0.1:7781; with record= and
                 neither, nothing is sent: the run is only recorded)
    record       also write every report this rank produces to this file,
                 whether or not a daemon is reachable (default
                 $FORESHOCK_RECORD); `foreshock replay FILE` streams it into a
                 daemon later. With world_size > 1, "{rank}" in the path is
                 replaced by the rank, else ".rankR" is appended. The file
                 holds no token.
    run          run id (1..128 of [A-Za-z0-9._:-]); default $FORESHOCK_RUN
    rank, world_size  stream identity; default from torch.distributed
    local_ranks  the ranks of the job that this daemon hears (its local group,
                 this rank included): a daemon per node reduces router token
                 statistics over exactly these and detects loss/grad_norm/lr
                 from the lowest of them (which also sends the attention and
                 router sketches by default). Default $FORESHOCK_LOCAL_RANKS
                 ("4-7" or "none"), else: with a loopback endpoint (a daemon on
                 this node can only hear this node) and world_size > 1, the
                 node's ranks from torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE;
                 otherwise none (the daemon hears every rank). "node" asks for
                 the torchrun group whatever the endpoint; False or () for none
    node_ranks   this node's ranks (a list) where the launcher is not torchrun,
                 for local_ranks' default and "node" (the Lightning callback
                 passes its trainer's: Lightning's launcher does not set
                 LOCAL_WORLD_SIZE); default torchrun's LOCAL_RANK and
                 LOCAL_WORLD_SIZE
    attempt      bump it when a crashed trainer restarts the same run
    resume_step  with attempt bumped: this attempt restarts from a checkpoint
                 taken at this step (the steps after it are re-done); the
                 daemon evaluates them as this attempt's, from the run's
                 state at that step (docs/alerting.md "Rewind")
    on_advice    fn(advice) called on the training thread, inside step(),
                 for each advice the daemon sends (foreshock.advice; the
                 common handler is foreshock.Rescue(save))
    advice       take advice from the daemon (default True); without
                 on_advice it collects in Monitor.advice
    windows      window lengths delta in steps (each a sketch of W(t) vs W(t-delta));
                 default a short and a long one, (10, 50): a biased fault
                 grows like the window, minibatch noise like its root, so
                 the long window sees a slow fault sooner; the daemon counts
                 persistence in disjoint windows, so overlap fakes nothing
    every        sketch cadence in steps (default: the smallest window)
    attention    list of AttentionSpec instead of discovery (layouts.py)
    routers      list of RouterSpec instead of discovery; [] for none
    layers       only these layer indices (default: all found)
    example_input  the model's input for the one observed forward pass of
                 discovery (a tensor, a tuple of arguments or a dict of
                 keyword arguments), run at construction. Without it a probe
                 batch is tried; when none runs, the pass waits for the first
                 step() and uses the first batch the model saw (the daemon is
                 then connected at that step). observe=False: names only.
                 client/python/README.md "What it finds and how"
    n_heads, n_kv_heads, head_dim, top_k   fallbacks when modules do not say
    shard_group  torch.distributed group over which the model dimension d of
                 the monitored weights is split (each rank's accessor returns
                 its slice of columns)
    shard        (index, count) of this rank's slice when not using a group
    shard_reduce "trainer": all_reduce partial Grams over shard_group and
                 send them once (from the group's rank 0); "daemon": every
                 rank sends its partial Grams with (shard_index, shard_count)
    route        "spectrum": the sender computes each head's Delta1/Delta2/
                 Delta3/K spectra, norms and c_qk from the Grams (on the
                 host CPU: spectra_on; foreshock.spectra) and sends spectrum
                 sketches, a few KB per head; "gram": sends the Grams and the
                 daemon solves. Both give the same series. Default: spectrum
                 when the model is on an accelerator (GPU) and this rank holds
                 whole heads or reduces its shards itself; gram for a model on
                 the CPU (the solves would take the trainer's own cores: about
                 35 ms a head at dh 128 there, 15-20 ms in the daemon) and when
                 the daemon sums the d-shards (the only choice then).
    spectra_on   where the spectrum route solves the spectra of Grams on a
                 GPU: "host" (default): copied to pinned host memory and
                 solved on the CPU by spectra_threads threads; "device": on
                 the GPU, on the sender's own CUDA stream (the solves then
                 slow training down: client/python/README.md "Where it
                 runs"). A model on the CPU solves on the CPU either way
    spectra_threads  CPU threads solving spectra, one attention spec each at a
                 time, each with one OpenMP thread (default: min(4, the CPU
                 count)); the user's torch thread count is not changed
    device_sketches  with spectra_on="device": sketch steps whose Grams may
                 wait on the device for the sender's spectra (default 2);
                 beyond it they go to pinned host memory and are solved on
                 the CPU
    send_sketches  whether this rank sends Grams (default: rank 0 when the
                 weights are replicated; the reducing rank or every shard
                 otherwise). Data-parallel replicas of a sharded group should
                 pass False on all but one replica.
    send_tokens  whether this rank sends router token statistics (default
                 True: every data-parallel rank sees its own tokens)
    layer_norms  send per-layer |W| and update ratio of the monitored
                 weights (Q, K and router of the layer) at sketch steps
    step_ratio   send every step's update-to-weight ratio over the monitored
                 weights that moved (frozen ones left out; 0 for a step that
                 moved none), |W(t) - W(t-1)| / |W(t-1)| (default True, on the
                 rank that sends sketches): a step 10x too large shows in its
                 first step, not at the next sketch. Costs one copy of the
                 monitored weights (Q, K, router rows) and a difference norm
                 per step, on their device. Not on DTensor (FSDP2 / tensor
                 parallel) weights: reading them whole is a collective, and
                 a per-step gather is not worth a step's time
    detect_from_step  detection starts at this step; default: the daemon judges by
                 training progress (3x the end of the LR warm-up, so pass lr=
                 or optimizer=)
    optimizer    the training optimizer: when step() gets no lr=, the learning
                 rate of its first param group is sent (what a scheduler set).
                 The daemon needs it to find the end of warm-up and for its
                 `lr` rule (a rate rising after warm-up). Its class name
                 ("SGD", "AdamW"; the torch optimizer inside accelerate's,
                 Lightning's, DeepSpeed's or ZeroRedundancyOptimizer's
                 wrapper) goes in the Hello's model shape, so that the daemon
                 knows a plain rate x gradient update from an adaptive one; a
                 name the daemon would refuse (over 64 characters, not
                 printable ASCII) is left out with a warning
    optimizer_name  the optimizer's name to send instead (a str of 1..64
                 printable ASCII characters, else ValueError), for an
                 optimizer= whose class name says little, or without one.
                 Neither given: the class of the torch optimizer stepping
                 the model's parameters is sent, when one class does (looked
                 for among the live objects at construction; when none is
                 found there, once more at the first step(), and the
                 connection then opens at the first report: an optimizer
                 made after the Monitor is found too)
    tls, tls_ca, tls_cert, tls_key, tls_server_name
                 TLS to a daemon whose ingest has tls_cert (a daemon for the whole
                 job, reached over the network): tls_ca is the PEM CA its
                 certificate must chain to (default $FORESHOCK_TLS_CA, else the
                 system's store), tls_cert/tls_key this rank's client
                 certificate for a daemon with tls_client_ca (default
                 $FORESHOCK_TLS_CERT / $FORESHOCK_TLS_KEY), tls_server_name the
                 name to verify (default the endpoint's host). Any of them, or
                 tls=True, or $FORESHOCK_TLS=1, turns TLS on
    replay_bytes libforeshock's bound on buffered, unacknowledged reports
    queue_reports  bound of the hand-off queue to the sender thread
    gram_dtype   torch.float32 (default) or torch.float64
    sketches_in_flight  most sketch steps staged and not yet sent (the
                 sender solves spectra and sends): a sketch step beyond it
                 sends its scalars but not its Grams, counted in stats()
                 sketches_skipped_busy, so the training thread never waits
                 and never pins a new buffer. Default: PINNED_KEEP on a CUDA
                 model, no bound on the CPU (queue_reports bounds memory).
                 Not applied with shard_reduce="trainer" or DTensor weights
                 (collectives: every rank must sketch the same steps)
    transport    object with submit(Report) -> int, stats() -> dict,
                 flush(timeout_s) -> int, close(timeout_s) (tests); default
                 a libforeshock client (ctypes)
    lib          path of libforeshock.so (default: see _lib.load)
    backoff_max_s  longest wait between reconnect attempts (default 5 s)
    """

    def __init__(self, model, endpoint=None, run=None, rank=None, world_size=None, attempt=0,
                 windows=(10, 50), every=None, attention=None, routers=None, layers=None,
                 n_heads=None, n_kv_heads=None, head_dim=None, top_k=None, shard_group=None,
                 shard=None, shard_reduce="trainer", send_sketches=None, send_tokens=True,
                 layer_norms=True, step_ratio=True, token=None, detect_from_step=None,
                 replay_bytes=DEFAULT_REPLAY_BYTES, queue_reports=DEFAULT_QUEUE_REPORTS,
                 gram_dtype=torch.float32, transport=None, lib=None, client_name=None,
                 backoff_max_s=None, record=None, optimizer=None, route=None,
                 device_sketches=DEFAULT_DEVICE_SKETCHES, local_ranks=None, tls=None,
                 tls_ca=None, tls_cert=None, tls_key=None, tls_server_name=None,
                 on_advice=None, advice=True, resume_step=None, example_input=None,
                 observe=True, spectra_on="host", spectra_threads=None,
                 sketches_in_flight=None, node_ranks=None, optimizer_name=None):
        dist = torch.distributed
        ddp = dist.is_available() and dist.is_initialized()
        self._fail_lock = threading.Lock()
        self._failures = dict.fromkeys(STAGES, 0)
        self._disabled = {}          # ("a"|"r", index) -> "stage: error", never re-enabled
        self._complain_fail = _RateLimited(LOG_INTERVAL_S)
        self._closed_warned = False
        self.rank = rank if rank is not None else (dist.get_rank() if ddp else 0)
        self.world_size = world_size if world_size is not None else (
            dist.get_world_size() if ddp else 1)
        self.run = run or os.environ.get("FORESHOCK_RUN")
        if not self.run:
            raise ValueError("foreshock.Monitor: run= (or $FORESHOCK_RUN) is required")
        self.windows = sorted({int(w) for w in windows})
        if not self.windows or self.windows[0] < 1:
            raise ValueError("windows must be positive step counts")
        self.every = int(every or self.windows[0])
        if self.every < 1:
            raise ValueError("every must be >= 1")
        self.gram_dtype = gram_dtype
        if optimizer is not None and not getattr(optimizer, "param_groups", None):
            raise ValueError("optimizer= must be a torch optimizer (it has no param_groups)")
        self.optimizer = optimizer
        if optimizer_name is not None and not optimizer_name_ok(optimizer_name):
            raise ValueError(f"optimizer_name must be a str of 1..{MAX_OPTIMIZER_LEN} printable "
                             f"ASCII characters, not {optimizer_name!r}")
        # What the Hello's model shape says the optimizer is (None: nothing):
        # the one named, given, or found stepping the model's parameters.
        self.optimizer_name = (optimizer_name or optimizer_class_name(optimizer) or
                               (optimizer_of_model(model) if optimizer is None else None))
        # None found and none given: most loops make the optimizer after the
        # Monitor. The connection then opens at the first report, after the
        # first optimizer step, and its Hello names what is found by then
        # (_find_optimizer_late).
        self._optimizer_model = (model if self.optimizer_name is None and optimizer is None
                                 and optimizer_name is None else None)
        self.layer_norms = layer_norms
        self.send_tokens = send_tokens
        if shard_reduce not in ("trainer", "daemon"):
            raise ValueError("shard_reduce is 'trainer' or 'daemon'")
        self.shard_group = shard_group
        if shard_group is not None:
            self.shard = (dist.get_rank(shard_group), dist.get_world_size(shard_group))
        else:
            self.shard = tuple(shard) if shard is not None else (0, 1)
        self.reduce_in_trainer = shard_group is not None and shard_reduce == "trainer"
        daemon_sums = self.shard[1] > 1 and not self.reduce_in_trainer
        if route is None:
            dev = next((p.device for p in model.parameters()), torch.device("cpu"))
            route = "gram" if daemon_sums or dev.type == "cpu" else "spectrum"
        if route not in ROUTES:
            raise ValueError(f"route is one of {ROUTES}, not {route!r}")
        if route == "spectrum" and daemon_sums:
            raise ValueError("route='spectrum' needs each head's whole Grams on one rank; with "
                             "shard_reduce='daemon' (or shard= without shard_group) the daemon "
                             "sums partial Grams: use route='gram', or shard_group= with "
                             "shard_reduce='trainer'")
        self.route = route
        if int(device_sketches) < 0:
            raise ValueError("device_sketches must be >= 0")
        self.device_sketches = int(device_sketches)
        self._device_jobs = 0       # jobs whose flat waits on the device (under _dev_lock)
        self._dev_lock = threading.Lock()
        self._side_stream = None    # the Monitor's CUDA stream, made on first use
        # Pinned host buffers for the device-to-host copies, reused: pinning
        # a few hundred MB per sketch step took ~120 ms of the training
        # thread on an H200 (cudaHostAlloc), more than the Grams themselves.
        # Raw uint8 buffers, each pinned once and reused by any job whose
        # flat fits (a disabled module shrinks it); at most PINNED_KEEP free
        # ones are kept, in use one per queued job (sketches_in_flight).
        self._pinned_free = []
        self._pinned_allocs = 0     # cudaHostAlloc calls (stats pinned_allocs)
        self._sketch_jobs = 0       # sketch jobs staged, not released (under _dev_lock)
        if sketches_in_flight is not None and (
                isinstance(sketches_in_flight, bool) or not isinstance(sketches_in_flight, int)
                or sketches_in_flight < 1):
            raise ValueError(f"sketches_in_flight must be an int >= 1 or None, not "
                             f"{sketches_in_flight!r}")
        self._in_flight_arg = sketches_in_flight
        if spectra_on not in SPECTRA_ON:
            raise ValueError(f"spectra_on is one of {SPECTRA_ON}, not {spectra_on!r}")
        self.spectra_on = spectra_on
        if spectra_threads is None:
            spectra_threads = min(MAX_DEFAULT_SPECTRA_THREADS, os.cpu_count() or 1)
        if isinstance(spectra_threads, bool) or not isinstance(spectra_threads, int) or \
                spectra_threads < 1:
            raise ValueError(f"spectra_threads must be an int >= 1, not {spectra_threads!r}")
        self.spectra_threads = spectra_threads
        self._spectra_pool = None   # made by the sender on the first host solve
        endpoint = endpoint or os.environ.get("FORESHOCK_ENDPOINT") or None
        # Without an endpoint the daemon is the default one on this node,
        # unless the run is only recorded.
        recording_only = endpoint is None and bool(record or os.environ.get("FORESHOCK_RECORD"))
        self.local_ranks = resolve_local_ranks(
            local_ranks, endpoint or (None if recording_only else "127.0.0.1"), self.rank,
            self.world_size, node=sorted(node_ranks) if node_ranks else None)
        if self.local_ranks and shard_group is not None and not self.reduce_in_trainer:
            # Partial Grams summed by a per-node daemon never complete when
            # the shard group reaches ranks of other nodes.
            try:
                group_ranks = dist.get_process_group_ranks(shard_group)
            except (AttributeError, RuntimeError, ValueError):
                group_ranks = None
            if group_ranks is not None and not set(group_ranks) <= set(self.local_ranks):
                raise ValueError("shard_reduce='daemon' with a shard_group spanning ranks "
                                 "outside local_ranks: this daemon would wait for shards it "
                                 "never hears; use shard_reduce='trainer'")
        lead = self.local_ranks[0] if self.local_ranks else 0
        if self.reduce_in_trainer:
            default_send = self.shard[0] == 0
        elif self.shard[1] > 1:
            default_send = True
        else:
            # Replicated weights: one rank per daemon sends them, the lead
            # rank of its group (rank 0 for a daemon that hears the job).
            default_send = self.rank == lead
        self.send_sketches = default_send if send_sketches is None else bool(send_sketches)
        # Ranks of a reducing group compute their partial Grams even when they
        # do not send: the all_reduce is a collective.
        self.compute_sketches = self.send_sketches or self.reduce_in_trainer
        # DTensor weights are gathered by a collective: every rank reads them (dtensor.py).
        self._dtensors = dtensor.has_dtensors(model)
        self.compute_sketches = self.compute_sketches or self._dtensors
        self.step_ratio = bool(step_ratio) and self.send_sketches and not self._dtensors
        self._prev_step = None      # (step, {key: clone}) for step_ratio

        # Discovery (layouts.py): one summary record of what is monitored,
        # what was skipped and why, and the argument that fixes it.
        self._discover_kw = dict(attention=attention, routers=routers, layers=layers,
                                 n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                                 top_k=top_k)
        self._later, self._first_input = None, None
        try:
            found = discover(model, example_input=example_input, observe=observe,
                             **self._discover_kw)
            # No example input and no probe batch ran: observe the first batch
            # the model sees, at the first step() (_observe_first).
            obs = found.observation
            if example_input is None and observe and obs is not None and obs.error is not None \
                    and "no forward" not in obs.error:
                self._later = (model, self._capture_first(model))
                log.info("foreshock: %s: discovery by names for now; the observed pass waits "
                         "for the first batch (%s)", type(model).__name__, obs.error)
            else:
                found.log(type(model).__name__)
        except (ValueError, TypeError) as e:
            if attention is not None or routers is not None:
                raise  # specs the caller gave are bad input: a clear error
            found = self._discovery_failed(e)
        except Exception as e:  # a discovery bug on a model it never saw
            found = self._discovery_failed(e)
        self.discovery = found
        att, rts = found.attention, found.routers
        self.attention = att
        self.routers = rts
        self.n_layers = 1 + max([a.layer for a in att] + [r.layer for r in rts] + [-1])
        try:
            p = next(model.parameters())
            self.device = p.device
        except StopIteration:
            self.device = torch.device("cpu")

        self._snaps = {}            # step -> {("a", i): (wq, wk), ("r", i): wr}
        self._tok = {}              # router index -> TokenStats being filled
        self._hooks = []
        self._tok_lock = threading.Lock()
        self._hook_routers()
        self._last_call = None
        self._closed = False
        self._queue = queue.Queue(maxsize=queue_reports)
        self._counts = {"reports": 0, "dropped_queue": 0, "refused": 0, "dropped_submit": 0,
                        "spectra_on_host": 0, "sketches_skipped_busy": 0}
        # A per-rank skip is safe only without collectives in the sketch.
        if self.reduce_in_trainer or self._dtensors:
            self.sketches_in_flight = None
        elif sketches_in_flight is not None:
            self.sketches_in_flight = sketches_in_flight
        else:
            self.sketches_in_flight = (DEFAULT_SKETCHES_IN_FLIGHT
                                       if self.device.type == "cuda" else None)
        self._complain_busy = _RateLimited(LOG_INTERVAL_S)
        self._overhead = {"steps": 0, "seconds": 0.0, "sketch_steps": 0, "sketch_seconds": 0.0}
        # One limiter per kind of complaint, so that a flood of one kind
        # (connection refused) never hides the first of another (a drop).
        self._complain_queue = _RateLimited(LOG_INTERVAL_S)
        self._complain_drop = _RateLimited(LOG_INTERVAL_S)
        self._complain_refused = _RateLimited(LOG_INTERVAL_S)
        self._complain_conn = _RateLimited(LOG_INTERVAL_S)
        self._complain_daemon = _RateLimited(LOG_INTERVAL_S)
        self._conn_state = None
        self._daemon_refused = 0    # libforeshock's daemon_refused already logged
        self._sender_cpu_s = 0.0    # CPU time of the sender thread (off the training thread)

        record = record or os.environ.get("FORESHOCK_RECORD") or None
        self.record_path = None
        if record:
            record = os.fspath(record)
            if "{rank}" in record:
                record = record.replace("{rank}", str(self.rank))
            elif self.world_size > 1:
                record = f"{record}.rank{self.rank}"
            self.record_path = record
        if transport is None:
            from ._lib import Client
            host, port = parse_endpoint(endpoint)

            def shape():
                return self._model_shape(layers)
            make = (lambda: Client(host, port, self.run, rank=self.rank,
                                   world_size=self.world_size, attempt=attempt, token=token,
                                   detect_from_step=detect_from_step,
                                   replay_max_bytes=replay_bytes, model=shape(),
                                   client_name=client_name or "foreshock-python/0.1.0",
                                   backoff_max_ms=int(backoff_max_s * 1000)
                                   if backoff_max_s else 0,
                                   lib_path=lib, record_path=self.record_path,
                                   record_only=bool(self.record_path) and endpoint is None,
                                   local_ranks=self.local_ranks,
                                   advice=bool(advice or on_advice), resume_step=resume_step,
                                   optimizer=self.optimizer_name,
                                   **_tls_args(tls, tls_ca, tls_cert, tls_key,
                                               tls_server_name)))
            later = self._later is not None or self._optimizer_model is not None
            transport = _Deferred(make) if later else make()
            if self.local_ranks:
                log.info("foreshock: run %s rank %d: the daemon at %s hears local group %s of "
                         "%d ranks: its router token statistics are this group's, its "
                         "loss/grad_norm/lr rank %d's", self.run, self.rank, endpoint or
                         "127.0.0.1", ranges_text(self.local_ranks), self.world_size, lead)
            if self.record_path:
                log.info("foreshock: recording run %s rank %d to %s%s", self.run, self.rank,
                         self.record_path, "" if endpoint else " (no endpoint: record only)")
        self.transport = transport
        if on_advice is not None and not callable(on_advice):
            raise ValueError("on_advice must be callable: fn(advice)")
        self._inbox = AdviceInbox(transport, on_advice)
        self._sender = threading.Thread(target=self._send_loop, name="foreshock-sender",
                                        daemon=True)
        self._sender.start()

    def _find_optimizer_late(self):
        """At the first step(), when construction found no optimizer and
        none was given: the optimizer stepping the model is looked for once
        more (an optimizer made after the Monitor, which has stepped by
        now). On the training thread, as at construction: the scan holds
        references to every live object, which must not race the step's
        own frees. The connection, deferred until the first report, then
        names it in its Hello. Never raises (optimizer_of_model)."""
        model, self._optimizer_model = self._optimizer_model, None
        self.optimizer_name = optimizer_of_model(model)
        if self.optimizer_name is not None:
            log.info("foreshock: run %s: optimizer %s found stepping the model at the first "
                     "step", self.run, self.optimizer_name)

    # ---- failures ------------------------------------------------------------------------

    def _discovery_failed(self, exc):
        """Discovery raised: monitor nothing but the scalars, say so."""
        self._fail("discovery", None, exc)
        log.warning("foreshock: discovery failed (%s: %s): no attention or router is "
                    "monitored, the training scalars still are; pass attention=[...] and "
                    "routers=[...] (foreshock.AttentionSpec / RouterSpec) to monitor them",
                    type(exc).__name__, exc)
        return Discovery()

    def _name(self, key):
        spec = (self.attention if key[0] == "a" else self.routers)[key[1]]
        kind = "attention" if key[0] == "a" else "router"
        return f"{kind} {spec.name or '#%d' % key[1]} (layer {spec.layer})"

    def _fail(self, stage, key, exc):
        """Counts a failure of `stage`; with a module key, disables that
        module (logged once). Never raises."""
        try:
            with self._fail_lock:
                self._failures[stage] = self._failures.get(stage, 0) + 1
                first = key is not None and key not in self._disabled
                if first:
                    self._disabled[key] = f"{stage}: {type(exc).__name__}: {exc}"
            if first:
                log.warning("foreshock: %s is no longer monitored: %s failed with %s: %s; "
                            "training goes on and the other modules are still monitored",
                            self._name(key), stage, type(exc).__name__, exc)
            elif key is None:
                self._complain_fail(logging.WARNING, "foreshock: %s failed with %s: %s (%d so "
                                    "far); training goes on", stage, type(exc).__name__, exc,
                                    self._failures[stage])
            log.debug("foreshock: %s failure", stage, exc_info=exc)
        except Exception:  # logging itself failed: the count is what matters
            pass

    def _guarded(self, stage, key, fn, *args):
        """fn(*args), or _FAILED when it raised (counted; the module `key`,
        if any, disabled)."""
        try:
            return fn(*args)
        except Exception as e:
            self._fail(stage, key, e)
            return _FAILED

    def _live(self, key):
        return key not in self._disabled

    # ---- discovery --------------------------------------------------------------------

    def _model_shape(self, layers):
        """The model shape the Hello carries, from the discovery's result."""
        att = self.attention
        a0 = att[0] if att else None
        # n_layers/n_heads tell the daemon which heads to expect in a step;
        # only claimed when this stream sends all of them.
        all_heads = bool(att) and layers is None and len(att) == self.n_layers and \
            all(a.head_offset == 0 for a in att) and \
            len({a.n_heads for a in att}) == 1 and self.send_sketches
        return {
            "n_layers": self.n_layers if all_heads else 0,
            "n_heads": a0.n_heads if all_heads else 0,
            "n_kv_heads": a0.n_kv_heads if a0 else 0,
            "d_head": a0.head_dim if a0 else 0,
            "n_experts": self.routers[0].n_experts if self.routers else 0,
            "top_k": self.routers[0].top_k if self.routers else 0,
            "moe_layers": sorted({r.layer for r in self.routers}) if self.send_tokens else [],
        }

    def _hook_routers(self):
        if self.send_tokens:
            for i, r in enumerate(self.routers):
                if r.module is not None:
                    self._hooks.append(r.module.register_forward_hook(self._router_hook(i, r)))

    def _capture_first(self, model):
        """A pre-hook keeping the first call's inputs, keyword arguments too
        (torch 2 hands them to the hook; on torch 1.x they are read from the
        module call that runs the hook, _call_kwargs)."""
        def pre(module, args, kwargs=None):
            try:
                if self._first_input is None:
                    kw = kwargs if kwargs is not None else _call_kwargs(module)
                    self._first_input = (tuple(a.detach() if isinstance(a, torch.Tensor) else a
                                               for a in args),
                                         {k: v.detach() if isinstance(v, torch.Tensor) else v
                                          for k, v in (kw or {}).items()})
            except Exception:  # a hook inside the user's forward must not raise
                pass
        try:
            return model.register_forward_pre_hook(pre, with_kwargs=True)
        except TypeError:  # torch 1.x: positional inputs only
            return model.register_forward_pre_hook(pre)

    def _observe_first(self):
        """At the first step() when construction could not observe: one
        observed pass with the first batch, then the summary and the
        connection (the daemon hears the shape this pass found)."""
        model, handle = self._later
        self._later = None
        handle.remove()
        found = self.discovery
        try:
            if self._first_input is not None:
                args, kwargs = self._first_input
                from .observe import observe as run_observed
                obs = run_observed(model, args, kwargs, label="the first batch")
                if obs.error is None:
                    found = discover(model, observe=obs, **self._discover_kw)
                else:
                    found.observation = obs
                    log.warning("foreshock: %s: the observed pass could not replay the first "
                                "batch the model saw (%s); discovery is by names only. Fix: "
                                "pass example_input= to Monitor (one batch: a tensor, a tuple "
                                "of arguments or a dict of keyword arguments)",
                                type(model).__name__, obs.error)
        except Exception as e:  # discovery stays the names' one
            log.warning("foreshock: the observed pass on the first batch failed (%s: %s); "
                        "names only. Fix: pass example_input= to Monitor", type(e).__name__, e)
        self._first_input = None
        found.log(type(model).__name__)
        self.discovery = found
        if found.attention is not self.attention or found.routers is not self.routers:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self.attention, self.routers = found.attention, found.routers
            self.n_layers = 1 + max([a.layer for a in self.attention] +
                                    [r.layer for r in self.routers] + [-1])
            self._hook_routers()
        if isinstance(self.transport, _Deferred):
            self.transport.open()

    # ---- hooks -------------------------------------------------------------------------

    def _router_hook(self, i, spec):
        key = ("r", i)

        def hook(module, inputs, output):
            # Runs inside the model's forward: it must never raise. A
            # disabled router's hook stays registered (removing a hook while
            # forward iterates over them is not safe) and returns at once.
            if key in self._disabled or not module.training:
                return
            self._guarded("hook", key, tokens, inputs, output)

        def tokens(inputs, output):
            z = output if isinstance(output, torch.Tensor) else None
            if z is None or z.shape[-1] != spec.n_experts:
                x = inputs[0] if inputs else None
                if not isinstance(x, torch.Tensor):
                    return
                b = spec.bias() if spec.bias else None
                with torch.no_grad():
                    z = torch.nn.functional.linear(x.detach(), spec.get().detach(), b)
            with self._tok_lock:
                acc = self._tok.get(i)
                if acc is None:
                    acc = self._tok[i] = sk.TokenStats(spec.n_experts, z.device)
                acc.add(z, spec.top_k)
        return hook

    # ---- the training-thread part --------------------------------------------------------

    def _weights(self):
        """Current monitored weights (views): {key: tensor or (wq, wk)}."""
        out = {}
        # A module whose weights cannot be read is disabled on this rank
        # only; with shard_reduce="trainer" _sketch keeps its slot in the
        # collective (zeros and a flag), so ranks never diverge. A get()
        # that is itself a collective must fail on every rank or none.
        # DTensor weights are gathered whole by a collective per module
        # (dtensor.py): every rank must gather the same modules in the same
        # order, so a module disabled on this rank alone is still read and
        # gathered, and dropped afterwards.
        every = bool(self._dtensors)
        for i, a in enumerate(self.attention):
            self._take(out, ("a", i), a.get, every)
        for i, r in enumerate(self.routers):
            self._take(out, ("r", i), r.get, every)
        out = dtensor.gather(out, self._dtensors)  # FSDP2 / TP DTensors, whole
        if every:
            out = {k: v for k, v in out.items() if self._live(k)}
        return out

    def _take(self, out, key, get, every=False):
        if every or self._live(key):
            w = self._guarded("sketch", key, get)
            if w is not _FAILED:
                out[key] = w

    def _need_snapshot(self, step):
        return self.compute_sketches and any((step + w) % self.every == 0 for w in self.windows)

    @torch.no_grad()
    def step(self, step, loss=None, grad_norm=None, lr=None, loss_scale=None, tokens=None,
             step_time=None):
        """Call once per optimizer step, after optimizer.step(), with the step
        number (the weights now are W(step)). loss and grad_norm may be
        floats or tensors (tensors are read on the background thread, so
        no GPU sync happens here). Never blocks on the network. Advice the
        daemon sent is handed to on_advice at the end of the call, on this
        thread (under torch.no_grad(), as the rest of step())."""
        t0 = time.perf_counter()
        if self._closed:
            if not self._closed_warned:
                self._closed_warned = True
                log.warning("foreshock: Monitor.step(%s) after close(): ignored", step)
            return
        if self._later is not None:
            # The observed pass on the first batch (construction had none).
            self._guarded("discovery", None, self._observe_first)
        if self._optimizer_model is not None:
            self._guarded("discovery", None, self._find_optimizer_late)
        sketched = self._guarded("step", None, self._step, t0, step, loss, grad_norm, lr,
                                 loss_scale, tokens, step_time)
        dt = time.perf_counter() - t0
        # Advice is handed over here, on the training thread (never from the
        # sender or libforeshock's thread); the handler's time is its own,
        # and so is its exception (AdviceInbox).
        self._inbox.poll(step, self._fail)
        o = self._overhead
        o["steps"] += 1
        o["seconds"] += dt
        if sketched is True:
            o["sketch_steps"] += 1
            o["sketch_seconds"] += dt

    def _step(self, t0, step, loss, grad_norm, lr, loss_scale, tokens, step_time):
        """step()'s work; True when the step carries sketches."""
        step = int(step)
        if step_time is None and self._last_call is not None:
            step_time = t0 - self._last_call
        self._last_call = t0
        scalars = {}
        if lr is None and self.optimizer is not None:
            lr = self.optimizer.param_groups[0].get("lr")
        for k, v in (("loss", loss), ("grad_norm", grad_norm), ("lr", lr),
                     ("loss_scale", loss_scale), ("tokens", tokens), ("step_time", step_time)):
            if v is None:
                continue
            scalars[k] = v.detach() if isinstance(v, torch.Tensor) else v
        job = _Job(step, time.time(), scalars)
        sketch_step = step % self.every == 0
        now = None
        if self.step_ratio:
            now = self._weights()
            r = self._guarded("sketch", None, self._step_update_ratio, step, now)
            if r is _FAILED:  # counted and logged by _guarded; not tried again
                self.step_ratio, self._prev_step = False, None
                log.warning("foreshock: the per-step update ratio is off for the rest of "
                            "the run (it failed at step %d); sketches go on", step)
            elif r is not None:
                scalars["step_update_ratio"] = r
        if sketch_step and self.compute_sketches and not self._sender_busy(step):
            now = now if now is not None else self._weights()
            self._sketch(job, step, now)
        if sketch_step and self.send_tokens and self.routers:
            with self._tok_lock:
                taken, self._tok = self._tok, {}
            for i, acc in sorted(taken.items()):
                # A router whose hook failed may have left half-added sums.
                if self._live(("r", i)):
                    job.tokens.append((self.routers[i], acc))
        if self._need_snapshot(step):
            now = now if now is not None else self._weights()
            snap = {}
            for k, v in now.items():
                c = self._guarded("sketch", k, _clone, v)
                if c is not _FAILED:
                    snap[k] = c
            self._snaps[step] = snap
        oldest = step - self.windows[-1]
        for s in [s for s in self._snaps if s < oldest]:
            del self._snaps[s]
        try:
            self._stage_to_host(job)
            self._enqueue(job)
        except Exception:
            self._release_device(job)  # its place under device_sketches
            raise
        return sketch_step and bool(job.attn or job.routers)

    def _sender_busy(self, step):
        """True when this sketch step must skip its Grams: the sender still
        holds sketches_in_flight sketch jobs. Only the Grams are skipped:
        the window snapshots of this step are taken as always (_step), so
        later sketch steps keep their bases."""
        bound = self.sketches_in_flight
        if bound is None:
            return False
        with self._dev_lock:
            busy = self._sketch_jobs >= bound
        if busy:
            self._counts["sketches_skipped_busy"] += 1
            self._complain_busy(logging.WARNING,
                                "foreshock: sketches of step %d skipped: the sender still "
                                "holds %d sketch step(s) (%d skipped so far); solving spectra "
                                "is slower than every=%d steps: raise spectra_threads (now %d) "
                                "or every", step, bound, self._counts["sketches_skipped_busy"],
                                self.every, self.spectra_threads)
        return busy

    def _sketch(self, job, step, now):
        """The step's Grams, module by module: a module that fails is
        disabled and the rest go on. When the trainer reduces the shards
        (an all_reduce over shard_group), every rank must hand the
        collective the same layout, whatever failed where: a module this
        rank cannot sketch keeps its slot as zeros and raises its flag in
        job.flags (reduced with the Grams), and every rank that sees a
        flag drops that module from then on (_split)."""
        reduce = self.reduce_in_trainer
        flags = [0.0] * (len(self.attention) + len(self.routers)) if reduce else None
        first = None  # smallest window with a base: layer norms use it
        for w in self.windows:
            base = self._snaps.get(step - w)
            if base is None:
                continue
            first = first if first is not None else base
            for i, a in enumerate(self.attention):
                key = ("a", i)
                g = _FAILED
                if self._live(key) and key in now and key in base:
                    wq, wk = now[key]
                    wq0, wk0 = base[key]
                    g = self._guarded("sketch", key, sk.attention_grams, wq, wk, wq0, wk0,
                                      a.n_heads, a.n_kv_heads, a.head_dim, self.gram_dtype)
                if g is _FAILED and reduce:
                    flags[i] = 1.0
                    g = _zero_grams(a, self.gram_dtype, self.device)
                if g is not _FAILED:
                    job.attn.append((a, w, g[0], g[1]))
        for i, r in enumerate(self.routers):
            key = ("r", i)
            g = _FAILED
            if self._live(key) and key in now:
                g = self._guarded("sketch", key, sk.router_gram, now[key], self.gram_dtype)
            if g is _FAILED and reduce:
                flags[len(self.attention) + i] = 1.0
                e = r.n_experts
                g = torch.zeros(e * (e + 1) // 2, dtype=self.gram_dtype, device=self.device)
            if g is not _FAILED:
                job.routers.append((r, g))
        if self.layer_norms and first is not None:
            job.norms = self._norms(now, first)
        if reduce and (job.attn or job.routers or job.norms is not None):
            # Set on the device entry by entry: torch.tensor(list) on CUDA
            # would copy from pageable memory and wait for the stream.
            job.flags = torch.zeros(len(flags), dtype=torch.float64, device=self.device)
            for m, f in enumerate(flags):
                if f:
                    job.flags[m] = 1.0

    def _step_update_ratio(self, step, now):
        """|W(step) - W(step-1)| / |W(step-1)| over the monitored weights
        that moved (now: _weights(); live modules, in both steps) as a 0-d
        float64 tensor on their device (0 when none moved),
        or None: the first step, or a step that does not follow the last
        one (a resume, a step() skipped). The previous weights are kept as
        copies, refreshed in place. A failure here disables no module:
        _step turns the ratio off and the sketches go on."""
        prev = self._prev_step
        if prev is None or prev[0] != step - 1:
            self._prev_step = (step, {k: _clone(v) for k, v in now.items()})
            return None
        old = prev[1]
        curs, olds = [], []
        for key, cur in now.items():
            if key not in old:
                old[key] = _clone(cur)
                continue
            pair_c = cur if isinstance(cur, tuple) else (cur,)
            pair_o = old[key] if isinstance(old[key], tuple) else (old[key],)
            if any(c.shape != o.shape or c.dtype != o.dtype for c, o in zip(pair_c, pair_o)):
                old[key] = _clone(cur)
                continue
            curs += [c.detach() for c in pair_c]
            olds += pair_o
        self._prev_step = (step, old)
        if not curs:
            return None
        # A few fused kernels for all the modules (torch._foreach_*), not a
        # handful per module: on an 80-layer model the launches of a loop
        # would cost the training thread milliseconds a step. Norms in the
        # weights' dtype, squared and summed in float64.
        # Weights that did not move at all (frozen) count in neither sum:
        # unfreezing most of a model would otherwise lift the ratio by
        # sqrt(all / moving) for good, a step-size page. A step where none
        # moved (skipped by a loss scaler) is 0.
        d = torch._foreach_norm(torch._foreach_sub(curs, olds))
        o = torch._foreach_norm(olds)
        dev = olds[0].device
        dd = _stack64(d, dev).pow(2)
        oo = _stack64(o, dev).pow(2)
        d2 = dd.sum()
        o2 = torch.where(dd > 0, oo, torch.zeros_like(oo)).sum()
        if _FOREACH_COPY is not None:
            _FOREACH_COPY(olds, curs)
        else:  # torch < 2.1
            for x, c in zip(olds, curs):
                x.copy_(c)
        return torch.where(o2 > 0, torch.sqrt(d2 / torch.where(o2 > 0, o2, torch.ones_like(o2))),
                           torch.zeros_like(o2))

    def _norms(self, now, base):
        """[n_modules, 3]: squared |W(t)|, |W(t)-W(t0)|, |W(t0)| per monitored
        module (attention specs, then routers; additive over d-shards), zero
        for a module not read. The sender sums them per layer (_layer_norms)
        over the modules still monitored."""
        na = len(self.attention)
        rows = torch.zeros(na + len(self.routers), 3, dtype=torch.float64, device=self.device)
        for key, cur in now.items():
            if key in base and self._live(key):
                m = key[1] + (na if key[0] == "r" else 0)
                r = self._guarded("sketch", key, _norm_row, cur, base[key])
                if r is not _FAILED:
                    rows[m] = r.to(rows.device)
        return rows

    def _layer_norms(self, rows, dead):
        """[n_layers, 3] from _norms' module rows, without the modules in
        `dead` (indices into the rows)."""
        out = np.zeros((self.n_layers, 3))
        specs = list(self.attention) + list(self.routers)
        for m, spec in enumerate(specs):
            if m not in dead:
                out[spec.layer] += rows[m]
        return out

    def _stage_to_host(self, job):
        """Reduces (sharded trainer mode) and starts device-to-host copies."""
        tensors = [job.flags] if job.flags is not None else []
        tensors += [g for _, _, ga, gb in job.attn for g in (ga, gb)]
        tensors += [g for _, g in job.routers]
        if job.norms is not None:
            tensors.append(job.norms)
        if not tensors:
            return
        if job.attn or job.routers:
            job.in_flight = True
            with self._dev_lock:
                self._sketch_jobs += 1
        # One buffer: one collective, one copy. float64 when the trainer sums
        # shards, so that the sum adds no rounding of its own; otherwise the
        # Grams' own dtype (gram_dtype; the host solve upcasts to float64
        # itself), which halves the copy and the pinned buffer for float32.
        # Wider tensors (the float64 norms) travel as their bits.
        grams = [g for _, _, ga, gb in job.attn for g in (ga, gb)] + [g for _, g in job.routers]
        dtype = torch.float64
        if not self.reduce_in_trainer and grams:
            dtype = grams[0].dtype
            for g in grams[1:]:
                dtype = torch.promote_types(dtype, g.dtype)
            if dtype not in (torch.float32, torch.float64):
                dtype = torch.float64  # numpy has no bfloat16: the old, exact path
        size = torch.empty((), dtype=dtype).element_size()
        pieces, job.layout = [], []
        for t in tensors:
            # (shape, the dtype its bits are read back as, or None)
            bits = t.dtype != dtype and t.element_size() > size and \
                t.element_size() % size == 0 and t.is_floating_point()
            job.layout.append((t.shape, t.dtype if bits else None))
            flat_t = t.contiguous().reshape(-1)
            pieces.append(flat_t.view(dtype) if bits else flat_t.to(dtype))
        flat = torch.cat(pieces)
        if self.reduce_in_trainer:
            job.work = torch.distributed.all_reduce(flat, group=self.shard_group, async_op=True)
        spectra_here = self.route == "spectrum" and self.send_sketches and bool(job.attn)
        if flat.device.type == "cuda":
            if job.work is not None:
                job.work.wait()  # orders what follows after the reduction on the stream
                job.work = None
            if spectra_here and self.spectra_on == "device":
                with self._dev_lock:
                    keep = self._device_jobs < self.device_sketches
                    if keep:
                        self._device_jobs += 1
                if keep:
                    job.event = torch.cuda.Event()
                    job.event.record()
                    job.on_device = True
                    job.flat = flat
                    return
            job.pinned, host = self._take_pinned(flat)
            if spectra_here:
                # Copied on the Monitor's stream, after the Grams: the
                # training stream does not wait for a copy this large.
                ready = torch.cuda.Event()
                ready.record()
                stream = self._stream(flat.device)
                with torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    flat.record_stream(stream)
                    host.copy_(flat, non_blocking=True)
                    job.event = torch.cuda.Event()
                    job.event.record(stream)
            else:
                host.copy_(flat, non_blocking=True)
                job.event = torch.cuda.Event()
                job.event.record()
            flat = host
        if spectra_here:
            self._counts["spectra_on_host"] += 1
        job.flat = flat

    def _take_pinned(self, flat):
        """(raw pinned uint8 buffer, a view of it shaped and typed as flat):
        the smallest free one that fits, else a new one (training thread;
        with sketches_in_flight at most PINNED_KEEP are ever in use, so a
        new one is pinned only until the pool is full, or when flat grew)."""
        need = flat.numel() * flat.element_size()
        with self._dev_lock:
            fits = [i for i, b in enumerate(self._pinned_free) if b.numel() >= need]
            raw = None
            if fits:
                i = min(fits, key=lambda i: self._pinned_free[i].numel())
                raw = self._pinned_free.pop(i)
        if raw is None:
            raw = torch.empty(need, dtype=torch.uint8, pin_memory=True)
            self._pinned_allocs += 1
        return raw, raw[:need].view(flat.dtype).reshape(flat.shape)

    def _stream(self, device):
        """The Monitor's own CUDA stream (made on first use, by either thread)."""
        with self._dev_lock:
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device=device)
            return self._side_stream

    def _enqueue(self, job):
        self._counts["reports"] += 1
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._release_device(job)
            self._counts["dropped_queue"] += 1
            self._complain_queue(logging.WARNING, "foreshock: report of step %d dropped: the "
                                 "sender queue is full (%d dropped so far)", job.step,
                                 self._counts["dropped_queue"])

    # ---- the background part ---------------------------------------------------------------

    def _host_parts(self, job):
        """The job's reduced tensors as host numpy arrays, in layout order,
        with the attention Grams replaced by their spectra on the spectrum
        route: [dead module indices (_split), then (ga, gb) or packed spectra
        or None per (spec, window)] + the rest."""
        if job.work is not None:
            job.work.wait()
        spectra_route = self.route == "spectrum" and self.send_sketches
        if job.on_device:
            try:
                stream = self._stream(job.flat.device)
                with torch.cuda.stream(stream):
                    stream.wait_event(job.event)
                    job.flat.record_stream(stream)
                    return self._split(job, job.flat, spectra_route)
            finally:
                self._release_device(job, sent=False)
        if job.event is not None:
            job.event.synchronize()
        return self._split(job, job.flat.cpu(), spectra_route)

    def _release_device(self, job, sent=True):
        """Drops a job's device buffer and its place under device_sketches,
        and gives its pinned host buffer back to the pool (once; any thread;
        the sender calls it only after the report was built, when nothing
        reads the buffer any more: the spectra pool's tasks have all
        finished and the report holds copies). sent=False (the device
        spectra are solved, the report not yet built) keeps the job's place
        under sketches_in_flight."""
        if job.on_device:
            job.on_device = False
            job.flat = None
            with self._dev_lock:
                self._device_jobs -= 1
        if job.pinned is not None:
            # A dropped job's copy may still be in flight: the next copy into
            # this buffer is queued on the same stream, after it.
            buf, job.pinned, job.flat = job.pinned, None, None
            with self._dev_lock:
                self._pinned_free.append(buf)
                if len(self._pinned_free) > PINNED_KEEP:
                    # the smallest goes: the larger ones fit any flat it fits
                    self._pinned_free.remove(min(self._pinned_free, key=lambda b: b.numel()))
        if job.in_flight and sent:
            job.in_flight = False
            with self._dev_lock:
                self._sketch_jobs -= 1

    def _split(self, job, flat, spectra_route):
        """[dead module indices] + the parts _host_parts describes; a part
        is None for a module whose spectra failed or that is dead."""
        parts, off = [], 0
        size = flat.element_size()
        for shape, bits in job.layout:
            n = int(np.prod(shape))
            if bits is None:
                parts.append(flat[off:off + n].reshape(shape))
            else:
                # a wider tensor carried as its bits (_stage_to_host): a copy
                # of its own, so that the view starts aligned
                m = n * (torch.empty((), dtype=bits).element_size() // size)
                parts.append(flat[off:off + m].cpu().clone().view(bits).reshape(shape))
                n = m
            off += n
        dead = set()
        k = 0
        if job.flags is not None:
            # Reduced flags: a module some rank of the shard group could not
            # sketch. Its sums are partial: not sent, and dropped here too
            # (this rank then keeps its slot as zeros, so layouts agree).
            flags = parts[0].cpu().numpy()
            k = 1
            na = len(self.attention)
            for m in np.nonzero(flags > 0)[0]:
                m = int(m)
                dead.add(m)
                key = ("a", m) if m < na else ("r", m - na)
                if self._live(key):
                    with self._fail_lock:
                        self._disabled.setdefault(key, "sketch failed on a rank of the "
                                                       "shard group")
                    log.warning("foreshock: %s is no longer monitored: its sketch failed on "
                                "a rank of the shard group", self._name(key))
        out = [dead]
        index = {id(a): i for i, a in enumerate(self.attention)}
        solve = []   # (position in out, spec index, spec, ga, gb)
        for a, _, _, _ in job.attn:
            ga, gb = parts[k], parts[k + 1]
            k += 2
            i = index[id(a)]
            if i in dead or not self._live(("a", i)):
                dead.add(i)
                out.append(None)
            elif spectra_route:
                solve.append((len(out), i, a, ga, gb))
                out.append(None)
            else:
                out.append((ga.cpu().numpy(), gb.cpu().numpy()))
        for pos, sp in self._solve_spectra(solve, flat.device.type == "cpu"):
            out[pos] = None if sp is _FAILED else sp.cpu().numpy()
        out += [p.cpu().numpy() for p in parts[k:]]
        return out

    def _solve_spectra(self, solve, on_host):
        """[(position, packed spectra or _FAILED)] for _split's list: on the
        host by the spectra pool, one spec per task; on the device in turn,
        on the calling thread (its current stream). A failing spec is
        disabled alone (_guarded("spectrum", ...))."""
        def one(item):
            _, i, a, ga, gb = item
            return self._guarded("spectrum", ("a", i), self._head_spectra, a, ga, gb)
        pool = self._pool() if on_host and solve else None
        if pool is None:
            return [(item[0], one(item)) for item in solve]
        futures = []
        for item in solve:
            try:
                futures.append(pool.submit(one, item))
            except RuntimeError:  # the interpreter is shutting down: solved here
                futures.append(None)
        out = []
        for item, f in zip(solve, futures):
            try:
                sp = one(item) if f is None else f.result()
            except Exception as e:  # a broken pool; one() itself never raises
                self._fail("spectrum", ("a", item[1]), e)
                sp = _FAILED
            out.append((item[0], sp))
        return out

    def _pool(self):
        """The host spectra pool (made on first use by the sender), or None
        when it cannot be made (the sender then solves in turn)."""
        if self._spectra_pool is None:
            try:
                self._spectra_pool = ThreadPoolExecutor(
                    max_workers=self.spectra_threads, thread_name_prefix="foreshock-spectra",
                    initializer=_one_omp_thread)
            except Exception as e:
                self._fail("spectrum", None, e)
                return None
        return self._spectra_pool

    @staticmethod
    def _head_spectra(a, ga, gb):
        """[H, 6 dh + 6] packed spectra (foreshock.spectra.qk_spectra) of one
        attention spec's heads from its Gram triangles ga [H, T], gb [Hkv, T]."""
        n = 2 * a.head_dim
        kv = torch.arange(a.n_heads, device=ga.device) // (a.n_heads // a.n_kv_heads)
        full_a = spx.unpack(ga, n)
        full_b = spx.unpack(gb, n).index_select(0, kv)
        return spx.qk_spectra(full_a, full_b, a.head_dim)

    def _materialize(self, job):
        rep = Report(step=job.step, time_unix=job.time)
        for k, v in job.scalars.items():
            rep.scalars[k] = v.item() if isinstance(v, torch.Tensor) else v
        if job.flat is not None:
            parts = iter(self._host_parts(job))
            dead = next(parts)
            if self.send_sketches:
                shard_i, shard_n = (0, 1) if self.reduce_in_trainer else self.shard
                index = {id(a): i for i, a in enumerate(self.attention)}
                for a, w, _, _ in job.attn:
                    part = next(parts)
                    if part is not None:
                        self._guarded("pack", ("a", index[id(a)]), self._pack_attention,
                                      rep, a, w, part, shard_i, shard_n)
                na = len(self.attention)
                rindex = {id(r): i for i, r in enumerate(self.routers)}
                for r, _ in job.routers:
                    part = next(parts)
                    m = na + rindex[id(r)]
                    if m not in dead and self._live(("r", m - na)):
                        rep.router_grams.append(RouterGram(r.layer, r.n_experts,
                                                           part.astype(np.float32),
                                                           shard_i, shard_n))
                    else:
                        dead.add(m)
                if job.norms is not None:
                    n = self._layer_norms(next(parts), dead)
                    w2, d2, o2 = n[:, 0], n[:, 1], n[:, 2]
                    rep.layer_weight_norm = np.sqrt(w2).astype(np.float32)
                    ratio = np.where(o2 > 0, np.sqrt(d2 / np.where(o2 > 0, o2, 1.0)), 0.0)
                    rep.layer_update_ratio = ratio.astype(np.float32)
        rindex = {id(r): i for i, r in enumerate(self.routers)}
        for r, acc in job.tokens:
            if acc.n_tok == 0:
                continue
            t = self._guarded("pack", ("r", rindex[id(r)]), _router_tokens, r, acc)
            if t is not _FAILED:
                rep.router_tokens.append(t)
        return rep

    def _pack_attention(self, rep, a, w, part, shard_i, shard_n):
        """One attention spec's sketches of one window into rep (all or none)."""
        if self.route == "spectrum":
            rep.attention += self._spectrum_sketches(a, w, part)
            return
        group = a.n_heads // a.n_kv_heads
        grouped = a.n_kv_heads != a.n_heads
        ga, gb = part
        out = []
        for h in range(a.n_heads):
            kv = h // group
            out.append(AttentionGram(
                a.layer, a.head_offset + h,
                (a.kv_offset + kv) if grouped else None, w, a.head_dim,
                ga[h].astype(np.float32), gb[kv].astype(np.float32),
                shard_i, shard_n))
        rep.attention += out

    @staticmethod
    def _spectrum_sketches(a, window, packed):
        """AttentionSpectrum per head from qk_spectra's packed host rows."""
        dh = a.head_dim
        group = a.n_heads // a.n_kv_heads
        grouped = a.n_kv_heads != a.n_heads
        vals = packed[:, :6 * dh].astype(np.float32)
        nonfinite = packed[:, 6 * dh + 5] != 0.0
        # A non-finite head travels as NaN spectra: the daemon flags it.
        vals[nonfinite] = np.nan
        out = []
        for h in range(a.n_heads):
            row, v = packed[h], vals[h]
            cqk = row[6 * dh + 4]
            out.append(AttentionSpectrum(
                a.layer, a.head_offset + h,
                (a.kv_offset + h // group) if grouped else None, window, dh,
                v[0:2 * dh], v[2 * dh:4 * dh], v[4 * dh:5 * dh], v[5 * dh:6 * dh],
                float(row[6 * dh]), float(row[6 * dh + 1]), float(row[6 * dh + 2]),
                float(row[6 * dh + 3]), None if np.isnan(cqk) else float(cqk)))
        return out

    def _send_loop(self):
        while True:
            job = self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            c0 = time.thread_time()
            try:
                self._guarded("send", None, self._send, job)
            finally:
                # when _materialize failed before it (never raises: a lock
                # and a counter)
                self._release_device(job)
                self._sender_cpu_s += time.thread_time() - c0
                self._queue.task_done()

    def _send(self, job):
        try:
            rep = self._materialize(job)
            rc = self.transport.submit(rep)
        except Exception as e:  # a bad value must not kill the thread
            self._counts["refused"] += 1
            with self._fail_lock:
                self._failures["send"] += 1
            self._complain_refused(logging.ERROR, "foreshock: report of step %d refused: %s",
                           job.step, e)
            return
        if rc != 0:
            self._counts["dropped_submit"] += 1
            self._complain_drop(logging.WARNING,
                           "foreshock: report of step %d dropped by libforeshock (%s); the "
                           "daemon is unreachable or slow and the replay buffer is full "
                           "(%d dropped so far)", job.step, os.strerror(-rc),
                           self._counts["dropped_submit"])
        self._watch_connection()

    def _watch_connection(self):
        try:
            st = self.transport.stats()
        except Exception:
            return
        refused = st.get("daemon_refused", 0)
        if refused > self._daemon_refused:
            self._complain_daemon(logging.ERROR, "foreshock: the daemon refused %d report(s) "
                                  "for good, dropped (%d so far): %s", refused -
                                  self._daemon_refused, refused, st.get("last_error") or "")
            self._daemon_refused = refused
        state = bool(st.get("connected"))
        if state != self._conn_state:
            if state:
                log.info("foreshock: connected to the daemon (run %s rank %d)", self.run,
                         self.rank)
            elif self._conn_state is not None or st.get("connect_failures"):
                self._complain_conn(logging.WARNING, "foreshock: daemon not connected: %s; "
                               "buffering reports", st.get("last_error") or "connecting")
            self._conn_state = state

    # ---- control -----------------------------------------------------------------------------

    @property
    def advice(self):
        """Advices received and not handled by on_advice (a list the caller
        may act on and clear), oldest first."""
        return self._inbox.pending

    def stats(self):
        """Counters: the transport's (submitted, acked, dropped, buffered_*,
        reconnects, connected, ...) plus reports (made by step()),
        dropped_queue, refused, spectra_on_host (sketch steps whose spectra
        were solved on the host CPU: all of them with spectra_on="host" or
        a model on the CPU; with "device", those beyond device_sketches), the
        measured step() overhead on the training thread (step_overhead_s,
        sketch_step_overhead_s, plain_step_overhead_s: means, seconds; a
        sketch step whose Grams were skipped counts as plain),
        sketches_skipped_busy (sketch steps whose Grams were skipped: the
        sender still held sketches_in_flight of them), pinned_allocs (host
        buffers pinned, at most PINNED_KEEP in steady state) and
        the sender thread's CPU time (sender_cpu_s, sender_cpu_per_report_s);
        failures (counts by stage, STAGES) and disabled_modules (the
        modules no longer monitored, name -> why). Never raises: a transport
        whose stats fail counts as a "send" failure and gives no keys. After
        close(): the final counts close() returned (the connection is gone)."""
        if self._closed and self._final:
            return dict(self._final)
        out = self._guarded("send", None, lambda: dict(self.transport.stats()))
        out = {} if out is _FAILED else out
        out.update(self._counts)
        with self._fail_lock:
            out["failures"] = dict(self._failures)
            disabled = dict(self._disabled)
        out["disabled_modules"] = {self._name(k): why for k, why in sorted(disabled.items())}
        o = self._overhead
        out["step_calls"] = o["steps"]
        out["step_overhead_s"] = o["seconds"] / o["steps"] if o["steps"] else 0.0
        out["sketch_steps"] = o["sketch_steps"]
        out["sketch_step_overhead_s"] = (o["sketch_seconds"] / o["sketch_steps"]
                                         if o["sketch_steps"] else 0.0)
        plain = o["steps"] - o["sketch_steps"]
        out["plain_step_overhead_s"] = ((o["seconds"] - o["sketch_seconds"]) / plain
                                        if plain else 0.0)
        out["sender_cpu_s"] = self._sender_cpu_s
        out["pinned_allocs"] = self._pinned_allocs
        out["sender_cpu_per_report_s"] = (self._sender_cpu_s / self._counts["reports"]
                                          if self._counts["reports"] else 0.0)
        return out

    def _drain(self, deadline):
        """Waits until the sender thread has handed over every queued job."""
        while self._queue.unfinished_tasks > 0:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def flush(self, timeout_s=None):
        """Waits until everything step() made so far is handed over and
        acknowledged by the daemon (or dropped). Returns the transport's
        flush result (0, or a negative errno such as -ETIMEDOUT). Blocks
        the caller: for the end of training or a checkpoint, not per step.
        Never raises: a transport that fails gives -EIO (counted, "send")."""
        rc = self._guarded("send", None, self._flush, timeout_s)
        return -errno.EIO if rc is _FAILED else rc

    def _flush(self, timeout_s):
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._drain(deadline)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.transport.flush(left)

    def close(self, timeout_s=30.0):
        """Removes the hooks, lets the sender hand over what is queued, waits
        up to timeout_s for the daemon's acks, closes the connection and logs
        the final counts. Returns the final stats dict. Idempotent. Never
        raises: what fails is counted ("send") and the rest still runs."""
        if self._closed:
            return self._final
        self._closed = True
        self._final = {}
        if self._later is not None:
            self._guarded("hook", None, self._later[1].remove)
            self._later = None
        for h in self._hooks:
            self._guarded("hook", None, h.remove)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._queue.put(None)  # unbounded wait for a slot: the sender drains the queue
        self._sender.join()
        if self._spectra_pool is not None:
            self._guarded("send", None, self._spectra_pool.shutdown)
            self._spectra_pool = None
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        rc = self._guarded("send", None, self.transport.flush, left)
        rc = -errno.EIO if rc is _FAILED else rc
        final = self.stats()
        self._guarded("send", None, self.transport.close, 0)
        dropped = final.get("dropped", 0) + self._counts["dropped_queue"]
        unacked = final.get("buffered_reports", 0)
        level = logging.WARNING if dropped or unacked else logging.INFO
        log.log(level, "foreshock: closed run %s rank %d: %d reports, %d acked, %d dropped "
                "(%d by the replay bound, %d by the sender queue), %d unacknowledged%s",
                self.run, self.rank, self._counts["reports"], final.get("acked", 0), dropped,
                final.get("dropped", 0), self._counts["dropped_queue"], unacked,
                "" if rc == 0 else f" (flush: {os.strerror(-rc)})")
        self._final = final
        return final

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._guarded("send", None, self.close)
        return False
