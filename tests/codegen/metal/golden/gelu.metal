#include <metal_stdlib>
using namespace metal;

inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

// pointwise over i0 < 1024*B: one thread per point, 256 per threadgroup
kernel void kiln_gelu_loop_0(
    device const float* b_in0 [[buffer(0)]],
    device float* b_out0 [[buffer(1)]],
    constant long& s_B [[buffer(2)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  const long xi = long(tg) * 256 + tid;
  if (xi >= (1024L * s_B)) return;
  const long v_i0 = xi;
  const float t0 = b_in0[v_i0];
  const float t1 = (t0 * float(0x1.0000000000000p-1f));
  const float t2 = (t0 * t0);
  const float t3 = (t2 * t0);
  const float t4 = (t3 * float(0x1.6e4e260000000p-5f));
  const float t5 = (t0 + t4);
  const float t6 = (t5 * float(0x1.9884540000000p-1f));
  const float t7 = float(tanh(t6));
  const float t8 = (t7 + float(0x1.0000000000000p+0f));
  const float t9 = (t1 * t8);
  b_out0[v_i0] = t9;
}
