// A Metal Shading Language compatibility header for clang++-15 (C++17), two modes:
//  - check (default): address spaces are clang address-space attributes, so moving a
//    pointer between device / constant / threadgroup, or writing to constant, is an
//    error; used with -fsyntax-only on every generated kernel.
//  - KILN_SIM: a CPU simulation of threadgroups: one std::thread per lane, a std::barrier
//    per threadgroup and one per simdgroup (simd_sum & co. exchange values through it).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>
#ifdef KILN_SIM
#include <barrier>  // C++20: the simulator builds with -std=c++20
#include <memory>
#include <thread>
#include <vector>
#define device
#define constant
#define threadgroup
#else
#define thread
#define device __attribute__((address_space(1)))
#define constant const __attribute__((address_space(2)))  // read-only, as in MSL
#define threadgroup __attribute__((address_space(3)))
#endif
#define kernel

typedef _Float16 half;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;

#define KILN_VEC(T) \
  typedef T T##2 __attribute__((ext_vector_type(2))); \
  typedef T T##3 __attribute__((ext_vector_type(3))); \
  typedef T T##4 __attribute__((ext_vector_type(4)));
KILN_VEC(float) KILN_VEC(half) KILN_VEC(char) KILN_VEC(uchar) KILN_VEC(short) KILN_VEC(ushort)
KILN_VEC(int) KILN_VEC(uint) KILN_VEC(long) KILN_VEC(ulong)
#undef KILN_VEC

namespace metal {
using std::fabs; using std::fmod; using std::pow; using std::atan2; using std::rint; using std::exp;
using std::log; using std::sin; using std::cos; using std::tan; using std::asin; using std::acos;
using std::atan; using std::sinh; using std::cosh; using std::tanh; using std::sqrt; using std::floor;
using std::ceil; using std::trunc; using std::min; using std::max; using std::isfinite; using std::isnan;
#define KILN_HALF1(f) inline half f(half x) { return (half)std::f((float)x); }
#define KILN_HALF2(f) inline half f(half x, half y) { return (half)std::f((float)x, (float)y); }
KILN_HALF1(fabs) KILN_HALF1(rint) KILN_HALF1(exp) KILN_HALF1(log) KILN_HALF1(sin) KILN_HALF1(cos)
KILN_HALF1(tan) KILN_HALF1(asin) KILN_HALF1(acos) KILN_HALF1(atan) KILN_HALF1(sinh) KILN_HALF1(cosh)
KILN_HALF1(tanh) KILN_HALF1(sqrt) KILN_HALF1(floor) KILN_HALF1(ceil) KILN_HALF1(trunc)
KILN_HALF2(fmod) KILN_HALF2(pow) KILN_HALF2(atan2)
#undef KILN_HALF1
#undef KILN_HALF2

template <class To, class From> inline To as_type(From v) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  To t; std::memcpy(&t, &v, sizeof(To)); return t;
}

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };

#ifdef KILN_SIM
// -- the simulated machine: set per lane by the launcher (kiln_sim_launch) -------------
struct KilnSimd {
  std::barrier<> bar;
  int width;
  alignas(32) unsigned char slot[32][32];
  explicit KilnSimd(int w) : bar(w), width(w) {}
};
extern thread_local std::barrier<>* kiln_tg_barrier;
extern thread_local KilnSimd* kiln_simd;
extern thread_local unsigned kiln_lane;

inline void threadgroup_barrier(mem_flags) { kiln_tg_barrier->arrive_and_wait(); }
inline void simdgroup_barrier(mem_flags) { kiln_simd->bar.arrive_and_wait(); }

template <class T> inline void kiln_publish(T v) {
  static_assert(sizeof(T) <= 32, "simd value too wide");
  std::memcpy(kiln_simd->slot[kiln_lane], &v, sizeof(T));
  kiln_simd->bar.arrive_and_wait();
}
template <class T> inline T kiln_peek(unsigned l) { T v; std::memcpy(&v, kiln_simd->slot[l], sizeof(T)); return v; }
template <class T, class F> inline T kiln_simd_fold(T v, F f) {
  kiln_publish(v);
  T acc = kiln_peek<T>(0);
  for (int l = 1; l < kiln_simd->width; ++l) acc = f(acc, kiln_peek<T>(l));
  kiln_simd->bar.arrive_and_wait();
  return acc;
}
template <class T> inline T simd_sum(T v) { return kiln_simd_fold(v, [](T a, T b) { return T(a + b); }); }
template <class T> inline T simd_product(T v) { return kiln_simd_fold(v, [](T a, T b) { return T(a * b); }); }
template <class T> inline T simd_max(T v) { return kiln_simd_fold(v, [](T a, T b) { return a > b ? a : b; }); }
template <class T> inline T simd_min(T v) { return kiln_simd_fold(v, [](T a, T b) { return a < b ? a : b; }); }
template <class T> inline T simd_and(T v) { return kiln_simd_fold(v, [](T a, T b) { return T(a & b); }); }
template <class T> inline T simd_or(T v) { return kiln_simd_fold(v, [](T a, T b) { return T(a | b); }); }
template <class T> inline T simd_shuffle_xor(T v, ushort mask) {
  kiln_publish(v);
  T r = kiln_peek<T>((kiln_lane ^ mask) % kiln_simd->width);
  kiln_simd->bar.arrive_and_wait();
  return r;
}
template <class T> inline T simd_shuffle_down(T v, ushort d) {
  kiln_publish(v);
  unsigned src = kiln_lane + d;
  T r = src < (unsigned)kiln_simd->width ? kiln_peek<T>(src) : v;
  kiln_simd->bar.arrive_and_wait();
  return r;
}
template <class T> inline T simd_broadcast(T v, ushort l) {
  kiln_publish(v);
  T r = kiln_peek<T>(l);
  kiln_simd->bar.arrive_and_wait();
  return r;
}
#else
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);
template <class T> T simd_sum(T);
template <class T> T simd_product(T);
template <class T> T simd_max(T);
template <class T> T simd_min(T);
template <class T> T simd_and(T);
template <class T> T simd_or(T);
template <class T> T simd_shuffle_xor(T, ushort);
template <class T> T simd_shuffle_down(T, ushort);
template <class T> T simd_broadcast(T, ushort);
#endif

// simdgroup_matrix: in the simulation every lane holds the whole 8x8 tile (the hardware
// spreads it over the 32 lanes); loads and products are the same in every lane, and only
// lane 0 stores, followed by a simdgroup barrier.
template <class T, int R, int C> struct simdgroup_matrix {
  T e[R][C];
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T v) { for (int i = 0; i < R; ++i) for (int j = 0; j < C; ++j) e[i][j] = i == j ? v : T(0); }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;

#define KILN_SG_LOAD(AS) \
  template <class T, int R, int C> inline void simdgroup_load(simdgroup_matrix<T, R, C>& m, \
      const AS T* src, ulong elements_per_row = C, ulong2 origin = 0, bool transpose = false) { \
    for (int i = 0; i < R; ++i) for (int j = 0; j < C; ++j) { \
      ulong r = origin.y + i, c = origin.x + j; \
      m.e[i][j] = transpose ? src[c * elements_per_row + r] : src[r * elements_per_row + c]; } } \
  template <class T, int R, int C> inline void simdgroup_store(const simdgroup_matrix<T, R, C>& m, \
      AS T* dst, ulong elements_per_row = C, ulong2 origin = 0, bool transpose = false) { \
    KILN_SG_STORE_BODY }
#ifdef KILN_SIM
#define KILN_SG_STORE_BODY \
    if (kiln_lane == 0) for (int i = 0; i < R; ++i) for (int j = 0; j < C; ++j) { \
      ulong r = origin.y + i, c = origin.x + j; \
      (transpose ? dst[c * elements_per_row + r] : dst[r * elements_per_row + c]) = m.e[i][j]; } \
    kiln_simd->bar.arrive_and_wait();
#else
#define KILN_SG_STORE_BODY \
    for (int i = 0; i < R; ++i) for (int j = 0; j < C; ++j) dst[(origin.y + i) * elements_per_row + origin.x + j] = m.e[i][j];
#endif
KILN_SG_LOAD(device)
#ifndef KILN_SIM
KILN_SG_LOAD(threadgroup)
#endif
template <class T, int R, int K, int C>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<T, R, C>& d, const simdgroup_matrix<T, R, K>& a,
                                          const simdgroup_matrix<T, K, C>& b, const simdgroup_matrix<T, R, C>& c) {
  simdgroup_matrix<T, R, C> out;
  for (int i = 0; i < R; ++i) for (int j = 0; j < C; ++j) {
    T s = c.e[i][j];
    for (int k = 0; k < K; ++k) s = T(s + a.e[i][k] * b.e[k][j]);
    out.e[i][j] = s;
  }
  d = out;
}
}  // namespace metal
