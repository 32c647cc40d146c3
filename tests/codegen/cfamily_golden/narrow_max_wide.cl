// ---- kernel main_reduction_0 ----
#pragma OPENCL FP_CONTRACT OFF
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

/* reduction inner: parallel o0 < 64; 64 point(s) x 4 lanes per group, local-memory tree */
__kernel __attribute__((reqd_work_group_size(4, 64, 1)))
void kiln_main_reduction_0(__global const double *b_in0, __global double *b_out0) {
  __local double red_double[256];
  const long xi = get_global_id(1);
  const int lr = get_local_id(0), lx = get_local_id(1);
  const int valid = xi < 64L;
  const long v_o0 = xi;
  double acc_acc0 = ((double)(-INFINITY));
  for (long rf = lr; valid && rf < 16L; rf += 4) {
    const long v_r0 = rf;
    const double t0 = b_in0[(v_r0 + (16L * v_o0))];
    acc_acc0 = ((double)(((t0) > (acc_acc0) || (t0) != (t0)) ? (t0) : (acc_acc0)));
  }
  red_double[lx * 4 + lr] = acc_acc0;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int s = 2; s > 0; s >>= 1) {
    if (lr < s) red_double[lx * 4 + lr] = ((double)(((red_double[lx * 4 + lr + s]) > (red_double[lx * 4 + lr]) || (red_double[lx * 4 + lr + s]) != (red_double[lx * 4 + lr + s])) ? (red_double[lx * 4 + lr + s]) : (red_double[lx * 4 + lr])));
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const double r_acc0 = red_double[lx * 4];
  barrier(CLK_LOCAL_MEM_FENCE);  /* the scratch is reused */
  if (valid && lr == 0) {
    const double t1 = ((double)r_acc0);
    b_out0[v_o0] = t1;
  }
}

