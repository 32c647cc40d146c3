// ---- kernel main_loop_0 ----
#include <metal_stdlib>
using namespace metal;

inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

// pointwise over i0 < 153: one thread per point, 256 per threadgroup
kernel void kiln_main_loop_0(
    device const half* b_in0 [[buffer(0)]],
    device half* b_out0 [[buffer(1)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  const long xi = long(tg) * 256 + tid;
  if (xi >= 153L) return;
  const long v_i0 = xi;
  const half t0 = b_in0[v_i0];
  const half t1 = half(floor(t0));
  const half t2 = half(sin(t0));
  const half t3 = (t1 + t2);
  const half t4 = half(fabs(t0));
  const half t5 = (t4 + half(0x1.0000000000000p+0f));
  const half t6 = half(log(t5));
  const half t7 = (t3 + t6);
  const half t8 = half(rint(t0));
  const half t9 = (t7 + t8);
  const half t10 = (t0 + half(0x1.0000000000000p+0f));
  const half t11 = half(atan2(t0, t10));
  const half t12 = (t9 + t11);
  const bool t13 = (t0 != t0);
  const half t14 = (t0 * half(0x1.0000000000000p+1f));
  const bool t15 = (t14 != t14);
  const bool t16 = (t0 == half(0x0.0p+0f));
  const bool t17 = (t14 == half(0x0.0p+0f));
  const bool t18 = bool(t16 & t17);
  const half t19 = (t0 + t14);
  const bool t20 = (t0 > t14);
  const half t21 = (t20 ? t0 : t14);
  const half t22 = (t18 ? t19 : t21);
  const half t23 = (t15 ? t14 : t22);
  const half t24 = (t13 ? t0 : t23);
  const half t25 = (t12 + t24);
  const float t26 = float(t0);
  const float t27 = float(fabs(t26));
  const bool t28 = (t27 < float(0x1.0000000000000p-1f));
  const float t29 = (t26 * t26);
  const float t30 = (float(0x1.f9a3260000000p-14f) * t29);
  const float t31 = (t30 + float(-0x1.c02db40000000p-11f));
  const float t32 = (t31 * t29);
  const float t33 = (t32 + float(0x1.565bce0000000p-8f));
  const float t34 = (t33 * t29);
  const float t35 = (t34 + float(-0x1.b82ce40000000p-6f));
  const float t36 = (t35 * t29);
  const float t37 = (t36 + float(0x1.ce2f220000000p-4f));
  const float t38 = (t37 * t29);
  const float t39 = (t38 + float(-0x1.8127460000000p-2f));
  const float t40 = (t39 * t29);
  const float t41 = (t40 + float(0x1.20dd760000000p+0f));
  const float t42 = (t26 * t41);
  const bool t43 = (t26 != t26);
  const bool t44 = (t26 < float(0x0.0p+0f));
  const float t45 = (t27 * float(0x1.0000000000000p-1f));
  const float t46 = (t45 + float(0x1.0000000000000p+0f));
  const float t47 = (float(0x1.0000000000000p+0f) / t46);
  const float t48 = (t27 * t27);
  const float t49 = (-t48);
  const float t50 = (float(0x1.5df28a0000000p-3f) * t47);
  const float t51 = (t50 + float(-0x1.a4f1240000000p-1f));
  const float t52 = (t51 * t47);
  const float t53 = (t52 + float(0x1.7d0f600000000p+0f));
  const float t54 = (t53 * t47);
  const float t55 = (t54 + float(-0x1.229cba0000000p+0f));
  const float t56 = (t55 * t47);
  const float t57 = (t56 + float(0x1.1d8f980000000p-2f));
  const float t58 = (t57 * t47);
  const float t59 = (t58 + float(-0x1.7d84980000000p-3f));
  const float t60 = (t59 * t47);
  const float t61 = (t60 + float(0x1.8c6d920000000p-4f));
  const float t62 = (t61 * t47);
  const float t63 = (t62 + float(0x1.7f11f60000000p-2f));
  const float t64 = (t63 * t47);
  const float t65 = (t64 + float(0x1.00018e0000000p+0f));
  const float t66 = (t65 * t47);
  const float t67 = (t66 + float(-0x1.43f89c0000000p+0f));
  const float t68 = (t49 + t67);
  const bool t69 = (t68 != t68);
  const bool t70 = (float(-0x1.a000000000000p+6f) != float(-0x1.a000000000000p+6f));
  const bool t71 = (t68 == float(0x0.0p+0f));
  const bool t72 = (float(-0x1.a000000000000p+6f) == float(0x0.0p+0f));
  const bool t73 = bool(t71 & t72);
  const float t74 = (t68 + float(-0x1.a000000000000p+6f));
  const bool t75 = (t68 > float(-0x1.a000000000000p+6f));
  const float t76 = (t75 ? t68 : float(-0x1.a000000000000p+6f));
  const float t77 = (t73 ? t74 : t76);
  const float t78 = (t70 ? float(-0x1.a000000000000p+6f) : t77);
  const float t79 = (t69 ? t68 : t78);
  const bool t80 = (t79 != t79);
  const bool t81 = (float(0x1.6400000000000p+6f) != float(0x1.6400000000000p+6f));
  const bool t82 = (t79 == float(0x0.0p+0f));
  const bool t83 = (float(0x1.6400000000000p+6f) == float(0x0.0p+0f));
  const bool t84 = bool(t82 & t83);
  const float t85 = (-t79);
  const float t86 = (-float(0x1.6400000000000p+6f));
  const float t87 = (t85 + t86);
  const float t88 = (-t87);
  const bool t89 = (t79 < float(0x1.6400000000000p+6f));
  const float t90 = (t89 ? t79 : float(0x1.6400000000000p+6f));
  const float t91 = (t84 ? t88 : t90);
  const float t92 = (t81 ? float(0x1.6400000000000p+6f) : t91);
  const float t93 = (t80 ? t79 : t92);
  const float t94 = (t93 * float(0x1.7154760000000p+0f));
  const float t95 = (t94 + float(0x1.0000000000000p-1f));
  const float t96 = float(floor(t95));
  const float t97 = (t96 * float(0x1.62e4000000000p-1f));
  const float t98 = (t93 - t97);
  const float t99 = (t96 * float(0x1.7f7d1c0000000p-20f));
  const float t100 = (t98 - t99);
  const float t101 = (float(0x1.a01a020000000p-13f) * t100);
  const float t102 = (t101 + float(0x1.6c16c20000000p-10f));
  const float t103 = (t102 * t100);
  const float t104 = (t103 + float(0x1.1111120000000p-7f));
  const float t105 = (t104 * t100);
  const float t106 = (t105 + float(0x1.5555560000000p-5f));
  const float t107 = (t106 * t100);
  const float t108 = (t107 + float(0x1.5555560000000p-3f));
  const float t109 = (t108 * t100);
  const float t110 = (t109 + float(0x1.0000000000000p-1f));
  const float t111 = (t110 * t100);
  const float t112 = (t111 + float(0x1.0000000000000p+0f));
  const float t113 = (t112 * t100);
  const float t114 = (t113 + float(0x1.0000000000000p+0f));
  const float t115 = (t96 * float(0x1.0000000000000p-1f));
  const float t116 = float(floor(t115));
  const int t117 = int(t116);
  const int t118 = int(uint(t117) + uint(int(127)));
  const int t119 = int(uint(t118) * uint(int(8388608)));
  const float t120 = as_type<float>(t119);
  const float t121 = (t114 * t120);
  const float t122 = (t96 - t116);
  const int t123 = int(t122);
  const int t124 = int(uint(t123) + uint(int(127)));
  const int t125 = int(uint(t124) * uint(int(8388608)));
  const float t126 = as_type<float>(t125);
  const float t127 = (t121 * t126);
  const float t128 = (t69 ? t68 : t127);
  const float t129 = (t47 * t128);
  const float t130 = (float(0x1.0000000000000p+0f) - t129);
  const float t131 = (-t130);
  const float t132 = (t44 ? t131 : t130);
  const float t133 = (t43 ? t26 : t132);
  const float t134 = (t28 ? t42 : t133);
  const half t135 = half(t134);
  const half t136 = (t25 + t135);
  b_out0[v_i0] = t136;
}

