#pragma OPENCL FP_CONTRACT OFF
inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

/* gemm [1] x [B, 512] @ [512, 1024]: 64 x 64 blocks, 16-deep local-memory slices, 4 x 4 outputs per work-item, epilogue fused */
__kernel __attribute__((reqd_work_group_size(16, 16, 1)))
void kiln_mlp_gemm_0(__global const float *b_in0, __global const float *b_in1, __global const float *b_in2, __global float *b_out0, const long s_B) {
  __local float As[16][64];
  __local float Bs[16][64];
  const long M = s_B, N = 1024L, K = 512L;
  const int tx = get_local_id(0), ty = get_local_id(1), tid = ty * 16 + tx;
  const long gb = get_group_id(2);
  const long bm0 = (long)get_group_id(1) * 64, bn0 = (long)get_group_id(0) * 64;
  float acc[4][4];
  for (int i = 0; i < 4; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = (float)0;
  for (long k0 = 0; k0 < K; k0 += 16) {
    for (int l = tid; l < 1024; l += 256) {
      const int r = l / 16, kk = l % 16;
      const long gr = bm0 + r, gk = k0 + kk;
      As[kk][r] = (gr < M && gk < K) ? (float)b_in0[gb * 0L + gr * 512L + gk * 1L] : (float)0;
    }
    for (int l = tid; l < 1024; l += 256) {
      const int kk = l / 64, c = l % 64;
      const long gc = bn0 + c, gk = k0 + kk;
      Bs[kk][c] = (gc < N && gk < K) ? (float)b_in1[gb * 0L + gk * 1024L + gc * 1L] : (float)0;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int kk = 0; kk < 16; ++kk) {
      float av[4], bv[4];
      for (int i = 0; i < 4; ++i) av[i] = As[kk][ty + i * 16];
      for (int j = 0; j < 4; ++j) bv[j] = Bs[kk][tx + j * 16];
      for (int i = 0; i < 4; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = (float)(acc[i][j] + av[i] * bv[j]);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  for (int i = 0; i < 4; ++i) {
    const long gi = bm0 + ty + i * 16;
    if (gi >= M) break;
    for (int j = 0; j < 4; ++j) {
      const long gj = bn0 + tx + j * 16;
      if (gj >= N) break;
      const float accv = acc[i][j];
      const float t0 = ((float)accv);
      const float t1 = b_in2[gj];
      const float t2 = (t0 + t1);
      const uchar t3 = (t2 != t2);
      const uchar t4 = (((float)0.0f) != ((float)0.0f));
      const uchar t5 = (t2 == ((float)0.0f));
      const uchar t6 = (((float)0.0f) == ((float)0.0f));
      const uchar t7 = (t5 & t6);
      const float t8 = (t2 + ((float)0.0f));
      const uchar t9 = (t2 > ((float)0.0f));
      const float t10 = (t9 ? t2 : ((float)0.0f));
      const float t11 = (t7 ? t8 : t10);
      const float t12 = (t4 ? ((float)0.0f) : t11);
      const float t13 = (t3 ? t2 : t12);
      b_out0[(gb * M + gi) * N + gj] = t13;
    }
  }
}
