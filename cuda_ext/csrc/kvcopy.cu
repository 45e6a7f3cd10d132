// Block copies between an engine's paged GPU KV cache and the shared-memory
// CPU tier, behind a plain C ABI: cuda_ext/_lib.py loads this library with
// ctypes. It includes no torch or Python headers, so nvcc alone builds it, and
// cudart is linked statically, so it loads where no CUDA library is installed
// (calls then return cudaErrorInsufficientDriver or cudaErrorNoDevice).
//
// Vocabulary (cuda_ext/layouts.py): a *plane* is a block-major GPU buffer
// whose per-block *chunk* is `chunk_bytes` contiguous bytes, the same for every
// plane. A CPU slot holds one rank's chunks plane after plane: chunk (plane p,
// block i) lives at slot_i + p * chunk_bytes, where slot_i already includes
// the rank's shard offset.
//
// Every function returns a cudaError_t (0: success) and leaves no pending
// error behind. Those taking `device` select it (cudaSetDevice); callers make
// it current first (cuda_ext/gpu.py does), so that never switches the engine
// thread's context, and nothing here creates a context on another GPU.

#include <cuda_runtime.h>

#include <stdint.h>
#include <stdlib.h>

namespace {

constexpr int kAbiVersion = 2;
constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kPieceVecs = kThreads * kUnroll;  // 16-byte vectors: 16 KiB per CTA step

// The launch's chunks, plane-major (every block of one plane, then the next
// plane, so a launch over a plane range covers exactly those planes), laid
// end to end form one run of 16-byte vectors; a unit is the next 16 KiB of it.
// A unit may span several small chunks (4 KiB per K or V of a small-head
// layer) or be a piece of a large one, so every thread always has kUnroll
// vectors to move. A thread loads all its vectors before storing any: reads
// of mapped host memory cross PCIe, and only many reads in flight hide that
// latency.
//
// Index is the type of positions in that run: uint32_t whenever the launch
// has fewer than 2^32 vectors (64 GiB), because a 64-bit division is a long
// software routine on the GPU and each vector takes two. Addresses are always
// computed in 64 bits.
template <typename Index>
__global__ void __launch_bounds__(kThreads)
    copy_chunks(const uint64_t *__restrict__ planes, const int64_t *__restrict__ blocks,
                const uint64_t *__restrict__ slots, Index n, Index plane_begin,
                Index chunk_vecs, Index total_vecs, bool to_host) {
  const Index stride = static_cast<Index>(gridDim.x) * kPieceVecs;
  for (Index base = blockIdx.x * kPieceVecs; base < total_vecs; base += stride) {
    uint4 v[kUnroll];
    uint4 *dst[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const Index f = base + threadIdx.x + u * kThreads;
      dst[u] = nullptr;
      if (f < total_vecs) {
        const Index chunk = f / chunk_vecs;
        const Index offset = f - chunk * chunk_vecs;
        const Index plane = plane_begin + chunk / n;
        const Index i = chunk - (chunk / n) * n;
        uint4 *gpu = reinterpret_cast<uint4 *>(planes[plane]) +
                     blocks[i] * static_cast<int64_t>(chunk_vecs) + offset;
        uint4 *host = reinterpret_cast<uint4 *>(slots[i]) +
                      static_cast<int64_t>(plane) * chunk_vecs + offset;
        v[u] = to_host ? *gpu : *host;
        dst[u] = to_host ? host : gpu;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (dst[u] != nullptr) *dst[u] = v[u];
    }
  }
}

// Returns `err` after clearing the runtime's last-error slot, so a failure
// reported here never resurfaces as the launch error of a later call.
int done(cudaError_t err) {
  cudaGetLastError();
  return static_cast<int>(err);
}

}  // namespace

#define KV_EXPORT __attribute__((visibility("default")))

extern "C" {

KV_EXPORT int kv_abi_version(void) { return kAbiVersion; }

KV_EXPORT int kv_runtime_version(void) { return CUDART_VERSION; }

KV_EXPORT int kv_has_batch_memcpy(void) { return CUDART_VERSION >= 13000; }

KV_EXPORT const char *kv_error_name(int err) { return cudaGetErrorName(static_cast<cudaError_t>(err)); }

KV_EXPORT const char *kv_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

KV_EXPORT int kv_driver_version(int *version) {
  *version = 0;
  return done(cudaDriverGetVersion(version));
}

KV_EXPORT int kv_device_count(int *count) {
  *count = 0;
  return done(cudaGetDeviceCount(count));
}

KV_EXPORT int kv_sm_count(int device, int *count) {
  *count = 0;
  return done(cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device));
}

// Pin [ptr, ptr + bytes) for every device and map it into their address
// space; *device_ptr is the address kernels use.
KV_EXPORT int kv_host_register(int device, void *ptr, size_t bytes, void **device_ptr) {
  *device_ptr = nullptr;
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) {
    err = cudaHostRegister(ptr, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  }
  if (err == cudaSuccess) {
    err = cudaHostGetDevicePointer(device_ptr, ptr, 0);
    if (err != cudaSuccess) cudaHostUnregister(ptr);
  }
  return done(err);
}

// The device address of memory someone else registered (mapped) already.
KV_EXPORT int kv_host_device_pointer(int device, void *ptr, void **device_ptr) {
  *device_ptr = nullptr;
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaHostGetDevicePointer(device_ptr, ptr, 0);
  return done(err);
}

KV_EXPORT int kv_host_unregister(void *ptr) { return done(cudaHostUnregister(ptr)); }

// Checks one sm op's ids and writes the index copy_chunks reads, in one call
// instead of a dozen numpy ones before every launch (host code, no GPU).
// out[i] = blocks[i]; out[n + i] = the device address of this rank's shard of
// slot slots[i]: the slot's segment base + its offset there + shard_offset.
// Segment s holds seg_slots[s] slots of `stride` bytes at device address
// seg_bases[s]; slots are numbered across segments in order. `unique` names
// the ids that must not repeat: 1 block ids (a load), 2 slots (a save).
// `seen` is a zeroed bitmap with a bit per possible id; it is zeroed again
// on return. Returns 0, or what is wrong: 1 a block id out of
// [0, num_blocks), 2 a slot out of range, 3 a repeated id (the caller's own
// checks then say which in full); `out` is then incomplete.
KV_EXPORT int kv_stage_index(const int64_t *blocks, const int64_t *slots, int64_t n,
                             int64_t num_blocks, const int64_t *seg_slots,
                             const uint64_t *seg_bases, int64_t nseg, int64_t stride,
                             int64_t shard_offset, int unique, uint8_t *seen, int64_t *out) {
  int64_t total = 0;
  for (int64_t s = 0; s < nseg; ++s) total += seg_slots[s];
  int code = 0;
  int64_t i = 0;
  for (; i < n; ++i) {
    const int64_t block = blocks[i], slot = slots[i];
    if (block < 0 || block >= num_blocks) {
      code = 1;
      break;
    }
    if (slot < 0 || slot >= total) {
      code = 2;
      break;
    }
    if (unique != 0) {
      const int64_t id = unique == 1 ? block : slot;
      const uint8_t bit = static_cast<uint8_t>(1u << (id & 7));
      if (seen[id >> 3] & bit) {
        code = 3;
        break;
      }
      seen[id >> 3] |= bit;
    }
    int64_t segment = 0, first = 0;
    while (slot >= first + seg_slots[segment]) first += seg_slots[segment++];
    out[i] = block;
    out[n + i] = static_cast<int64_t>(seg_bases[segment] +
                                      static_cast<uint64_t>((slot - first) * stride + shard_offset));
  }
  if (unique != 0) {  // clear exactly the bits set: entries before i
    for (int64_t j = 0; j < i; ++j) {
      const int64_t id = unique == 1 ? blocks[j] : slots[j];
      seen[id >> 3] = 0;
    }
  }
  return code;
}

// One kernel launch on `stream` copies chunk (p, i) for every plane p in
// [plane_begin, plane_end) and every i < n. `planes` (device, uint64 per
// plane) are the planes' base addresses; `index` (device, 2n int64) holds the
// n block ids, then the n slots' device addresses. to_host: GPU -> slots.
// chunk_bytes and every address must be multiples of 16 (checked by the caller).
KV_EXPORT int kv_copy_sm(int device, const uint64_t *planes, const int64_t *index, int64_t n,
               int64_t plane_begin, int64_t plane_end, int64_t chunk_bytes, int to_host,
               int max_ctas, void *stream) {
  if (n <= 0 || plane_begin < 0 || plane_end <= plane_begin || chunk_bytes <= 0 ||
      chunk_bytes % 16 != 0 || max_ctas <= 0) {
    return done(cudaErrorInvalidValue);
  }
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return done(err);
  cudaGetLastError();
  const int64_t chunk_vecs = chunk_bytes / 16;
  const int64_t total_vecs = (plane_end - plane_begin) * n * chunk_vecs;
  const int64_t units = (total_vecs + kPieceVecs - 1) / kPieceVecs;
  const int64_t ctas = units < max_ctas ? units : max_ctas;
  const auto slots = reinterpret_cast<const uint64_t *>(index + n);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The last step's base + kPieceVecs must fit as well as total_vecs.
  if (total_vecs + ctas * kPieceVecs <= static_cast<int64_t>(UINT32_MAX)) {
    copy_chunks<uint32_t><<<static_cast<unsigned>(ctas), kThreads, 0, s>>>(
        planes, index, slots, static_cast<uint32_t>(n), static_cast<uint32_t>(plane_begin),
        static_cast<uint32_t>(chunk_vecs), static_cast<uint32_t>(total_vecs), to_host != 0);
  } else {
    copy_chunks<int64_t><<<static_cast<unsigned>(ctas), kThreads, 0, s>>>(
        planes, index, slots, n, plane_begin, chunk_vecs, total_vecs, to_host != 0);
  }
  return done(cudaGetLastError());
}

// `count` copies of `bytes` each, srcs[i] -> dsts[i] (host arrays of UVA
// addresses), on the copy engines. With try_batch and a CUDA 13 runtime: one
// cudaMemcpyBatchAsync; if the driver refuses it, *batch_error says why and a
// loop of cudaMemcpyAsync runs instead. *used_batch says which one ran.
KV_EXPORT int kv_copy_dma(int device, void *const *dsts, const void *const *srcs, size_t bytes,
                size_t count, int try_batch, void *stream, int *used_batch, int *batch_error) {
  *used_batch = 0;
  *batch_error = 0;
  if (count == 0) return 0;
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return done(err);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
#if CUDART_VERSION >= 13000
  if (try_batch) {
    size_t *sizes = static_cast<size_t *>(malloc(count * sizeof(size_t)));
    if (sizes == nullptr) return done(cudaErrorMemoryAllocation);
    for (size_t i = 0; i < count; ++i) sizes[i] = bytes;
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t first = 0;
    err = cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &first, 1, s);
    free(sizes);
    if (err == cudaSuccess) {
      *used_batch = 1;
      return 0;
    }
    *batch_error = done(err);
  }
#else
  (void)try_batch;
#endif
  for (size_t i = 0; i < count; ++i) {
    err = cudaMemcpyAsync(dsts[i], srcs[i], bytes, cudaMemcpyDefault, s);
    if (err != cudaSuccess) return done(err);
  }
  return 0;
}

// One contiguous copy: the floor the benchmark compares with.
KV_EXPORT int kv_memcpy(int device, void *dst, const void *src, size_t bytes, void *stream) {
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream));
  }
  return done(err);
}

}  // extern "C"
