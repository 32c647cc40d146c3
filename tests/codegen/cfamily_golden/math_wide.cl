// ---- kernel main_loop_0 ----
#pragma OPENCL FP_CONTRACT OFF
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

/* pointwise over i0 < 153: one work-item per point, 256 per group */
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void kiln_main_loop_0(__global const double *b_in0, __global double *b_out0) {
  const long xi = get_global_id(0);
  const long v_i0 = xi;
  const double t0 = b_in0[v_i0];
  const double t1 = floor(t0);
  const double t2 = sin(t0);
  const double t3 = (t1 + t2);
  const double t4 = fabs(t0);
  const double t5 = (t4 + ((double)1.0));
  const double t6 = log(t5);
  const double t7 = (t3 + t6);
  const double t8 = rint(t0);
  const double t9 = (t7 + t8);
  const double t10 = (t0 + ((double)1.0));
  const double t11 = atan2(t0, t10);
  const double t12 = (t9 + t11);
  const uchar t13 = (t0 != t0);
  const double t14 = (t0 * ((double)2.0));
  const uchar t15 = (t14 != t14);
  const uchar t16 = (t0 == ((double)0.0));
  const uchar t17 = (t14 == ((double)0.0));
  const uchar t18 = (t16 & t17);
  const double t19 = (t0 + t14);
  const uchar t20 = (t0 > t14);
  const double t21 = (t20 ? t0 : t14);
  const double t22 = (t18 ? t19 : t21);
  const double t23 = (t15 ? t14 : t22);
  const double t24 = (t13 ? t0 : t23);
  const double t25 = (t12 + t24);
  const double t26 = erf(t0);
  const double t27 = (t25 + t26);
  b_out0[v_i0] = t27;
}

/* the same, bounds-checked: the last, partial group */
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void kiln_main_loop_0_tail(__global const double *b_in0, __global double *b_out0) {
  const long xi = get_global_id(0);
  if (xi >= 153L) return;
  const long v_i0 = xi;
  const double t0 = b_in0[v_i0];
  const double t1 = floor(t0);
  const double t2 = sin(t0);
  const double t3 = (t1 + t2);
  const double t4 = fabs(t0);
  const double t5 = (t4 + ((double)1.0));
  const double t6 = log(t5);
  const double t7 = (t3 + t6);
  const double t8 = rint(t0);
  const double t9 = (t7 + t8);
  const double t10 = (t0 + ((double)1.0));
  const double t11 = atan2(t0, t10);
  const double t12 = (t9 + t11);
  const uchar t13 = (t0 != t0);
  const double t14 = (t0 * ((double)2.0));
  const uchar t15 = (t14 != t14);
  const uchar t16 = (t0 == ((double)0.0));
  const uchar t17 = (t14 == ((double)0.0));
  const uchar t18 = (t16 & t17);
  const double t19 = (t0 + t14);
  const uchar t20 = (t0 > t14);
  const double t21 = (t20 ? t0 : t14);
  const double t22 = (t18 ? t19 : t21);
  const double t23 = (t15 ? t14 : t22);
  const double t24 = (t13 ? t0 : t23);
  const double t25 = (t12 + t24);
  const double t26 = erf(t0);
  const double t27 = (t25 + t26);
  b_out0[v_i0] = t27;
}

