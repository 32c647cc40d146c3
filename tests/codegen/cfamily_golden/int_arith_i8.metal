// ---- kernel main_loop_0 ----
#include <metal_stdlib>
using namespace metal;

inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

// pointwise over i0 < 45: one thread per point, 256 per threadgroup
kernel void kiln_main_loop_0(
    device const char* b_in0 [[buffer(0)]],
    device const char* b_in1 [[buffer(1)]],
    device char* b_out0 [[buffer(2)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  const long xi = long(tg) * 256 + tid;
  if (xi >= 45L) return;
  const long v_i0 = xi;
  const char t0 = b_in0[v_i0];
  const char t1 = b_in1[v_i0];
  const char t2 = char(uchar(t0) * uchar(t1));
  const char t3 = char(uchar(0) - uchar(t0));
  const char t4 = char(uchar(t2) - uchar(t3));
  const char t5 = char(t0 & t1);
  const char t6 = char(uchar(t4) + uchar(t5));
  const char t7 = char(t0 ^ t1);
  const char t8 = char(t6 | t7);
  b_out0[v_i0] = t8;
}

