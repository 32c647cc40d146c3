// ---- kernel main_loop_0 ----
#include <metal_stdlib>
using namespace metal;

inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

// pointwise over i0 < 165: one thread per point, 256 per threadgroup
kernel void kiln_main_loop_0(
    device const int* b_in0 [[buffer(0)]],
    device const int* b_in1 [[buffer(1)]],
    device int* b_out0 [[buffer(2)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  const long xi = long(tg) * 256 + tid;
  if (xi >= 165L) return;
  const long v_i0 = xi;
  const int t0 = b_in0[v_i0];
  const int t1 = b_in1[v_i0];
  const int t2 = int(uint(t0) * uint(t1));
  const int t3 = int(uint(t2) + uint(t0));
  const int t4 = int(uint(t3) - uint(t1));
  const int t5 = int(uint(0) - uint(t0));
  const int t6 = int(uint(t4) - uint(t5));
  const int t7 = int(uint(t1) + uint(int(100)));
  const bool t8 = (t7 == int(0));
  const bool t9 = (t0 == int(-2147483648));
  const bool t10 = (t7 == int(-1));
  const bool t11 = bool(t9 & t10);
  const bool t12 = bool(t8 | t11);
  const int t13 = (t12 ? int(1) : t7);
  const int t14 = int(t0 % t13);
  const int t15 = (t12 ? int(0) : t14);
  const bool t16 = (t15 != int(0));
  const bool t17 = (t7 < int(0));
  const bool t18 = (t15 < int(0));
  const bool t19 = (t17 != t18);
  const bool t20 = bool(t16 & t19);
  const int t21 = int(t0 / t13);
  const int t22 = (t8 ? int(0) : t21);
  const int t23 = int(uint(t22) - uint(int(1)));
  const int t24 = (t20 ? t23 : t22);
  const int t25 = int(uint(t6) + uint(t24));
  const int t26 = int(uint(t15) + uint(t7));
  const int t27 = (t20 ? t26 : t15);
  const int t28 = int(uint(t25) + uint(t27));
  b_out0[v_i0] = t28;
}

