#pragma OPENCL FP_CONTRACT OFF
inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

/* pointwise over i0 < 1024*B: one work-item per point, 256 per group */
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void kiln_gelu_loop_0(__global const float *b_in0, __global float *b_out0, const long s_B) {
  const long xi = get_global_id(0);
  const long v_i0 = xi;
  const float t0 = b_in0[v_i0];
  const float t1 = (t0 * ((float)0.5f));
  const float t2 = (t0 * t0);
  const float t3 = (t2 * t0);
  const float t4 = (t3 * ((float)0.044714998453855515f));
  const float t5 = (t0 + t4);
  const float t6 = (t5 * ((float)0.7978845834732056f));
  const float t7 = tanh(t6);
  const float t8 = (t7 + ((float)1.0f));
  const float t9 = (t1 * t8);
  b_out0[v_i0] = t9;
}

/* the same, bounds-checked: the last, partial group */
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void kiln_gelu_loop_0_tail(__global const float *b_in0, __global float *b_out0, const long s_B) {
  const long xi = get_global_id(0);
  if (xi >= (1024L * s_B)) return;
  const long v_i0 = xi;
  const float t0 = b_in0[v_i0];
  const float t1 = (t0 * ((float)0.5f));
  const float t2 = (t0 * t0);
  const float t3 = (t2 * t0);
  const float t4 = (t3 * ((float)0.044714998453855515f));
  const float t5 = (t0 + t4);
  const float t6 = (t5 * ((float)0.7978845834732056f));
  const float t7 = tanh(t6);
  const float t8 = (t7 + ((float)1.0f));
  const float t9 = (t1 * t8);
  b_out0[v_i0] = t9;
}
