#pragma OPENCL FP_CONTRACT OFF
inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

/* reduction outer: parallel o0 < 256; 32 point(s) x 8 lanes per group, local-memory tree */
__kernel __attribute__((reqd_work_group_size(8, 32, 1)))
void kiln_column_sum_reduction_0(__global const float *b_in0, __global float *b_out0, const long s_N) {
  __local float red_float[256];
  const long xi = get_global_id(1);
  const int lr = get_local_id(0), lx = get_local_id(1);
  const int valid = xi < 256L;
  const long v_o0 = xi;
  float acc_acc0 = ((float)0.0f);
  for (long rf = lr; valid && rf < s_N; rf += 8) {
    const long v_r0 = rf;
    const float t0 = b_in0[(v_o0 + (256L * v_r0))];
    acc_acc0 = ((float)(acc_acc0 + t0));
  }
  red_float[lx * 8 + lr] = acc_acc0;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int s = 4; s > 0; s >>= 1) {
    if (lr < s) red_float[lx * 8 + lr] = ((float)(red_float[lx * 8 + lr] + red_float[lx * 8 + lr + s]));
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const float r_acc0 = red_float[lx * 8];
  barrier(CLK_LOCAL_MEM_FENCE);  /* the scratch is reused */
  if (valid && lr == 0) {
    const float t1 = ((float)r_acc0);
    b_out0[v_o0] = t1;
  }
}
