// ---- kernel main_reduction_0 ----
#include <metal_stdlib>
using namespace metal;

inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

// outer reduction: parallel o0 < 8, o1 < 3; 256 threads per threadgroup
kernel void kiln_main_reduction_0(
    device const float* b_in0 [[buffer(0)]],
    device float* b_out0 [[buffer(1)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float red_float[256];
  const uint lx = tid % 32, lr = tid / 32;
  const long xi = long(tg) * 32 + lx;
  const bool valid = xi < 24L;
  const long v_o0 = (xi / 3L);
  const long v_o1 = (xi % 3L);
  float acc_acc0 = float(0x0.0p+0f);
  for (long rf = lr; valid && rf < 100L; rf += 8) {
    const long v_r0 = rf;
    const float t0 = b_in0[(v_o1 + (3L * v_r0) + (300L * v_o0))];
    acc_acc0 = float(acc_acc0 + t0);
  }
  red_float[lr * 32 + lx] = acc_acc0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float r_acc0 = red_float[lx];
  for (uint j = 1; j < 8; ++j) r_acc0 = float(r_acc0 + red_float[j * 32 + lx]);
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the scratch is reused
  if (valid && lr == 0) {
    const float t1 = float(r_acc0);
    b_out0[(v_o1 + (3L * v_o0))] = t1;
  }
}

