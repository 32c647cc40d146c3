"""Batched small-matrix linear algebra as MSL kernels: one threadgroup per matrix.

Each kernel copies its matrix into threadgroup memory, works there with the 32 lanes of
one simdgroup-sized threadgroup (barriers between dependent steps), and writes its
results back. The matrix size is static (one specialised kernel per size, as PyTorch's
MPS kernels are); the batch is the grid. float32 only (decompositions in half are not
accurate enough to be useful; Metal has no float64).

    cholesky   right-looking column Cholesky of the lower triangle; `info` as torch's
               cholesky_ex: 0, or k when the leading minor of order k is not positive
               definite (the factor is then not valid; no NaNs are written)
    qr         Householder QR, reduced: Q (m x n, orthonormal columns), R (n x n upper)
    svd        one-sided Jacobi (Hestenes), round-robin column pairs: U (m x n), S (n,),
               V (n x n); singular values descending
    eigh       two-sided Jacobi, round-robin pairs rotated in parallel: eigenvalues
               ascending, eigenvectors as columns

Sign convention (eigh and svd): each eigenvector / right singular vector is scaled so
that its entry of largest magnitude (the first such on ties) is positive, so results are
reproducible across runs and machines. Convergence: sweeps stop when the off-diagonal
mass (eigh) or every column pair's cosine (svd) is below float32's epsilon relative to
the matrix, bounded by `MAX_SWEEPS`.
"""

from __future__ import annotations

from kiln.codegen.metal.emit import PRELUDE, EmittedKernel
from kiln.codegen.metal.errors import KilnMetalArgumentError
from kiln.ir.shapes import symbol

THREADS = 32
MAX_SWEEPS = 30
TG_BYTES = 32768  # threadgroup memory every Apple GPU has
_ARGS = ("uint tg [[threadgroup_position_in_grid]]", "uint tid [[thread_index_in_threadgroup]]")


def _check(op: str, m: int, n: int, floats: int) -> None:
    if not (isinstance(m, int) and isinstance(n, int) and 1 <= n <= m):
        raise KilnMetalArgumentError(f"metal {op}: needs a static m x n matrix with 1 <= n <= m, got {m} x {n}")
    if 4 * floats > TG_BYTES:
        raise KilnMetalArgumentError(f"metal {op}: a {m} x {n} matrix needs {4 * floats} bytes of threadgroup "
                                     f"memory, more than the {TG_BYTES} every Apple GPU has",
                                     hint="use the CPU path for matrices this large")


def _kernel(name: str, params: list[str], body: str, doc: str, buffers: tuple) -> EmittedKernel:
    head = f"kernel void {name}(\n    " + ",\n    ".join(params + list(_ARGS)) + ") {"
    source = PRELUDE + f"\n// {doc}\n{head}\n{body}}}\n"
    return EmittedKernel(name, source, "linalg", buffers, (), THREADS, symbol("batch"))


def _pairs(n: int) -> str:
    """Round-robin pairing over an even count N (a dummy index n when n is odd): in round
    r, position 0 stays and the others rotate; pair k is (pos k, pos N-1-k)."""
    big = n + (n % 2)
    return f"""inline uint kiln_rr(uint pos, uint r) {{ return pos == 0 ? 0 : 1 + (pos - 1 + r) % {big - 1}; }}
"""


def cholesky(n: int) -> EmittedKernel:
    """L (n x n, lower) and info (int32) per matrix of a batch of symmetric n x n inputs."""
    _check("cholesky", n, n, n * n)
    body = f"""  threadgroup float A[{n * n}];
  threadgroup int bad;
  device const float* a = in_a + long(tg) * {n * n};
  for (uint l = tid; l < {n * n}; l += {THREADS}) A[l] = a[l];
  if (tid == 0) bad = 0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint j = 0; j < {n}; ++j) {{
    if (tid == 0) {{
      const float d = A[j * {n} + j];
      if (!(d > 0.0f) || !isfinite(d)) bad = int(j) + 1;  // not positive definite (or NaN)
      else A[j * {n} + j] = sqrt(d);
    }}
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (bad != 0) break;  // uniform: every lane reads the same value after the barrier
    const float djj = A[j * {n} + j];
    for (uint i = j + 1 + tid; i < {n}; i += {THREADS}) A[i * {n} + j] /= djj;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint rest = {n} - j - 1;
    for (uint l = tid; l < rest * rest; l += {THREADS}) {{
      const uint i = j + 1 + l / rest, k = j + 1 + l % rest;
      if (k <= i) A[i * {n} + k] -= A[i * {n} + j] * A[k * {n} + j];
    }}
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }}
  device float* o = out_l + long(tg) * {n * n};
  for (uint l = tid; l < {n * n}; l += {THREADS}) {{
    const uint i = l / {n}, k = l % {n};
    o[l] = (k <= i && bad == 0) ? A[l] : 0.0f;
  }}
  if (tid == 0) out_info[tg] = bad;
"""
    params = ["device const float* in_a [[buffer(0)]]", "device float* out_l [[buffer(1)]]",
              "device int* out_info [[buffer(2)]]"]
    return _kernel(f"kiln_cholesky_{n}", params, body,
                   f"batched Cholesky of {n} x {n}: one threadgroup of {THREADS} per matrix", ("a", "l", "info"))


def qr(m: int, n: int) -> EmittedKernel:
    """Reduced Householder QR: Q (m x n) and R (n x n) per m x n input."""
    _check("qr", m, n, m * n + m * m + m + 2)
    body = f"""  threadgroup float A[{m * n}];
  threadgroup float Q[{m * m}];
  threadgroup float v[{m}];
  threadgroup float vnorm2;
  device const float* a = in_a + long(tg) * {m * n};
  for (uint l = tid; l < {m * n}; l += {THREADS}) A[l] = a[l];
  for (uint l = tid; l < {m * m}; l += {THREADS}) Q[l] = (l / {m} == l % {m}) ? 1.0f : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint k = 0; k < {n}; ++k) {{
    if (tid == 0) {{  // v = x + sign(x0) |x| e0, the reflector that zeroes A[k+1:, k]
      float s = 0.0f;
      for (uint i = k; i < {m}; ++i) s += A[i * {n} + k] * A[i * {n} + k];
      const float x0 = A[k * {n} + k], alpha = x0 >= 0.0f ? -sqrt(s) : sqrt(s);
      for (uint i = k; i < {m}; ++i) v[i] = A[i * {n} + k];
      v[k] = x0 - alpha;
      vnorm2 = s - x0 * x0 + v[k] * v[k];
    }}
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float vv = vnorm2;
    if (vv > 0.0f) {{
      for (uint j = k + tid; j < {n}; j += {THREADS}) {{  // A = H A, one column per lane
        float d = 0.0f;
        for (uint i = k; i < {m}; ++i) d += v[i] * A[i * {n} + j];
        const float f = 2.0f * d / vv;
        for (uint i = k; i < {m}; ++i) A[i * {n} + j] -= f * v[i];
      }}
      for (uint r = tid; r < {m}; r += {THREADS}) {{  // Q = Q H, one row per lane
        float d = 0.0f;
        for (uint i = k; i < {m}; ++i) d += Q[r * {m} + i] * v[i];
        const float f = 2.0f * d / vv;
        for (uint i = k; i < {m}; ++i) Q[r * {m} + i] -= f * v[i];
      }}
    }}
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }}
  device float* q = out_q + long(tg) * {m * n};
  device float* rr = out_r + long(tg) * {n * n};
  for (uint l = tid; l < {m * n}; l += {THREADS}) q[l] = Q[(l / {n}) * {m} + l % {n}];
  for (uint l = tid; l < {n * n}; l += {THREADS}) rr[l] = (l % {n} >= l / {n}) ? A[l] : 0.0f;
"""
    params = ["device const float* in_a [[buffer(0)]]", "device float* out_q [[buffer(1)]]",
              "device float* out_r [[buffer(2)]]"]
    return _kernel(f"kiln_qr_{m}x{n}", params, body,
                   f"batched Householder QR of {m} x {n}: one threadgroup of {THREADS} per matrix", ("a", "q", "r"))


def _sign_fix(rows: int, cols: int, mat: str, extra: str = "") -> str:
    """Lane-parallel over columns: make each column's largest-|.| entry positive."""
    return f"""  for (uint c = tid; c < {cols}; c += {THREADS}) {{
    uint best = 0;
    for (uint r = 1; r < {rows}; ++r) if (fabs({mat}[r * {cols} + c]) > fabs({mat}[best * {cols} + c])) best = r;
    if ({mat}[best * {cols} + c] < 0.0f) {{
      for (uint r = 0; r < {rows}; ++r) {mat}[r * {cols} + c] = -{mat}[r * {cols} + c];
{extra}    }}
  }}
  threadgroup_barrier(mem_flags::mem_threadgroup);
"""


def eigh(n: int) -> EmittedKernel:
    """Eigenvalues ascending (n,) and eigenvectors (n x n, columns) per symmetric input."""
    _check("eigh", n, n, 2 * n * n + n + 2)
    big = n + n % 2
    half = big // 2
    body = f"""  threadgroup float A[{n * n}];
  threadgroup float V[{n * n}];
  threadgroup float cs[{2 * half}];
  threadgroup uint order[{n}];
  threadgroup float stop;
  device const float* a = in_a + long(tg) * {n * n};
  for (uint l = tid; l < {n * n}; l += {THREADS}) {{ A[l] = a[l]; V[l] = (l / {n} == l % {n}) ? 1.0f : 0.0f; }}
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint sweep = 0; sweep < {MAX_SWEEPS}; ++sweep) {{
    if (tid == 0) {{  // converged when the off-diagonal mass is eps-small against the whole
      float off = 0.0f, all = 0.0f;
      for (uint l = 0; l < {n * n}; ++l) {{ all += A[l] * A[l]; if (l / {n} != l % {n}) off += A[l] * A[l]; }}
      stop = (off <= 1.4e-14f * all || off == 0.0f) ? 1.0f : 0.0f;
    }}
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (stop != 0.0f) break;
    for (uint r = 0; r < {big - 1}; ++r) {{
      for (uint k = tid; k < {half}; k += {THREADS}) {{  // the rotation zeroing A[p][q]
        const uint p = kiln_rr(k, r), q = kiln_rr({big - 1} - k, r);
        float c = 1.0f, s = 0.0f;
        if (p < {n} && q < {n}) {{
          const float apq = A[p * {n} + q];
          if (apq != 0.0f) {{
            const float tau = (A[q * {n} + q] - A[p * {n} + p]) / (2.0f * apq);
            const float t = (tau >= 0.0f ? 1.0f : -1.0f) / (fabs(tau) + sqrt(1.0f + tau * tau));
            c = 1.0f / sqrt(1.0f + t * t); s = t * c;
          }}
        }}
        cs[2 * k] = c; cs[2 * k + 1] = s;
      }}
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint l = tid; l < {half * n}; l += {THREADS}) {{  // rows p, q of A
        const uint k = l / {n}, j = l % {n}, p = kiln_rr(k, r), q = kiln_rr({big - 1} - k, r);
        if (p >= {n} || q >= {n}) continue;
        const float c = cs[2 * k], s = cs[2 * k + 1], x = A[p * {n} + j], y = A[q * {n} + j];
        A[p * {n} + j] = c * x - s * y; A[q * {n} + j] = s * x + c * y;
      }}
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint l = tid; l < {half * n}; l += {THREADS}) {{  // columns p, q of A and V
        const uint k = l / {n}, i = l % {n}, p = kiln_rr(k, r), q = kiln_rr({big - 1} - k, r);
        if (p >= {n} || q >= {n}) continue;
        const float c = cs[2 * k], s = cs[2 * k + 1];
        float x = A[i * {n} + p], y = A[i * {n} + q];
        A[i * {n} + p] = c * x - s * y; A[i * {n} + q] = s * x + c * y;
        x = V[i * {n} + p]; y = V[i * {n} + q];
        V[i * {n} + p] = c * x - s * y; V[i * {n} + q] = s * x + c * y;
      }}
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }}
  }}
  if (tid == 0) {{  // ascending order of the eigenvalues (a stable selection of indices)
    for (uint i = 0; i < {n}; ++i) order[i] = i;
    for (uint i = 0; i < {n}; ++i) {{
      uint best = i;
      for (uint j = i + 1; j < {n}; ++j) if (A[order[j] * {n + 1}] < A[order[best] * {n + 1}]) best = j;
      const uint t = order[i]; order[i] = order[best]; order[best] = t;
    }}
  }}
  threadgroup_barrier(mem_flags::mem_threadgroup);
{_sign_fix(n, n, "V")}  device float* w = out_w + long(tg) * {n};
  device float* vecs = out_v + long(tg) * {n * n};
  for (uint i = tid; i < {n}; i += {THREADS}) w[i] = A[order[i] * {n + 1}];
  for (uint l = tid; l < {n * n}; l += {THREADS}) vecs[l] = V[(l / {n}) * {n} + order[l % {n}]];
"""
    params = ["device const float* in_a [[buffer(0)]]", "device float* out_w [[buffer(1)]]",
              "device float* out_v [[buffer(2)]]"]
    src = _kernel(f"kiln_eigh_{n}", params, body,
                  f"batched two-sided Jacobi eigh of {n} x {n}: one threadgroup of {THREADS} per matrix",
                  ("a", "w", "v"))
    return _with_helpers(src, _pairs(n))


def svd(m: int, n: int) -> EmittedKernel:
    """U (m x n), S (n,) descending, V (n x n) per m x n input (m >= n), one-sided Jacobi."""
    _check("svd", m, n, m * n + n * n + n + 2 * n + 2)
    big = n + n % 2
    half = big // 2
    flip_u = _sign_fix(n, n, "V", f"      for (uint r = 0; r < {m}; ++r) U[r * {n} + c] = -U[r * {n} + c];\n")
    body = f"""  threadgroup float U[{m * n}];
  threadgroup float V[{n * n}];
  threadgroup float S[{n}];
  threadgroup uint order[{n}];
  threadgroup float cs[{2 * half}];
  threadgroup int rotated;
  device const float* a = in_a + long(tg) * {m * n};
  for (uint l = tid; l < {m * n}; l += {THREADS}) U[l] = a[l];
  for (uint l = tid; l < {n * n}; l += {THREADS}) V[l] = (l / {n} == l % {n}) ? 1.0f : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint sweep = 0; sweep < {MAX_SWEEPS}; ++sweep) {{
    if (tid == 0) rotated = 0;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint r = 0; r < {big - 1}; ++r) {{
      for (uint k = tid; k < {half}; k += {THREADS}) {{  // the rotation making columns p, q orthogonal
        const uint p = kiln_rr(k, r), q = kiln_rr({big - 1} - k, r);
        float c = 1.0f, s = 0.0f;
        if (p < {n} && q < {n}) {{
          float al = 0.0f, be = 0.0f, ga = 0.0f;
          for (uint i = 0; i < {m}; ++i) {{
            const float x = U[i * {n} + p], y = U[i * {n} + q];
            al += x * x; be += y * y; ga += x * y;
          }}
          if (fabs(ga) > 1.2e-7f * sqrt(al * be) && ga != 0.0f) {{
            const float zeta = (be - al) / (2.0f * ga);
            const float t = (zeta >= 0.0f ? 1.0f : -1.0f) / (fabs(zeta) + sqrt(1.0f + zeta * zeta));
            c = 1.0f / sqrt(1.0f + t * t); s = t * c;
            rotated = 1;
          }}
        }}
        cs[2 * k] = c; cs[2 * k + 1] = s;
      }}
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint l = tid; l < {half * (m + n)}; l += {THREADS}) {{  // columns p, q of U and V
        const uint k = l / {m + n}, i = l % {m + n}, p = kiln_rr(k, r), q = kiln_rr({big - 1} - k, r);
        if (p >= {n} || q >= {n}) continue;
        const float c = cs[2 * k], s = cs[2 * k + 1];
        threadgroup float* M = i < {m} ? U : V;
        const uint row = i < {m} ? i : i - {m};
        const float x = M[row * {n} + p], y = M[row * {n} + q];
        M[row * {n} + p] = c * x - s * y; M[row * {n} + q] = s * x + c * y;
      }}
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }}
    if (rotated == 0) break;  // uniform: read after the barrier that ends the sweep
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }}
  for (uint c = tid; c < {n}; c += {THREADS}) {{  // singular values: column norms; U's columns normalized
    float s = 0.0f;
    for (uint i = 0; i < {m}; ++i) s += U[i * {n} + c] * U[i * {n} + c];
    S[c] = sqrt(s);
    if (S[c] > 0.0f) for (uint i = 0; i < {m}; ++i) U[i * {n} + c] /= S[c];
  }}
  threadgroup_barrier(mem_flags::mem_threadgroup);
{flip_u}  if (tid == 0) {{  // descending singular values
    for (uint i = 0; i < {n}; ++i) order[i] = i;
    for (uint i = 0; i < {n}; ++i) {{
      uint best = i;
      for (uint j = i + 1; j < {n}; ++j) if (S[order[j]] > S[order[best]]) best = j;
      const uint t = order[i]; order[i] = order[best]; order[best] = t;
    }}
  }}
  threadgroup_barrier(mem_flags::mem_threadgroup);
  device float* u = out_u + long(tg) * {m * n};
  device float* sv = out_s + long(tg) * {n};
  device float* v = out_v + long(tg) * {n * n};
  for (uint l = tid; l < {m * n}; l += {THREADS}) u[l] = U[(l / {n}) * {n} + order[l % {n}]];
  for (uint i = tid; i < {n}; i += {THREADS}) sv[i] = S[order[i]];
  for (uint l = tid; l < {n * n}; l += {THREADS}) v[l] = V[(l / {n}) * {n} + order[l % {n}]];
"""
    params = ["device const float* in_a [[buffer(0)]]", "device float* out_u [[buffer(1)]]",
              "device float* out_s [[buffer(2)]]", "device float* out_v [[buffer(3)]]"]
    src = _kernel(f"kiln_svd_{m}x{n}", params, body,
                  f"batched one-sided Jacobi SVD of {m} x {n}: one threadgroup of {THREADS} per matrix",
                  ("a", "u", "s", "v"))
    return _with_helpers(src, _pairs(n))


def _with_helpers(k: EmittedKernel, helpers: str) -> EmittedKernel:
    from dataclasses import replace

    return replace(k, source=k.source.replace("\n// batched", "\n" + helpers + "\n// batched", 1))
