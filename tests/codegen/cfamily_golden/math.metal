// ---- kernel main_loop_0 ----
#include <metal_stdlib>
using namespace metal;

inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

// pointwise over i0 < 153: one thread per point, 256 per threadgroup
kernel void kiln_main_loop_0(
    device const float* b_in0 [[buffer(0)]],
    device float* b_out0 [[buffer(1)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  const long xi = long(tg) * 256 + tid;
  if (xi >= 153L) return;
  const long v_i0 = xi;
  const float t0 = b_in0[v_i0];
  const float t1 = float(floor(t0));
  const float t2 = float(sin(t0));
  const float t3 = (t1 + t2);
  const float t4 = float(fabs(t0));
  const float t5 = (t4 + float(0x1.0000000000000p+0f));
  const float t6 = float(log(t5));
  const float t7 = (t3 + t6);
  const float t8 = float(rint(t0));
  const float t9 = (t7 + t8);
  const float t10 = (t0 + float(0x1.0000000000000p+0f));
  const float t11 = float(atan2(t0, t10));
  const float t12 = (t9 + t11);
  const bool t13 = (t0 != t0);
  const float t14 = (t0 * float(0x1.0000000000000p+1f));
  const bool t15 = (t14 != t14);
  const bool t16 = (t0 == float(0x0.0p+0f));
  const bool t17 = (t14 == float(0x0.0p+0f));
  const bool t18 = bool(t16 & t17);
  const float t19 = (t0 + t14);
  const bool t20 = (t0 > t14);
  const float t21 = (t20 ? t0 : t14);
  const float t22 = (t18 ? t19 : t21);
  const float t23 = (t15 ? t14 : t22);
  const float t24 = (t13 ? t0 : t23);
  const float t25 = (t12 + t24);
  const bool t26 = (t4 < float(0x1.0000000000000p-1f));
  const float t27 = (t0 * t0);
  const float t28 = (float(0x1.f9a3260000000p-14f) * t27);
  const float t29 = (t28 + float(-0x1.c02db40000000p-11f));
  const float t30 = (t29 * t27);
  const float t31 = (t30 + float(0x1.565bce0000000p-8f));
  const float t32 = (t31 * t27);
  const float t33 = (t32 + float(-0x1.b82ce40000000p-6f));
  const float t34 = (t33 * t27);
  const float t35 = (t34 + float(0x1.ce2f220000000p-4f));
  const float t36 = (t35 * t27);
  const float t37 = (t36 + float(-0x1.8127460000000p-2f));
  const float t38 = (t37 * t27);
  const float t39 = (t38 + float(0x1.20dd760000000p+0f));
  const float t40 = (t0 * t39);
  const bool t41 = (t0 < float(0x0.0p+0f));
  const float t42 = (t4 * float(0x1.0000000000000p-1f));
  const float t43 = (t42 + float(0x1.0000000000000p+0f));
  const float t44 = (float(0x1.0000000000000p+0f) / t43);
  const float t45 = (t4 * t4);
  const float t46 = (-t45);
  const float t47 = (float(0x1.5df28a0000000p-3f) * t44);
  const float t48 = (t47 + float(-0x1.a4f1240000000p-1f));
  const float t49 = (t48 * t44);
  const float t50 = (t49 + float(0x1.7d0f600000000p+0f));
  const float t51 = (t50 * t44);
  const float t52 = (t51 + float(-0x1.229cba0000000p+0f));
  const float t53 = (t52 * t44);
  const float t54 = (t53 + float(0x1.1d8f980000000p-2f));
  const float t55 = (t54 * t44);
  const float t56 = (t55 + float(-0x1.7d84980000000p-3f));
  const float t57 = (t56 * t44);
  const float t58 = (t57 + float(0x1.8c6d920000000p-4f));
  const float t59 = (t58 * t44);
  const float t60 = (t59 + float(0x1.7f11f60000000p-2f));
  const float t61 = (t60 * t44);
  const float t62 = (t61 + float(0x1.00018e0000000p+0f));
  const float t63 = (t62 * t44);
  const float t64 = (t63 + float(-0x1.43f89c0000000p+0f));
  const float t65 = (t46 + t64);
  const bool t66 = (t65 != t65);
  const bool t67 = (float(-0x1.a000000000000p+6f) != float(-0x1.a000000000000p+6f));
  const bool t68 = (t65 == float(0x0.0p+0f));
  const bool t69 = (float(-0x1.a000000000000p+6f) == float(0x0.0p+0f));
  const bool t70 = bool(t68 & t69);
  const float t71 = (t65 + float(-0x1.a000000000000p+6f));
  const bool t72 = (t65 > float(-0x1.a000000000000p+6f));
  const float t73 = (t72 ? t65 : float(-0x1.a000000000000p+6f));
  const float t74 = (t70 ? t71 : t73);
  const float t75 = (t67 ? float(-0x1.a000000000000p+6f) : t74);
  const float t76 = (t66 ? t65 : t75);
  const bool t77 = (t76 != t76);
  const bool t78 = (float(0x1.6400000000000p+6f) != float(0x1.6400000000000p+6f));
  const bool t79 = (t76 == float(0x0.0p+0f));
  const bool t80 = (float(0x1.6400000000000p+6f) == float(0x0.0p+0f));
  const bool t81 = bool(t79 & t80);
  const float t82 = (-t76);
  const float t83 = (-float(0x1.6400000000000p+6f));
  const float t84 = (t82 + t83);
  const float t85 = (-t84);
  const bool t86 = (t76 < float(0x1.6400000000000p+6f));
  const float t87 = (t86 ? t76 : float(0x1.6400000000000p+6f));
  const float t88 = (t81 ? t85 : t87);
  const float t89 = (t78 ? float(0x1.6400000000000p+6f) : t88);
  const float t90 = (t77 ? t76 : t89);
  const float t91 = (t90 * float(0x1.7154760000000p+0f));
  const float t92 = (t91 + float(0x1.0000000000000p-1f));
  const float t93 = float(floor(t92));
  const float t94 = (t93 * float(0x1.62e4000000000p-1f));
  const float t95 = (t90 - t94);
  const float t96 = (t93 * float(0x1.7f7d1c0000000p-20f));
  const float t97 = (t95 - t96);
  const float t98 = (float(0x1.a01a020000000p-13f) * t97);
  const float t99 = (t98 + float(0x1.6c16c20000000p-10f));
  const float t100 = (t99 * t97);
  const float t101 = (t100 + float(0x1.1111120000000p-7f));
  const float t102 = (t101 * t97);
  const float t103 = (t102 + float(0x1.5555560000000p-5f));
  const float t104 = (t103 * t97);
  const float t105 = (t104 + float(0x1.5555560000000p-3f));
  const float t106 = (t105 * t97);
  const float t107 = (t106 + float(0x1.0000000000000p-1f));
  const float t108 = (t107 * t97);
  const float t109 = (t108 + float(0x1.0000000000000p+0f));
  const float t110 = (t109 * t97);
  const float t111 = (t110 + float(0x1.0000000000000p+0f));
  const float t112 = (t93 * float(0x1.0000000000000p-1f));
  const float t113 = float(floor(t112));
  const int t114 = int(t113);
  const int t115 = int(uint(t114) + uint(int(127)));
  const int t116 = int(uint(t115) * uint(int(8388608)));
  const float t117 = as_type<float>(t116);
  const float t118 = (t111 * t117);
  const float t119 = (t93 - t113);
  const int t120 = int(t119);
  const int t121 = int(uint(t120) + uint(int(127)));
  const int t122 = int(uint(t121) * uint(int(8388608)));
  const float t123 = as_type<float>(t122);
  const float t124 = (t118 * t123);
  const float t125 = (t66 ? t65 : t124);
  const float t126 = (t44 * t125);
  const float t127 = (float(0x1.0000000000000p+0f) - t126);
  const float t128 = (-t127);
  const float t129 = (t41 ? t128 : t127);
  const float t130 = (t13 ? t0 : t129);
  const float t131 = (t26 ? t40 : t130);
  const float t132 = (t25 + t131);
  b_out0[v_i0] = t132;
}

