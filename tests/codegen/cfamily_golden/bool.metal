// ---- kernel main_loop_0 ----
#include <metal_stdlib>
using namespace metal;

inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

// pointwise over i0 < 81: one thread per point, 256 per threadgroup
kernel void kiln_main_loop_0(
    device const bool* b_in0 [[buffer(0)]],
    device const bool* b_in1 [[buffer(1)]],
    device bool* b_out0 [[buffer(2)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  const long xi = long(tg) * 256 + tid;
  if (xi >= 81L) return;
  const long v_i0 = xi;
  const bool t0 = b_in0[v_i0];
  const bool t1 = b_in1[v_i0];
  const bool t2 = bool(t0 & t1);
  const bool t3 = bool(t0 ^ t1);
  const bool t4 = bool(t2 | t3);
  b_out0[v_i0] = t4;
}

