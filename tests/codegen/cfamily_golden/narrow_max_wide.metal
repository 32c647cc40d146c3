// ---- kernel main_reduction_0 ----
#include <metal_stdlib>
using namespace metal;

inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

// narrow reduction: parallel o0 < 64; 256 threads per threadgroup
kernel void kiln_main_reduction_0(
    device const half* b_in0 [[buffer(0)]],
    device half* b_out0 [[buffer(1)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  const uint lr = tid % 16, lx = tid / 16;
  const long xi = long(tg) * 16 + lx;
  const bool valid = xi < 64L;
  const long v_o0 = xi;
  half acc_acc0 = half(-INFINITY);
  for (long rf = lr; valid && rf < 16L; rf += 16) {
    const long v_r0 = rf;
    const half t0 = b_in0[(v_r0 + (16L * v_o0))];
    acc_acc0 = half(((t0) > (acc_acc0) || (t0) != (t0)) ? (t0) : (acc_acc0));
  }
  half r_acc0 = acc_acc0;
  for (ushort o = 8; o > 0; o >>= 1) {
    const half other = simd_shuffle_xor(r_acc0, o);  // every lane shuffles once
    r_acc0 = half(((other) > (r_acc0) || (other) != (other)) ? (other) : (r_acc0));
  }
  if (valid && lr == 0) {
    const float t1 = float(r_acc0);
    const half t2 = half(t1);
    b_out0[v_o0] = t2;
  }
}

