"""ctypes binding to libforeshock (client/include/foreshock.h).

Why ctypes and not a Python protocol implementation: libforeshock already
owns the hard parts (background I/O thread, bounded replay buffer,
reconnect with backoff, resume from Welcome, acks only after the daemon's
commit) and they are tested against the real daemon. Python only builds
reports from numpy arrays and hands them over; fsc_submit copies and never
blocks on the network.

The library is found, in order: the `path` argument, $FORESHOCK_LIB (each
an explicit choice, so either is the only candidate), the copy a wheel
carries (foreshock/_native/libforeshock.so.0, put there by setup.py), the
build tree of the repository this package sits in (build/libforeshock.so),
then the system loader (libforeshock.so.0 / libforeshock.so: the
libforeshock0 package).
"""
import contextlib
import ctypes
import ctypes.util
import errno
import os
import threading

import numpy as np

# Mirrors of client/include/foreshock.h. The library checks options.size
# against its own sizeof, so a layout mismatch is refused, not misread.
KV_HEAD_NONE = 0xFFFFFFFF
MAX_DH = 512
MAX_EXPERTS = 1024
MAX_LAYERS = 4096
MAX_HEADS = 1024
MAX_WINDOW = 1 << 20
MAX_SHARDS = 65536
MAX_RUN_ID_LEN = 128
MIN_REPLAY_BYTES = 64 << 10
MAX_LOCAL_RANKS = 4096
MAX_OPTIMIZER_LEN = 64   # ModelShape.optimizer: 1..64 bytes of printable ASCII
ERROR_LEN = 256

# Where a wheel carries the library, relative to this package (setup.py).
BUNDLED_LIB = os.path.join("_native", "libforeshock.so.0")


class _ModelShape(ctypes.Structure):
    _fields_ = [("n_layers", ctypes.c_uint32), ("n_heads", ctypes.c_uint32),
                ("n_kv_heads", ctypes.c_uint32), ("d_model", ctypes.c_uint32),
                ("d_head", ctypes.c_uint32), ("n_experts", ctypes.c_uint32),
                ("top_k", ctypes.c_uint32), ("moe_layers", ctypes.POINTER(ctypes.c_uint32)),
                ("n_moe_layers", ctypes.c_size_t)]


_LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)


class _Options(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("host", ctypes.c_char_p), ("port", ctypes.c_uint16),
                ("run_id", ctypes.c_char_p), ("attempt", ctypes.c_uint32),
                ("rank", ctypes.c_uint32), ("world_size", ctypes.c_uint32),
                ("token", ctypes.c_char_p), ("detect_from_step", ctypes.c_uint64),
                ("replay_max_bytes", ctypes.c_size_t), ("max_report_bytes", ctypes.c_size_t),
                ("backoff_min_ms", ctypes.c_uint), ("backoff_max_ms", ctypes.c_uint),
                ("connect_timeout_ms", ctypes.c_uint), ("handshake_timeout_ms", ctypes.c_uint),
                ("model", _ModelShape), ("client_name", ctypes.c_char_p),
                ("log", _LOG_FN), ("log_ctx", ctypes.c_void_p), ("seed", ctypes.c_uint64),
                ("record_path", ctypes.c_char_p), ("record_only", ctypes.c_int),
                ("local_ranks", ctypes.POINTER(ctypes.c_uint32)),
                ("n_local_ranks", ctypes.c_size_t), ("tls", ctypes.c_int),
                ("tls_ca_file", ctypes.c_char_p), ("tls_cert_file", ctypes.c_char_p),
                ("tls_key_file", ctypes.c_char_p), ("tls_server_name", ctypes.c_char_p),
                ("advice", ctypes.c_int), ("resume", ctypes.c_int),
                ("resume_step", ctypes.c_uint64), ("optimizer", ctypes.c_char_p)]


def optimizer_name_ok(name):
    """Whether name can go as ModelShape.optimizer: a str of
    1..MAX_OPTIMIZER_LEN printable ASCII characters (0x20..0x7e), what
    libforeshock and the daemon accept."""
    return isinstance(name, str) and 0 < len(name) <= MAX_OPTIMIZER_LEN and \
        all(" " <= ch <= "~" for ch in name)


class _Stats(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("submitted", ctypes.c_uint64),
                ("acked", ctypes.c_uint64), ("dropped", ctypes.c_uint64),
                ("sent", ctypes.c_uint64), ("resent", ctypes.c_uint64),
                ("reconnects", ctypes.c_uint64), ("connect_failures", ctypes.c_uint64),
                ("buffered_reports", ctypes.c_uint64), ("buffered_bytes", ctypes.c_uint64),
                ("seq_offset", ctypes.c_uint64), ("connected", ctypes.c_int),
                ("failed", ctypes.c_int), ("last_error", ctypes.c_char * ERROR_LEN),
                ("recorded", ctypes.c_uint64), ("record_failed", ctypes.c_int),
                ("daemon_refused", ctypes.c_uint64),
                ("advice_received", ctypes.c_uint64), ("advice_pending", ctypes.c_uint64),
                ("advice_taken", ctypes.c_uint64), ("advice_dropped", ctypes.c_uint64)]


ADVICE_RULE_LEN, ADVICE_LABEL_LEN, ADVICE_SEVERITY_LEN = 64, 32, 16
ADVICE_ACTIONS = {1: "checkpoint", 2: "checkpoint_and_stop", 3: "resolved", 4: "superseded"}


class _Advice(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("advice_id", ctypes.c_uint64),
                ("action", ctypes.c_int), ("alert_id", ctypes.c_uint64),
                ("rule", ctypes.c_char * ADVICE_RULE_LEN),
                ("label", ctypes.c_char * ADVICE_LABEL_LEN),
                ("severity", ctypes.c_char * ADVICE_SEVERITY_LEN),
                ("step", ctypes.c_int64), ("first_breach_step", ctypes.c_int64),
                ("fired_step", ctypes.c_int64), ("rollback_step", ctypes.c_int64),
                ("layer", ctypes.c_int32), ("head", ctypes.c_int32),
                ("window", ctypes.c_int32), ("rank", ctypes.c_int32)]


_F32P = ctypes.POINTER(ctypes.c_float)


class _Spectrum(ctypes.Structure):
    _fields_ = [("d2", _F32P), ("n_d2", ctypes.c_size_t), ("d3", _F32P),
                ("n_d3", ctypes.c_size_t), ("d1", _F32P), ("n_d1", ctypes.c_size_t),
                ("w", _F32P), ("n_w", ctypes.c_size_t), ("q_delta_sq", ctypes.c_double),
                ("q_sq", ctypes.c_double), ("k_sq", ctypes.c_double),
                ("k_delta_sq", ctypes.c_double), ("cqk", ctypes.c_double),
                ("has", ctypes.c_uint)]


SPECTRUM_HAS_NORMS = 1 | 2 | 4 | 8   # FSC_SPECTRUM_HAS_Q_DELTA_SQ .. K_DELTA_SQ
SPECTRUM_HAS_CQK = 16
_F64P = ctypes.POINTER(ctypes.c_double)
_U64P = ctypes.POINTER(ctypes.c_uint64)
_u32, _u64, _dbl, _vp, _sz = (ctypes.c_uint32, ctypes.c_uint64, ctypes.c_double,
                              ctypes.c_void_p, ctypes.c_size_t)

_SIGNATURES = {
    "fsc_version": (ctypes.c_char_p, []),
    "fsc_open": (ctypes.c_int, [ctypes.POINTER(_Options), ctypes.POINTER(_vp),
                                ctypes.c_char_p, _sz]),
    "fsc_submit": (ctypes.c_int, [_vp, _vp]),
    "fsc_flush": (ctypes.c_int, [_vp, ctypes.c_int]),
    "fsc_stats": (None, [_vp, ctypes.POINTER(_Stats)]),
    "fsc_close_timeout": (ctypes.c_int, [_vp, ctypes.c_int]),
    "fsc_report_new": (_vp, [_u64]),
    "fsc_report_free": (None, [_vp]),
    "fsc_report_set_loss": (ctypes.c_int, [_vp, _dbl]),
    "fsc_report_set_grad_norm": (ctypes.c_int, [_vp, _dbl]),
    "fsc_report_set_lr": (ctypes.c_int, [_vp, _dbl]),
    "fsc_report_set_loss_scale": (ctypes.c_int, [_vp, _dbl]),
    "fsc_report_set_step_time": (ctypes.c_int, [_vp, _dbl]),
    "fsc_report_set_time": (ctypes.c_int, [_vp, _dbl]),
    "fsc_report_set_tokens": (ctypes.c_int, [_vp, _u64]),
    "fsc_report_set_layer_weight_norms": (ctypes.c_int, [_vp, _F32P, _sz]),
    "fsc_report_set_layer_update_ratios": (ctypes.c_int, [_vp, _F32P, _sz]),
    "fsc_report_set_step_update_ratio": (ctypes.c_int, [_vp, _dbl]),
    "fsc_report_add_attention_gram": (ctypes.c_int, [_vp, _u32, _u32, _u32, _u32, _u32, _u32,
                                                     _u32, _F32P, _F32P]),
    "fsc_report_add_attention_spectrum": (ctypes.c_int, [_vp, _u32, _u32, _u32, _u32,
                                                         ctypes.POINTER(_Spectrum)]),
    "fsc_report_add_router_gram": (ctypes.c_int, [_vp, _u32, _u32, _u32, _u32, _F32P]),
    "fsc_report_add_router_tokens": (ctypes.c_int, [_vp, _u32, _u32, _u64, _dbl, _dbl, _dbl,
                                                    _U64P, _F64P]),
    "fsc_poll_advice": (ctypes.c_int, [_vp, ctypes.POINTER(_Advice)]),
}

# Functions added after the first release: a library without them still
# loads, and what they set is left out of the reports (build_report).
_LATER = frozenset({"fsc_report_set_step_update_ratio"})

_lib_lock = threading.Lock()
_lib_cache = {}


def _candidates(path):
    if path:
        yield path
        return
    env = os.environ.get("FORESHOCK_LIB")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, BUNDLED_LIB)
    repo = os.path.normpath(os.path.join(here, "..", "..", ".."))
    yield os.path.join(repo, "build", "libforeshock.so")
    found = ctypes.util.find_library("foreshock")
    if found:
        yield found
    yield "libforeshock.so.0"


def load(path=None):
    """Loads libforeshock once per path and declares every function's
    signature. Raises OSError naming what was tried when nothing loads."""
    with _lib_lock:
        if path in _lib_cache:
            return _lib_cache[path]
        tried = []
        for cand in _candidates(path):
            if os.sep in cand and not os.path.exists(cand):
                tried.append(cand + " (missing)")
                continue
            try:
                lib = ctypes.CDLL(cand)
            except OSError as e:
                tried.append(f"{cand} ({e})")
                continue
            lib.fs_missing = set()
            for name, (res, args) in _SIGNATURES.items():
                fn = getattr(lib, name, None)
                if fn is None and name in _LATER:
                    lib.fs_missing.add(name)
                    continue
                if fn is None:
                    raise OSError(f"{cand} has no {name}: a libforeshock older than this "
                                  "client; use the library built with it (FORESHOCK_LIB)")
                fn.restype, fn.argtypes = res, args
            _lib_cache[path] = lib
            return lib
        raise OSError("libforeshock not found; install the foreshock wheel (it carries "
                      "the library) or the libforeshock0 package, build it (make "
                      "foreshock), or set FORESHOCK_LIB. Tried: " + "; ".join(tried))


def _f32(a):
    a = np.ascontiguousarray(a, dtype=np.float32)
    return a, a.ctypes.data_as(_F32P)


def _check(rc, what):
    if rc != 0:
        raise ValueError(f"{what}: {os.strerror(-rc) if rc < 0 else rc} ({rc})")


def _add_spectrum(lib, r, g):
    """One foreshock.report.AttentionSpectrum into the report handle r."""
    s = _Spectrum()
    keep = []
    for name in ("d2", "d3", "d1", "w"):
        a, p = _f32(getattr(g, name))
        keep.append(a)
        setattr(s, name, p)
        setattr(s, "n_" + name, a.size)
    s.q_delta_sq, s.q_sq = float(g.q_delta_sq), float(g.q_sq)
    s.k_sq, s.k_delta_sq = float(g.k_sq), float(g.k_delta_sq)
    s.has = SPECTRUM_HAS_NORMS
    if g.cqk is not None:
        s.cqk = float(g.cqk)
        s.has |= SPECTRUM_HAS_CQK
    kv = KV_HEAD_NONE if g.kv_head is None else g.kv_head
    _check(lib.fsc_report_add_attention_spectrum(r, g.layer, g.head, kv, g.window,
                                                 ctypes.byref(s)),
           f"attention spectrum layer {g.layer} head {g.head}")


def build_report(lib, rep):
    """Turns a foreshock.report.Report into an fsc_report handle (owned by
    the caller until submitted). Raises ValueError when the library refuses
    a value (the handle is freed)."""
    r = lib.fsc_report_new(rep.step)
    if not r:
        raise MemoryError("fsc_report_new")
    try:
        s = rep.scalars
        for key, fn in (("loss", lib.fsc_report_set_loss),
                        ("grad_norm", lib.fsc_report_set_grad_norm),
                        ("lr", lib.fsc_report_set_lr),
                        ("loss_scale", lib.fsc_report_set_loss_scale),
                        ("step_time", lib.fsc_report_set_step_time)):
            if s.get(key) is not None:
                _check(fn(r, float(s[key])), key)
        if s.get("tokens") is not None:
            _check(lib.fsc_report_set_tokens(r, int(s["tokens"])), "tokens")
        if s.get("step_update_ratio") is not None and \
                "fsc_report_set_step_update_ratio" not in lib.fs_missing:
            _check(lib.fsc_report_set_step_update_ratio(r, float(s["step_update_ratio"])),
                   "step_update_ratio")
        if rep.time_unix is not None:
            _check(lib.fsc_report_set_time(r, float(rep.time_unix)), "time")
        if rep.layer_weight_norm is not None:
            a, p = _f32(rep.layer_weight_norm)
            _check(lib.fsc_report_set_layer_weight_norms(r, p, a.size), "layer_weight_norm")
        if rep.layer_update_ratio is not None:
            a, p = _f32(rep.layer_update_ratio)
            _check(lib.fsc_report_set_layer_update_ratios(r, p, a.size), "layer_update_ratio")
        for g in rep.attention:
            if hasattr(g, "d2"):
                _add_spectrum(lib, r, g)
                continue
            ga, pga = _f32(g.ga)
            gb, pgb = _f32(g.gb)
            kv = KV_HEAD_NONE if g.kv_head is None else g.kv_head
            _check(lib.fsc_report_add_attention_gram(r, g.layer, g.head, kv, g.window, g.dh,
                                                     g.shard_index, g.shard_count, pga, pgb),
                   f"attention gram layer {g.layer} head {g.head}")
        for g in rep.router_grams:
            a, p = _f32(g.gram)
            _check(lib.fsc_report_add_router_gram(r, g.layer, g.n_experts, g.shard_index,
                                                  g.shard_count, p),
                   f"router gram layer {g.layer}")
        for t in rep.router_tokens:
            load = np.ascontiguousarray(t.load, dtype=np.uint64)
            sp = np.ascontiguousarray(t.sum_p, dtype=np.float64)
            _check(lib.fsc_report_add_router_tokens(r, t.layer, t.n_experts, t.n_tok, t.sum_h,
                                                    t.sum_h2, t.sum_lse2,
                                                    load.ctypes.data_as(_U64P),
                                                    sp.ctypes.data_as(_F64P)),
                   f"router tokens layer {t.layer}")
    except BaseException:
        lib.fsc_report_free(r)
        raise
    return r


class Client:
    """One libforeshock client: one (run, attempt, rank) stream. submit()
    never blocks on the network. Thread-safe: submit, flush, stats and
    poll_advice from any thread, close from any thread, any number of
    times. The C handle is freed by close, so every call holds it as a
    user (_held) and close waits for the calls in progress; a call after
    close does nothing and says so (-EBADF, empty stats, no advice).
    Once close has begun, submit is refused (-EBADF): close flushes what
    was queued before it, not a stream another thread keeps feeding."""

    def __init__(self, host, port, run_id, rank=0, world_size=1, attempt=0, token=None,
                 detect_from_step=0, replay_max_bytes=0, model=None, client_name=None,
                 backoff_max_ms=0, lib_path=None, record_path=None, record_only=False,
                 local_ranks=None, tls=False, tls_ca=None, tls_cert=None, tls_key=None,
                 tls_server_name=None, advice=False, resume_step=None, optimizer=None):
        """optimizer: the training optimizer's class name, sent in Hello's
        model shape (optimizer_name_ok; fsc_open refuses another)."""
        self.lib = load(lib_path)
        o = _Options()
        o.size = ctypes.sizeof(_Options)
        # Keep every buffer the struct points at alive until fsc_open returns
        # (it copies them).
        self._keep = [host.encode(), run_id.encode(),
                      (token or "").encode(), (client_name or "").encode()]
        o.host = self._keep[0]
        o.port = port
        o.run_id = self._keep[1]
        o.attempt, o.rank, o.world_size = attempt, rank, world_size
        o.token = self._keep[2] if token else None
        o.detect_from_step = detect_from_step or 0
        o.replay_max_bytes = replay_max_bytes or 0
        o.backoff_max_ms = backoff_max_ms or 0
        o.client_name = self._keep[3] if client_name else None
        o.advice = 1 if advice else 0
        if resume_step is not None:
            o.resume, o.resume_step = 1, int(resume_step)
        if optimizer is not None:
            if not optimizer_name_ok(optimizer):
                raise ValueError(f"optimizer {optimizer!r}: 1..{MAX_OPTIMIZER_LEN} printable "
                                 "ASCII characters")
            self._keep.append(optimizer.encode("ascii"))
            o.optimizer = self._keep[-1]
        if record_path:
            self._keep.append(os.fsencode(record_path))
            o.record_path = self._keep[-1]
            o.record_only = 1 if record_only else 0
        if tls or tls_ca or tls_cert or tls_key or tls_server_name:
            o.tls = 1
            for field, value in (("tls_ca_file", tls_ca), ("tls_cert_file", tls_cert),
                                 ("tls_key_file", tls_key), ("tls_server_name", tls_server_name)):
                if value:
                    self._keep.append(os.fsencode(value))
                    setattr(o, field, self._keep[-1])
        if local_ranks:
            loc = [int(r) for r in local_ranks]
            arr = (ctypes.c_uint32 * len(loc))(*loc)
            self._keep.append(arr)
            o.local_ranks = ctypes.cast(arr, ctypes.POINTER(ctypes.c_uint32))
            o.n_local_ranks = len(loc)
        if model:
            moe = model.get("moe_layers") or []
            arr = (ctypes.c_uint32 * max(1, len(moe)))(*moe)
            self._keep.append(arr)
            m = o.model
            for k in ("n_layers", "n_heads", "n_kv_heads", "d_model", "d_head",
                      "n_experts", "top_k"):
                setattr(m, k, int(model.get(k) or 0))
            if moe:
                m.moe_layers = ctypes.cast(arr, ctypes.POINTER(ctypes.c_uint32))
                m.n_moe_layers = len(moe)
        handle = _vp()
        err = ctypes.create_string_buffer(ERROR_LEN)
        rc = self.lib.fsc_open(ctypes.byref(o), ctypes.byref(handle), err, ERROR_LEN)
        if rc != 0:
            raise ValueError(f"fsc_open: {err.value.decode(errors='replace')} ({rc})")
        self._h = handle
        self._cv = threading.Condition()
        self._users = 0
        self._closing = False

    @contextlib.contextmanager
    def _held(self, new_reports=False):
        """The handle, counted as in use for the with block (close waits for
        it); None once closed (with new_reports, once close has begun)."""
        with self._cv:
            if self._h is None or (new_reports and self._closing):
                h = None
            else:
                self._users += 1
                h = self._h
        try:
            yield h
        finally:
            if h is not None:
                with self._cv:
                    self._users -= 1
                    if self._users == 0:
                        self._cv.notify_all()

    def submit(self, rep):
        """Builds and queues one report. Returns 0, or the negative errno the
        library gave (-ENOBUFS: the replay buffer is full; the report is
        dropped and counted by the library; -EBADF: closed)."""
        with self._held(new_reports=True) as h:
            if h is None:
                return -errno.EBADF
            return self.lib.fsc_submit(h, build_report(self.lib, rep))

    def poll_advice(self):
        """Takes every advice the daemon sent and this client has not handed
        over yet (each is then acknowledged to the daemon), oldest first:
        a list of dicts. Never blocks on the network."""
        out = []
        a = _Advice()
        with self._held() as h:
            while h is not None:
                a.size = ctypes.sizeof(_Advice)
                if self.lib.fsc_poll_advice(h, ctypes.byref(a)) <= 0:
                    break
                out.append(self._advice_dict(a))
        return out

    @staticmethod
    def _advice_dict(a):
        return {
            "advice_id": a.advice_id, "action": ADVICE_ACTIONS.get(a.action, "unknown"),
            "alert_id": a.alert_id, "rule": a.rule.decode(errors="replace"),
            "label": a.label.decode(errors="replace") or None,
            "severity": a.severity.decode(errors="replace") or None,
            "step": a.step if a.step >= 0 else None,
            "first_breach_step": a.first_breach_step if a.first_breach_step >= 0 else None,
            "fired_step": a.fired_step if a.fired_step >= 0 else None,
            "rollback_step": a.rollback_step if a.rollback_step >= 0 else None,
            "layer": a.layer if a.layer >= 0 else None,
            "head": a.head if a.head >= 0 else None,
            "window": a.window if a.window > 0 else None,
            "rank": a.rank if a.rank >= 0 else None}

    def flush(self, timeout_s):
        ms = -1 if timeout_s is None else int(timeout_s * 1000)
        with self._held() as h:
            return -errno.EBADF if h is None else self.lib.fsc_flush(h, ms)

    def stats(self):
        """The library's counters; {} once closed."""
        s = _Stats()
        s.size = ctypes.sizeof(_Stats)
        with self._held() as h:
            if h is None:
                return {}
            self.lib.fsc_stats(h, ctypes.byref(s))
        out = {k: getattr(s, k) for k, _ in _Stats._fields_ if k not in ("size", "last_error")}
        out["last_error"] = s.last_error.decode(errors="replace")
        return out

    def close(self, timeout_s=0):
        """Waits up to timeout_s (None: for ever) for the daemon's acks, then
        closes. The first call closes; later ones return 0. Calls in
        progress on other threads finish first (a flush(None) among them
        holds close until the daemon acks or the client fails)."""
        ms = -1 if timeout_s is None else int(timeout_s * 1000)
        with self._cv:
            self._closing = True
        with self._held() as h:
            if h is None:
                return 0
            rc = self.lib.fsc_flush(h, ms) if ms != 0 else 0
        with self._cv:
            h, self._h = self._h, None
            while self._users:
                self._cv.wait()
        if h is None:  # another thread closed it meanwhile
            return 0
        rc2 = self.lib.fsc_close_timeout(h, 0)
        return rc if rc != 0 else rc2


ENOBUFS = errno.ENOBUFS
