"""A fused one-pass kernel for compute.checkpoint_series's per-tensor counts (C, built with the
system C compiler on first use, loaded with ctypes; numpy is the fallback).

Why: the counts of one tensor pair (update sparsity in both conventions, the float32 delta's
squared sum and maximum, the bf16 equality of float32 weights) are a dozen vectorised numpy
passes over each cache-sized chunk; with the page cache warm that is ~10x the time to read the
tensors (benchmarks/bench_series.py). One C loop reads each pair once and does every count in
registers: the series then costs about what reading costs.

Definitions are the numpy path's (compute.checkpoint_series.tensor_counts), element by element:
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
