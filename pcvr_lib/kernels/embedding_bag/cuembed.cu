// cuembed: forward-only embedding-bag mean in CUDA C++ (built at first use by cuembed.py).
//
// out[b] = mean of w[ids[b, l]] over 0 < ids[b, l] < V; empty bag -> zeros; fp32 accumulation.
// A group of TX threads owns one bag; each thread owns VEC consecutive columns and loads them with one
// 16-byte load (or element by element where the width or the pointers do not allow it). The ids of a
// chunk of UNROLL positions are read first, then all UNROLL row loads are issued before any is used,
// so several independent DRAM requests per thread are in flight. No torch headers: the library is
// called through ctypes with raw pointers and the caller's stream, which keeps the build short and the
// per-call host cost to one foreign call.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <int BYTES> struct VecType;
template <> struct VecType<16> { using type = uint4; };
template <> struct VecType<8> { using type = uint2; };
template <> struct VecType<4> { using type = unsigned int; };
template <> struct VecType<2> { using type = unsigned short; };

constexpr int UNROLL = 8;

template <typename T, typename I, int VEC>
__global__ void __launch_bounds__(256) embag_mean_fwd_kernel(const T* __restrict__ w, const I* __restrict__ ids,
                                                             T* __restrict__ out, int64_t B, int L, int64_t V,
                                                             int D) {
  using V_t = typename VecType<VEC * sizeof(T)>::type;
  const int64_t b = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  if (b >= B) return;
  const I* bag = ids + b * L;
  for (int c = threadIdx.x * VEC; c < D; c += blockDim.x * VEC) {
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
    int count = 0;
    for (int l0 = 0; l0 < L; l0 += UNROLL) {
      int64_t row[UNROLL];
      bool ok[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int64_t id = (l0 + u < L) ? (int64_t)__ldg(bag + l0 + u) : 0;
        ok[u] = id > 0 && id < V;
        row[u] = ok[u] ? id : 0;
        count += ok[u];
      }
      V_t raw[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (ok[u]) raw[u] = __ldg(reinterpret_cast<const V_t*>(w + row[u] * D + c));
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (ok[u]) {
          const T* v = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
          for (int k = 0; k < VEC; ++k) acc[k] += to_f(v[k]);
        }
      }
    }
    const float inv = 1.f / (float)(count > 0 ? count : 1);
    V_t packed;
    T* p = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int k = 0; k < VEC; ++k) p[k] = from_f<T>(acc[k] * inv);
    *reinterpret_cast<V_t*>(out + b * D + c) = packed;
  }
}

template <typename T, typename I, int VEC>
cudaError_t launch(const void* w, const void* ids, void* out, int64_t B, int L, int64_t V, int D,
                   cudaStream_t stream) {
  int cols = (D + VEC - 1) / VEC;
  int tx = 1;
  while (tx < cols && tx < 32) tx *= 2;
  const int ty = 256 / tx;
  const dim3 block(tx, ty);
  const dim3 grid((unsigned)((B + ty - 1) / ty));
  embag_mean_fwd_kernel<T, I, VEC><<<grid, block, 0, stream>>>(
      static_cast<const T*>(w), static_cast<const I*>(ids), static_cast<T*>(out), B, L, V, D);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_idx(int idx64, int vec16, const void* w, const void* ids, void* out, int64_t B, int L,
                         int64_t V, int D, cudaStream_t s) {
  constexpr int V16 = 16 / sizeof(T);
  if (idx64) {
    return vec16 ? launch<T, int64_t, V16>(w, ids, out, B, L, V, D, s) : launch<T, int64_t, 1>(w, ids, out, B, L, V, D, s);
  }
  return vec16 ? launch<T, int32_t, V16>(w, ids, out, B, L, V, D, s) : launch<T, int32_t, 1>(w, ids, out, B, L, V, D, s);
}

}  // namespace

// dtype_code: 0 float32, 1 float16, 2 bfloat16. vec16: 1 when D * element size is a multiple of 16 bytes
// and both weight and output are 16-byte aligned. Returns a cudaError_t (0 on success).
extern "C" int pcvr_embag_mean_fwd(int dtype_code, int idx64, int vec16, const void* w, const void* ids, void* out,
                                   int64_t B, int L, int64_t V, int D, void* stream) {
  if (B == 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype_code) {
    case 0: return dispatch_idx<float>(idx64, vec16, w, ids, out, B, L, V, D, s);
    case 1: return dispatch_idx<__half>(idx64, vec16, w, ids, out, B, L, V, D, s);
    case 2: return dispatch_idx<__nv_bfloat16>(idx64, vec16, w, ids, out, B, L, V, D, s);
    default: return (int)cudaErrorInvalidValue;
  }
}

extern "C" const char* pcvr_embag_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }
