// ---- kernel main_reduction_0 ----
#pragma OPENCL FP_CONTRACT OFF
inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

/* reduction outer: parallel o0 < 256; 256 point(s) x 1 lanes per group, local-memory tree */
__kernel __attribute__((reqd_work_group_size(1, 256, 1)))
void kiln_main_reduction_0(__global const float *b_in0, __global float *b_out0) {
  __local float red_float[256];
  const long xi = get_global_id(1);
  const int lr = get_local_id(0), lx = get_local_id(1);
  const int valid = xi < 256L;
  const long v_o0 = xi;
  float acc_acc0 = ((float)0.0f);
  for (long rf = lr; valid && rf < 1000L; rf += 1) {
    const long v_r0 = rf;
    const float t0 = b_in0[(v_o0 + (256L * v_r0))];
    acc_acc0 = ((float)(acc_acc0 + t0));
  }
  red_float[lx * 1 + lr] = acc_acc0;
  barrier(CLK_LOCAL_MEM_FENCE);
  const float r_acc0 = red_float[lx * 1];
  barrier(CLK_LOCAL_MEM_FENCE);  /* the scratch is reused */
  if (valid && lr == 0) {
    const float t1 = ((float)r_acc0);
    b_out0[v_o0] = t1;
  }
}

