#include <metal_stdlib>
using namespace metal;

inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

// inner reduction: parallel o0 < B; 256 threads per threadgroup, vec4 loads
kernel void kiln_softmax_reduction_0(
    device const float* b_in0 [[buffer(0)]],
    device float* b_out0 [[buffer(1)]],
    constant long& s_B [[buffer(2)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float red_float[8];
  const uint lr = tid % 256, lx = tid / 256;
  const long xi = long(tg) * 1 + lx;
  const bool valid = xi < s_B;
  const long v_o0 = xi;
  float acc_acc0 = float(-INFINITY);
  for (long rf = long(lr) * 4; valid && rf < 1000L; rf += 1024) {
    const long v_r0 = rf;
    const float4 q0 = *((device const float4*)(b_in0 + (v_r0 + (1000L * v_o0))));
    {
      const long v_r0_0 = rf + 0;
      const float t0 = q0.x;
      acc_acc0 = float(((t0) > (acc_acc0) || (t0) != (t0)) ? (t0) : (acc_acc0));
    }
    {
      const long v_r0_1 = rf + 1;
      const float t1 = q0.y;
      acc_acc0 = float(((t1) > (acc_acc0) || (t1) != (t1)) ? (t1) : (acc_acc0));
    }
    {
      const long v_r0_2 = rf + 2;
      const float t2 = q0.z;
      acc_acc0 = float(((t2) > (acc_acc0) || (t2) != (t2)) ? (t2) : (acc_acc0));
    }
    {
      const long v_r0_3 = rf + 3;
      const float t3 = q0.w;
      acc_acc0 = float(((t3) > (acc_acc0) || (t3) != (t3)) ? (t3) : (acc_acc0));
    }
  }
  float p_acc0 = acc_acc0;
  for (ushort o = 16; o > 0; o >>= 1) {
    const float other = simd_shuffle_xor(p_acc0, o);  // every lane shuffles once
    p_acc0 = float(((other) > (p_acc0) || (other) != (other)) ? (other) : (p_acc0));
  }
  if (lane == 0) red_float[sg] = p_acc0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float r_acc0 = red_float[0];
  for (uint j = 1; j < 8; ++j) r_acc0 = float(((red_float[j]) > (r_acc0) || (red_float[j]) != (red_float[j])) ? (red_float[j]) : (r_acc0));
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the scratch is reused
  float acc_acc1 = float(0x0.0p+0f);
  for (long rf = long(lr) * 4; valid && rf < 1000L; rf += 1024) {
    const long v_r0 = rf;
    const float4 q0 = *((device const float4*)(b_in0 + (v_r0 + (1000L * v_o0))));
    {
      const long v_r0_0 = rf + 0;
      const float t4 = q0.x;
      const float t5 = float(r_acc0);
      const float t6 = (t4 - t5);
      const float t7 = float(exp(t6));
      acc_acc1 = float(acc_acc1 + t7);
    }
    {
      const long v_r0_1 = rf + 1;
      const float t8 = q0.y;
      const float t9 = float(r_acc0);
      const float t10 = (t8 - t9);
      const float t11 = float(exp(t10));
      acc_acc1 = float(acc_acc1 + t11);
    }
    {
      const long v_r0_2 = rf + 2;
      const float t12 = q0.z;
      const float t13 = float(r_acc0);
      const float t14 = (t12 - t13);
      const float t15 = float(exp(t14));
      acc_acc1 = float(acc_acc1 + t15);
    }
    {
      const long v_r0_3 = rf + 3;
      const float t16 = q0.w;
      const float t17 = float(r_acc0);
      const float t18 = (t16 - t17);
      const float t19 = float(exp(t18));
      acc_acc1 = float(acc_acc1 + t19);
    }
  }
  const float p_acc1 = float(simd_sum(acc_acc1));
  if (lane == 0) red_float[sg] = p_acc1;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float r_acc1 = red_float[0];
  for (uint j = 1; j < 8; ++j) r_acc1 = float(r_acc1 + red_float[j]);
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the scratch is reused
  for (long rf = lr; valid && rf < 1000L; rf += 256) {
    const long v_r0 = rf;
    const float t20 = b_in0[(v_r0 + (1000L * v_o0))];
    const float t21 = float(r_acc0);
    const float t22 = (t20 - t21);
    const float t23 = float(exp(t22));
    const float t24 = float(r_acc1);
    const float t25 = (t23 / t24);
    b_out0[(v_r0 + (1000L * v_o0))] = t25;
  }
}
