#pragma OPENCL FP_CONTRACT OFF
inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

/* reduction inner: parallel o0 < B; 1 point(s) x 256 lanes per group, local-memory tree */
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void kiln_softmax_reduction_0(__global const float *b_in0, __global float *b_out0, const long s_B) {
  __local float red_float[256];
  const long xi = get_global_id(1);
  const int lr = get_local_id(0), lx = get_local_id(1);
  const int valid = xi < s_B;
  const long v_o0 = xi;
  float acc_acc0 = ((float)(-INFINITY));
  for (long rf = lr; valid && rf < 1000L; rf += 256) {
    const long v_r0 = rf;
    const float t0 = b_in0[(v_r0 + (1000L * v_o0))];
    acc_acc0 = ((float)(((t0) > (acc_acc0) || (t0) != (t0)) ? (t0) : (acc_acc0)));
  }
  red_float[lx * 256 + lr] = acc_acc0;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int s = 128; s > 0; s >>= 1) {
    if (lr < s) red_float[lx * 256 + lr] = ((float)(((red_float[lx * 256 + lr + s]) > (red_float[lx * 256 + lr]) || (red_float[lx * 256 + lr + s]) != (red_float[lx * 256 + lr + s])) ? (red_float[lx * 256 + lr + s]) : (red_float[lx * 256 + lr])));
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const float r_acc0 = red_float[lx * 256];
  barrier(CLK_LOCAL_MEM_FENCE);  /* the scratch is reused */
  float acc_acc1 = ((float)0.0f);
  for (long rf = lr; valid && rf < 1000L; rf += 256) {
    const long v_r0 = rf;
    const float t1 = b_in0[(v_r0 + (1000L * v_o0))];
    const float t2 = ((float)r_acc0);
    const float t3 = (t1 - t2);
    const float t4 = exp(t3);
    acc_acc1 = ((float)(acc_acc1 + t4));
  }
  red_float[lx * 256 + lr] = acc_acc1;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int s = 128; s > 0; s >>= 1) {
    if (lr < s) red_float[lx * 256 + lr] = ((float)(red_float[lx * 256 + lr] + red_float[lx * 256 + lr + s]));
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const float r_acc1 = red_float[lx * 256];
  barrier(CLK_LOCAL_MEM_FENCE);  /* the scratch is reused */
  for (long rf = lr; valid && rf < 1000L; rf += 256) {
    const long v_r0 = rf;
    const float t5 = b_in0[(v_r0 + (1000L * v_o0))];
    const float t6 = ((float)r_acc0);
    const float t7 = (t5 - t6);
    const float t8 = exp(t7);
    const float t9 = ((float)r_acc1);
    const float t10 = (t8 / t9);
    b_out0[(v_r0 + (1000L * v_o0))] = t10;
  }
}
