// ---- kernel main_loop_0 ----
#pragma OPENCL FP_CONTRACT OFF
inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

/* pointwise over i0 < 45: one work-item per point, 256 per group */
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void kiln_main_loop_0(__global const char *b_in0, __global const char *b_in1, __global char *b_out0) {
  const long xi = get_global_id(0);
  const long v_i0 = xi;
  const char t0 = b_in0[v_i0];
  const char t1 = b_in1[v_i0];
  const char t2 = ((char)(t0 * t1));
  const char t3 = ((char)(-t0));
  const char t4 = ((char)(t2 - t3));
  const char t5 = (t0 & t1);
  const char t6 = ((char)(t4 + t5));
  const char t7 = (t0 ^ t1);
  const char t8 = (t6 | t7);
  b_out0[v_i0] = t8;
}

/* the same, bounds-checked: the last, partial group */
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void kiln_main_loop_0_tail(__global const char *b_in0, __global const char *b_in1, __global char *b_out0) {
  const long xi = get_global_id(0);
  if (xi >= 45L) return;
  const long v_i0 = xi;
  const char t0 = b_in0[v_i0];
  const char t1 = b_in1[v_i0];
  const char t2 = ((char)(t0 * t1));
  const char t3 = ((char)(-t0));
  const char t4 = ((char)(t2 - t3));
  const char t5 = (t0 & t1);
  const char t6 = ((char)(t4 + t5));
  const char t7 = (t0 ^ t1);
  const char t8 = (t6 | t7);
  b_out0[v_i0] = t8;
}

