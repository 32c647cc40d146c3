// ---- kernel main_loop_0 ----
#pragma OPENCL FP_CONTRACT OFF
inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

/* pointwise over i0 < 81: one work-item per point, 256 per group */
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void kiln_main_loop_0(__global const uchar *b_in0, __global const uchar *b_in1, __global uchar *b_out0) {
  const long xi = get_global_id(0);
  const long v_i0 = xi;
  const uchar t0 = b_in0[v_i0];
  const uchar t1 = b_in1[v_i0];
  const uchar t2 = (t0 & t1);
  const uchar t3 = (t0 ^ t1);
  const uchar t4 = (t2 | t3);
  b_out0[v_i0] = t4;
}

/* the same, bounds-checked: the last, partial group */
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void kiln_main_loop_0_tail(__global const uchar *b_in0, __global const uchar *b_in1, __global uchar *b_out0) {
  const long xi = get_global_id(0);
  if (xi >= 81L) return;
  const long v_i0 = xi;
  const uchar t0 = b_in0[v_i0];
  const uchar t1 = b_in1[v_i0];
  const uchar t2 = (t0 & t1);
  const uchar t3 = (t0 ^ t1);
  const uchar t4 = (t2 | t3);
  b_out0[v_i0] = t4;
}

