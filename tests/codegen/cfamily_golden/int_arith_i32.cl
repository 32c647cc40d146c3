// ---- kernel main_loop_0 ----
#pragma OPENCL FP_CONTRACT OFF
inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

/* pointwise over i0 < 165: one work-item per point, 256 per group */
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void kiln_main_loop_0(__global const int *b_in0, __global const int *b_in1, __global int *b_out0) {
  const long xi = get_global_id(0);
  const long v_i0 = xi;
  const int t0 = b_in0[v_i0];
  const int t1 = b_in1[v_i0];
  const int t2 = ((int)((uint)t0 * (uint)t1));
  const int t3 = ((int)((uint)t2 + (uint)t0));
  const int t4 = ((int)((uint)t3 - (uint)t1));
  const int t5 = ((int)(0 - (uint)t0));
  const int t6 = ((int)((uint)t4 - (uint)t5));
  const int t7 = ((int)((uint)t1 + (uint)((int)100L)));
  const uchar t8 = (t7 == ((int)0L));
  const uchar t9 = (t0 == ((int)-2147483648L));
  const uchar t10 = (t7 == ((int)-1L));
  const uchar t11 = (t9 & t10);
  const uchar t12 = (t8 | t11);
  const int t13 = (t12 ? ((int)1L) : t7);
  const int t14 = (t0 % t13);
  const int t15 = (t12 ? ((int)0L) : t14);
  const uchar t16 = (t15 != ((int)0L));
  const uchar t17 = (t7 < ((int)0L));
  const uchar t18 = (t15 < ((int)0L));
  const uchar t19 = (t17 != t18);
  const uchar t20 = (t16 & t19);
  const int t21 = (t0 / t13);
  const int t22 = (t8 ? ((int)0L) : t21);
  const int t23 = ((int)((uint)t22 - (uint)((int)1L)));
  const int t24 = (t20 ? t23 : t22);
  const int t25 = ((int)((uint)t6 + (uint)t24));
  const int t26 = ((int)((uint)t15 + (uint)t7));
  const int t27 = (t20 ? t26 : t15);
  const int t28 = ((int)((uint)t25 + (uint)t27));
  b_out0[v_i0] = t28;
}

/* the same, bounds-checked: the last, partial group */
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void kiln_main_loop_0_tail(__global const int *b_in0, __global const int *b_in1, __global int *b_out0) {
  const long xi = get_global_id(0);
  if (xi >= 165L) return;
  const long v_i0 = xi;
  const int t0 = b_in0[v_i0];
  const int t1 = b_in1[v_i0];
  const int t2 = ((int)((uint)t0 * (uint)t1));
  const int t3 = ((int)((uint)t2 + (uint)t0));
  const int t4 = ((int)((uint)t3 - (uint)t1));
  const int t5 = ((int)(0 - (uint)t0));
  const int t6 = ((int)((uint)t4 - (uint)t5));
  const int t7 = ((int)((uint)t1 + (uint)((int)100L)));
  const uchar t8 = (t7 == ((int)0L));
  const uchar t9 = (t0 == ((int)-2147483648L));
  const uchar t10 = (t7 == ((int)-1L));
  const uchar t11 = (t9 & t10);
  const uchar t12 = (t8 | t11);
  const int t13 = (t12 ? ((int)1L) : t7);
  const int t14 = (t0 % t13);
  const int t15 = (t12 ? ((int)0L) : t14);
  const uchar t16 = (t15 != ((int)0L));
  const uchar t17 = (t7 < ((int)0L));
  const uchar t18 = (t15 < ((int)0L));
  const uchar t19 = (t17 != t18);
  const uchar t20 = (t16 & t19);
  const int t21 = (t0 / t13);
  const int t22 = (t8 ? ((int)0L) : t21);
  const int t23 = ((int)((uint)t22 - (uint)((int)1L)));
  const int t24 = (t20 ? t23 : t22);
  const int t25 = ((int)((uint)t6 + (uint)t24));
  const int t26 = ((int)((uint)t15 + (uint)t7));
  const int t27 = (t20 ? t26 : t15);
  const int t28 = ((int)((uint)t25 + (uint)t27));
  b_out0[v_i0] = t28;
}

