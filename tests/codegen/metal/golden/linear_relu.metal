#include <metal_stdlib>
using namespace metal;

inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

// gemm [1] x [B, 512] @ [512, 256]: 32 x 32 blocks per threadgroup of 128, 8-deep slices, simdgroup_matrix 8x8 tiles, epilogue fused
kernel void kiln_linear_relu_gemm_0(
    device const half* b_in0 [[buffer(0)]],
    device const half* b_in1 [[buffer(1)]],
    device const half* b_in2 [[buffer(2)]],
    device half* b_out0 [[buffer(3)]],
    constant long& s_B [[buffer(4)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float As[32 * 8];
  threadgroup float Bs[8 * 32];
  threadgroup float Cs[32 * 32];
  const long M = s_B, N = 256L, K = 512L;
  const long tn = ((256L + 31) / 32), tm = ((s_B + 31) / 32);
  const long gb = long(tg) / (tm * tn);
  const long bm0 = ((long(tg) / tn) % tm) * 32, bn0 = (long(tg) % tn) * 32;
  const uint qr = (sg / 2) * 16, qc = (sg % 2) * 16;  // this simdgroup's quadrant
  simdgroup_matrix<float, 8, 8> acc[2][2];
  for (int i = 0; i < 2; ++i) for (int j = 0; j < 2; ++j) acc[i][j] = simdgroup_matrix<float, 8, 8>(0);
  for (long k0 = 0; k0 < K; k0 += 8) {
    for (uint l = tid; l < 256; l += 128) {
      const long gr = bm0 + l / 8, gk = k0 + l % 8;
      As[l] = (gr < M && gk < K) ? float(b_in0[gb * 0L + gr * 512L + gk * 1L]) : float(0);
    }
    for (uint l = tid; l < 256; l += 128) {
      const long gk = k0 + l / 32, gc = bn0 + l % 32;
      Bs[l] = (gc < N && gk < K) ? float(b_in1[gb * 0L + gk * 256L + gc * 1L]) : float(0);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_matrix<float, 8, 8> ta[2], tb[2];
    for (int i = 0; i < 2; ++i) simdgroup_load(ta[i], As + (qr + 8 * i) * 8, 8);
    for (int j = 0; j < 2; ++j) simdgroup_load(tb[j], Bs + qc + 8 * j, 32);
    for (int i = 0; i < 2; ++i) for (int j = 0; j < 2; ++j) simdgroup_multiply_accumulate(acc[i][j], ta[i], tb[j], acc[i][j]);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (int i = 0; i < 2; ++i) for (int j = 0; j < 2; ++j) simdgroup_store(acc[i][j], Cs + (qr + 8 * i) * 32 + qc + 8 * j, 32);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint l = tid; l < 1024; l += 128) {
    const long gi = bm0 + l / 32, gj = bn0 + l % 32;
    if (gi >= M || gj >= N) continue;
    const float accv = Cs[l];
    const half t0 = half(accv);
    const half t1 = b_in2[gj];
    const half t2 = (t0 + t1);
    const bool t3 = (t2 != t2);
    const bool t4 = (half(0x0.0p+0f) != half(0x0.0p+0f));
    const bool t5 = (t2 == half(0x0.0p+0f));
    const bool t6 = (half(0x0.0p+0f) == half(0x0.0p+0f));
    const bool t7 = bool(t5 & t6);
    const half t8 = (t2 + half(0x0.0p+0f));
    const bool t9 = (t2 > half(0x0.0p+0f));
    const half t10 = (t9 ? t2 : half(0x0.0p+0f));
    const half t11 = (t7 ? t8 : t10);
    const half t12 = (t4 ? half(0x0.0p+0f) : t11);
    const half t13 = (t3 ? t2 : t12);
    b_out0[(gb * M + gi) * N + gj] = t13;
  }
}
