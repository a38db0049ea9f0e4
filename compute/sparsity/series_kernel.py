"""A fused one-pass kernel for compute.sparsity.series's per-tensor counts (C, built with the
system C compiler on first use, loaded with ctypes; numpy is the fallback).

Why: the counts of one tensor pair (update sparsity in both conventions, the float32 delta's
squared sum and maximum, the bf16 equality of float32 weights) are a dozen vectorised numpy
passes over each cache-sized chunk; with the page cache warm that is ~10x the time to read the
tensors (benchmarks/bench_series.py). One C loop reads each pair once and does every count in
registers: the series then costs about what reading costs.

Definitions are the numpy path's (compute.sparsity.series.tensor_counts), element by element:
d = |float32(cur) - float32(ref)| in float32 (bfloat16 widened exactly), `unchanged_exact`: d <= 0,
`unchanged_atol`: d <= float32(atol), bf16 rounding by c10::BFloat16's bit trick (round to nearest,
ties to even), thresholds compared in float32. Counts are exact integers, so they equal the numpy
path's; the squared sum is accumulated in float64 over 16 interleaved lanes in a fixed order
(deterministic; the numpy path sums float32 dot products per chunk, so the two agree to ~1e-7
relative, not bit for bit); the maximum ignores NaN.

The shared library is built once per machine into $XDG_CACHE_HOME/fisherlens (or ~/.cache/fisherlens),
named by a hash of the source, the compiler flags and the CPU's feature flags (it is built with
-march=native), written atomically. No compiler, a failed build or FISHERLENS_SERIES_KERNEL=0: the
numpy path runs (same counts).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

LANES = 16
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-std=c11"]

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#define L 16
static inline float f_bf16(uint16_t b) { uint32_t u = ((uint32_t)b) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float f_f32(float x) { return x; }
static inline float rbf16(float x) {
  uint32_t u; memcpy(&u, &x, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  float f; memcpy(&f, &u, 4); return f;
}

/* out: [d <= 0, d <= A, d <= T (both bf16), dd <= 0, dd <= T (otherwise)]; T is inclusive */
#define BODY(CLOAD, RLOAD, BOTH16, j, idx)                                                        \
  { float cv = CLOAD(c[idx]), rv = RLOAD(r[idx]);                                                \
    float d = cv - rv; d = d < 0 ? -d : d;                                                      \
    c0[j] += (d <= 0.0f); c1[j] += (d <= A);                                                    \
    s[j] += (double)d * (double)d;                                                              \
    m[j] = d > m[j] ? d : m[j];                                                                 \
    if (BOTH16) { c2[j] += (d <= T); }                                                          \
    else { float dd = rbf16(cv) - rbf16(rv); dd = dd < 0 ? -dd : dd;                            \
           c3[j] += (dd <= 0.0f); c4[j] += (dd <= T); } }

#define FLUSH                                                                                    \
  for (int j = 0; j < L; j++) {                                                                  \
    out[0] += c0[j]; out[1] += c1[j]; out[2] += c2[j]; out[3] += c3[j]; out[4] += c4[j];         \
    c0[j] = c1[j] = c2[j] = c3[j] = c4[j] = 0; }

#define KERNEL(NAME, CT, CLOAD, RT, RLOAD, BOTH16)                                               \
void NAME(const CT* restrict c, const RT* restrict r, int64_t n, float A, float T,               \
          int64_t* out, double* sq, float* mx) {                                                 \
  int32_t c0[L] = {0}, c1[L] = {0}, c2[L] = {0}, c3[L] = {0}, c4[L] = {0};                      \
  double s[L] = {0}; float m[L] = {0};                                                          \
  int64_t nb = n - n % L, blk = 0;                                                               \
  for (int64_t i = 0; i < nb; i += L) {                                                         \
    for (int j = 0; j < L; j++) BODY(CLOAD, RLOAD, BOTH16, j, i + j)                            \
    if (++blk == (1 << 24)) { blk = 0; FLUSH }                                                   \
  }                                                                                             \
  for (int64_t i = nb; i < n; i++) { int j = (int)(i - nb); BODY(CLOAD, RLOAD, BOTH16, j, i) }  \
  FLUSH                                                                                         \
  double ss = 0; float mm = 0;                                                                  \
  for (int j = 0; j < L; j++) { ss += s[j]; mm = m[j] > mm ? m[j] : mm; }                      \
  *sq = ss; *mx = mm;                                                                           \
}

/* The Fisher's share of a point, for one current tensor against two references (bf16 or f32
   each, kind 1 / 0): over the AUC sample (sorted flat indices, or every coordinate when sample is
   NULL) the sum of 2 x mid-rank per grouping (r2: m x 4 int32) over the coordinates where cur !=
   ref (compared as float32: NaN unequal, -0 == +0) and their number; over the support (sorted
   flat indices) the coordinates whose float32 delta is nonzero and the delta's squared sum.
   out: per reference 5 int64 [4 rank sums, changed]; sup: per reference changed; sq: per reference. */
static inline float ld(const void* p, int kind, int64_t i) {
  return kind ? f_bf16(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}
void fisher_pair(const void* c, int ck, const void* a, int ak, const void* b, int bk,
                 const int64_t* sample, int64_t m, const int32_t* r2,
                 const int64_t* support, int64_t s, int64_t* out, int64_t* sup, double* sq) {
  int64_t o[10] = {0};
  for (int64_t i = 0; i < m; i++) {
    int64_t x = sample ? sample[i] : i;
    float cv = ld(c, ck, x), av = ld(a, ak, x), bv = ld(b, bk, x);
    const int32_t* r = r2 + 4 * i;
    int64_t la = cv != av, lb = cv != bv;
    o[0] += la * r[0]; o[1] += la * r[1]; o[2] += la * r[2]; o[3] += la * r[3]; o[4] += la;
    o[5] += lb * r[0]; o[6] += lb * r[1]; o[7] += lb * r[2]; o[8] += lb * r[3]; o[9] += lb;
  }
  for (int j = 0; j < 10; j++) out[j] = o[j];
  int64_t na = 0, nb = 0; double qa = 0, qb = 0;
  for (int64_t i = 0; i < s; i++) {
    int64_t x = support[i];
    float cv = ld(c, ck, x);
    float da = cv - ld(a, ak, x), db = cv - ld(b, bk, x);
    na += da != 0.0f; nb += db != 0.0f;
    qa += (double)da * (double)da; qb += (double)db * (double)db;
  }
  sup[0] = na; sup[1] = nb; sq[0] = qa; sq[1] = qb;
}

KERNEL(counts_bb, uint16_t, f_bf16, uint16_t, f_bf16, 1)
KERNEL(counts_ff, float, f_f32, float, f_f32, 0)
KERNEL(counts_bf, uint16_t, f_bf16, float, f_f32, 0)
KERNEL(counts_fb, float, f_f32, uint16_t, f_bf16, 0)
"""

_KINDS = {np.dtype(np.uint16): "b", np.dtype(np.float32): "f"}  # bfloat16 travels as its uint16 bits
_lock = threading.Lock()
_lib: Any = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "fisherlens"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build() -> Any:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc / gcc) on PATH")
    key = hashlib.sha256("\n".join([SOURCE, cc, " ".join(FLAGS), platform.machine(), _cpu_flags()]).encode())
    out = _cache_dir() / f"series_kernel_{key.hexdigest()[:16]}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src, so = Path(tmp) / "k.c", Path(tmp) / "k.so"
            src.write_text(SOURCE)
            proc = subprocess.run([cc, *FLAGS, "-o", str(so), str(src)], capture_output=True, text=True,
                                  timeout=120)
            if proc.returncode != 0:
                raise OSError(f"{cc} failed: {proc.stderr.strip()[:500]}")
            os.replace(so, out)
    lib = ctypes.CDLL(str(out))
    p = ctypes.c_void_p
    for a in "bf":
        for b in "bf":
            fn = getattr(lib, f"counts_{a}{b}")
            fn.argtypes = [p, p, ctypes.c_int64, ctypes.c_float, ctypes.c_float, p, p, p]
            fn.restype = None
    i = ctypes.c_int
    lib.fisher_pair.argtypes = [p, i, p, i, p, i, p, ctypes.c_int64, p, p, ctypes.c_int64, p, p, p]
    lib.fisher_pair.restype = None
    return lib


def kernel() -> Any:
    """The loaded library, or None (no compiler, a failed build, FISHERLENS_SERIES_KERNEL=0)."""
    global _lib, _tried
    if os.environ.get("FISHERLENS_SERIES_KERNEL", "1") == "0":
        return None
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = _build()
            except Exception as exc:  # noqa: BLE001 - any build or load failure means: use numpy
                log.warning("series kernel unavailable, using numpy (%s: %s)", type(exc).__name__, exc)
                _lib = None
    return _lib


def supported(c: np.ndarray, r: np.ndarray) -> bool:
    return c.dtype in _KINDS and r.dtype in _KINDS


def pair_counts(lib: Any, c: np.ndarray, r: np.ndarray, atol32: np.float32, t16: np.float32,
                inclusive16: bool) -> tuple[list[int], float, float]:
    """([d <= 0, d <= atol, d <= t16, dd <= 0, dd <= t16], sum d^2, max d) of one flat pair
    (contiguous; bfloat16 as uint16 bits, or float32): see the module docstring."""
    c, r = np.ascontiguousarray(c), np.ascontiguousarray(r)
    t = t16 if inclusive16 else np.nextafter(t16, np.float32(0))  # x < t  <=>  x <= the float below t
    out = np.zeros(5, np.int64)
    sq = np.zeros(1, np.float64)
    mx = np.zeros(1, np.float32)
    fn = getattr(lib, f"counts_{_KINDS[c.dtype]}{_KINDS[r.dtype]}")
    fn(c.ctypes.data, r.ctypes.data, c.size, float(atol32), float(t), out.ctypes.data, sq.ctypes.data,
       mx.ctypes.data)
    return [int(x) for x in out], float(sq[0]), float(mx[0])


def fisher_pair(lib: Any, c: np.ndarray, refs: list[np.ndarray], sample: np.ndarray | None, m: int,
                r2: np.ndarray, support: np.ndarray) -> list[tuple[list[int], int, int, float]]:
    """Per reference: ([rank sums x 2 per grouping], changed in the sample, changed on the
    support, squared delta on the support) (see SOURCE's fisher_pair). c and refs: flat,
    contiguous, bfloat16 bits (uint16) or float32; sample / support: sorted int64 indices
    (sample None: every coordinate); r2: (m, 4) int32, 2 x the mid-ranks."""
    c = np.ascontiguousarray(c)
    a, b = (np.ascontiguousarray(r) for r in refs)
    sample = None if sample is None else np.ascontiguousarray(sample, dtype=np.int64)
    support = np.ascontiguousarray(support, dtype=np.int64)
    r2 = np.ascontiguousarray(r2, dtype=np.int32)
    out = np.zeros(10, np.int64)
    sup = np.zeros(2, np.int64)
    sq = np.zeros(2, np.float64)
    kind = {np.dtype(np.uint16): 1, np.dtype(np.float32): 0}
    lib.fisher_pair(c.ctypes.data, kind[c.dtype], a.ctypes.data, kind[a.dtype], b.ctypes.data, kind[b.dtype],
                    None if sample is None else sample.ctypes.data, m, r2.ctypes.data,
                    support.ctypes.data, support.size, out.ctypes.data, sup.ctypes.data, sq.ctypes.data)
    return [([int(x) for x in out[5 * j:5 * j + 4]], int(out[5 * j + 4]), int(sup[j]), float(sq[j]))
            for j in range(2)]
