// Block copies between an engine's paged GPU KV cache and the shared-memory
// CPU tier, behind a plain C ABI: cuda_ext/_lib.py loads this library with
// ctypes. It includes no torch or Python headers, so nvcc alone builds it, and
// cudart is linked statically, so it loads where no CUDA library is installed
// (calls then return cudaErrorInsufficientDriver or cudaErrorNoDevice).
//
// Vocabulary (cuda_ext/layouts.py): a *plane* is a block-major GPU buffer
// whose per-block *chunk* is `chunk_bytes` contiguous bytes, the same for every
// plane; block b of plane p starts b * stride_p bytes into it, stride_p at
// least chunk_bytes (more for a padded page, a layer of a cross-layer block
// or a head of a head-outer layer: the copies are strided, never staged). A
// CPU slot holds one rank's chunks plane after plane: chunk (plane p, block
// i) lives at slot_i + p * chunk_bytes, where slot_i already includes the
// rank's shard offset.
//
// Every function returns a cudaError_t (0: success) and leaves no pending
// error behind. Those taking a device make it current for the call only and
// then put back exactly the context the calling thread had (DeviceGuard), so
// they never switch the engine thread's device nor start a context on
// another GPU.

#include <cuda_runtime.h>

#include <stdint.h>
#include <stdlib.h>

namespace {

constexpr int kAbiVersion = 4;
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
// computed in 64 bits. `planes` holds each plane's base address, then each
// plane's block stride in 16-byte vectors.
template <typename Index>
__global__ void __launch_bounds__(kThreads)
    copy_chunks(const uint64_t *__restrict__ planes, int64_t num_planes,
                const int64_t *__restrict__ blocks,
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
                     blocks[i] * static_cast<int64_t>(planes[num_planes + plane]) + offset;
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

// The driver's cuCtxGetCurrent / cuCtxSetCurrent (CUresult f(CUcontext *) /
// f(CUcontext)), found once; null where the driver lacks them.
struct ContextCalls {
  int (*get)(void **) = nullptr;
  int (*set)(void *) = nullptr;
};

const ContextCalls &context_calls() {
  static const ContextCalls calls = [] {
    ContextCalls found;
    void *get = nullptr, *set = nullptr;
    cudaDriverEntryPointQueryResult status;
#if CUDART_VERSION >= 12050
    cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &get, 4000, cudaEnableDefault, &status);
    cudaGetDriverEntryPointByVersion("cuCtxSetCurrent", &set, 4000, cudaEnableDefault, &status);
#else
    cudaGetDriverEntryPoint("cuCtxGetCurrent", &get, cudaEnableDefault, &status);
    cudaGetDriverEntryPoint("cuCtxSetCurrent", &set, cudaEnableDefault, &status);
#endif
    cudaGetLastError();
    if (get != nullptr && set != nullptr) {
      found.get = reinterpret_cast<int (*)(void **)>(get);
      found.set = reinterpret_cast<int (*)(void *)>(set);
    }
    return found;
  }();
  return calls;
}

// Makes `device` current for one call, then puts back exactly the context
// the calling thread had, none included: a thread that had no context gets
// none (cudaSetDevice back to "device 0" would create one on GPU 0).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    const ContextCalls &calls = context_calls();
    exact_ = calls.get != nullptr && calls.get(&context_) == 0;
    err_ = cudaGetDevice(&previous_);
    if (err_ == cudaSuccess && (previous_ != device || (exact_ && context_ == nullptr))) {
      err_ = cudaSetDevice(device);
      switched_ = err_ == cudaSuccess;
    }
  }
  ~DeviceGuard() {
    if (switched_) {
      if (exact_) {
        context_calls().set(context_);
      } else {
        cudaSetDevice(previous_);
      }
      cudaGetLastError();  // a failed restore leaves no error for a later call
    }
  }
  cudaError_t error() const { return err_; }

 private:
  void *context_ = nullptr;
  bool exact_ = false;
  int previous_ = 0;
  bool switched_ = false;
  cudaError_t err_;
};

// Queues one copy_chunks launch over planes [plane_begin, plane_end) of
// `num_planes` (planes: their addresses, then their strides in vectors).
cudaError_t launch_copy(const uint64_t *planes, int64_t num_planes, const int64_t *index,
                        int64_t n, int64_t plane_begin, int64_t plane_end,
                        int64_t chunk_bytes, bool to_host, int64_t max_ctas,
                        cudaStream_t stream) {
  const int64_t chunk_vecs = chunk_bytes / 16;
  const int64_t total_vecs = (plane_end - plane_begin) * n * chunk_vecs;
  const int64_t units = (total_vecs + kPieceVecs - 1) / kPieceVecs;
  const int64_t ctas = units < max_ctas ? units : max_ctas;
  const auto slots = reinterpret_cast<const uint64_t *>(index + n);
  // The last step's base + kPieceVecs must fit as well as total_vecs.
  if (total_vecs + ctas * kPieceVecs <= static_cast<int64_t>(UINT32_MAX)) {
    copy_chunks<uint32_t><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(
        planes, num_planes, index, slots, static_cast<uint32_t>(n),
        static_cast<uint32_t>(plane_begin),
        static_cast<uint32_t>(chunk_vecs), static_cast<uint32_t>(total_vecs), to_host);
  } else {
    copy_chunks<int64_t><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(
        planes, num_planes, index, slots, n, plane_begin, chunk_vecs, total_vecs, to_host);
  }
  return cudaGetLastError();
}

// A copier's sm-path state, made once (kv_ops_create) so that an op is one
// call (kv_ops_run): the planes' base addresses on the device, the pool's
// segments, and the buffers an op's index goes through. The index (n block
// ids, then n slot device addresses) is written into one of kRing pinned
// host buffers, used in turn, and copied on the copier's stream to one device
// buffer that only launches queued after that copy read; a host buffer is
// rewritten only once its `copied` event says the copy that read it has run.
constexpr int kRing = 8;

struct KvOps {
  int device;
  cudaStream_t stream;
  uint64_t *planes;  // device array: each plane's base address, then its block stride in vectors
  int64_t num_planes, chunk_bytes, num_blocks;
  int64_t ctas[2];  // by direction: [load, save]
  int64_t nseg;
  uint64_t *seg_bases;  // host array: each segment's device address
  int64_t min_entries, capacity;  // int64s per index buffer
  int64_t *host[kRing];
  cudaEvent_t copied[kRing];
  int turn;
  int64_t *dev;
  cudaEvent_t ready;  // where the caller's stream stood when an op was queued
};

void free_index(KvOps *ops) {
  for (int r = 0; r < kRing; ++r) {
    if (ops->host[r] != nullptr) cudaFreeHost(ops->host[r]);
    ops->host[r] = nullptr;
  }
  if (ops->dev != nullptr) cudaFree(ops->dev);
  ops->dev = nullptr;
  ops->capacity = 0;
}

// Index buffers of at least `entries` int64s, once nothing queued reads the
// old ones. Growing waits for the whole GPU: cudaMallocHost synchronizes
// the device, and so does cudaFree.
cudaError_t reserve_index(KvOps *ops, int64_t entries) {
  if (entries <= ops->capacity) return cudaSuccess;
  cudaError_t err = cudaStreamSynchronize(ops->stream);
  if (err != cudaSuccess) return err;
  int64_t size = 2 * ops->capacity;
  if (size < entries) size = entries;
  if (size < ops->min_entries) size = ops->min_entries;
  free_index(ops);
  const size_t bytes = static_cast<size_t>(size) * sizeof(int64_t);
  for (int r = 0; r < kRing && err == cudaSuccess; ++r) {
    err = cudaMallocHost(reinterpret_cast<void **>(&ops->host[r]), bytes);
  }
  if (err == cudaSuccess) err = cudaMalloc(reinterpret_cast<void **>(&ops->dev), bytes);
  if (err != cudaSuccess) {
    free_index(ops);
    return err;
  }
  ops->capacity = size;
  return cudaSuccess;
}

void destroy_events(void **events, int64_t count) {
  for (int64_t g = 0; g < count; ++g) {
    if (events[g] != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(events[g]));
    events[g] = nullptr;
  }
}

}  // namespace

#define KV_EXPORT __attribute__((visibility("default")))

extern "C" {

KV_EXPORT int kv_ops_destroy(KvOps *ops);

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
  DeviceGuard guard(device);
  cudaError_t err = guard.error();
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
  DeviceGuard guard(device);
  cudaError_t err = guard.error();
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
// on return. With out == NULL it only checks. Returns 0, or what is wrong:
// 1 a block id out of [0, num_blocks), 2 a slot out of range, 3 a repeated id
// (the caller's own checks then say which in full); `out` is then incomplete.
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
    if (out == nullptr) continue;  // checks only
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

// A copier's sm-path state (KvOps above) for `num_planes` planes whose base
// addresses are `plane_addrs` and block strides `plane_strides` bytes (host
// arrays; strides multiples of 16, at least chunk_bytes), `num_blocks`
// blocks of `chunk_bytes` each (a multiple of 16), copying to and from the
// `nseg` pool segments mapped at device addresses `seg_bases`, on `stream`; launches use
// at most ctas_save / ctas_load CTAs. Index buffers start at min_entries int64s
// and grow as ops need.
KV_EXPORT int kv_ops_create(int device, void *stream, const uint64_t *plane_addrs,
                            const uint64_t *plane_strides, int64_t num_planes,
                            int64_t chunk_bytes, int64_t num_blocks,
                            const uint64_t *seg_bases, int64_t nseg, int64_t ctas_save,
                            int64_t ctas_load, int64_t min_entries, KvOps **out) {
  *out = nullptr;
  if (num_planes <= 0 || chunk_bytes <= 0 || chunk_bytes % 16 != 0 || num_blocks <= 0 ||
      nseg <= 0 || ctas_save <= 0 || ctas_load <= 0 || min_entries <= 0) {
    return done(cudaErrorInvalidValue);
  }
  for (int64_t p = 0; p < num_planes; ++p) {
    if (plane_strides[p] % 16 != 0 || plane_strides[p] < static_cast<uint64_t>(chunk_bytes)) {
      return done(cudaErrorInvalidValue);
    }
  }
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return done(guard.error());
  auto *ops = static_cast<KvOps *>(calloc(1, sizeof(KvOps)));
  if (ops == nullptr) return done(cudaErrorMemoryAllocation);
  ops->seg_bases = static_cast<uint64_t *>(malloc(nseg * sizeof(uint64_t)));
  if (ops->seg_bases == nullptr) {
    free(ops);
    return done(cudaErrorMemoryAllocation);
  }
  for (int64_t s = 0; s < nseg; ++s) ops->seg_bases[s] = seg_bases[s];
  ops->device = device;
  ops->stream = static_cast<cudaStream_t>(stream);
  ops->num_planes = num_planes;
  ops->chunk_bytes = chunk_bytes;
  ops->num_blocks = num_blocks;
  ops->ctas[0] = ctas_load;
  ops->ctas[1] = ctas_save;
  ops->nseg = nseg;
  ops->min_entries = min_entries;
  uint64_t *table = static_cast<uint64_t *>(malloc(2 * num_planes * sizeof(uint64_t)));
  if (table == nullptr) {
    kv_ops_destroy(ops);
    return done(cudaErrorMemoryAllocation);
  }
  for (int64_t p = 0; p < num_planes; ++p) {
    table[p] = plane_addrs[p];
    table[num_planes + p] = plane_strides[p] / 16;
  }
  const size_t plane_bytes = 2 * num_planes * sizeof(uint64_t);
  cudaError_t err = cudaMalloc(reinterpret_cast<void **>(&ops->planes), plane_bytes);
  if (err == cudaSuccess) {
    err = cudaMemcpy(ops->planes, table, plane_bytes, cudaMemcpyHostToDevice);
  }
  free(table);
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&ops->ready, cudaEventDisableTiming);
  for (int r = 0; r < kRing && err == cudaSuccess; ++r) {
    err = cudaEventCreateWithFlags(&ops->copied[r], cudaEventDisableTiming);
  }
  // Now, not at the first op: pinning memory waits for all work on the GPU.
  if (err == cudaSuccess) err = reserve_index(ops, min_entries);
  if (err != cudaSuccess) {
    kv_ops_destroy(ops);
    return done(err);
  }
  *out = ops;
  return 0;
}

// Frees what kv_ops_create made, after the copier's stream has run dry.
KV_EXPORT int kv_ops_destroy(KvOps *ops) {
  if (ops == nullptr) return 0;
  DeviceGuard guard(ops->device);
  cudaError_t err = guard.error();
  if (err == cudaSuccess) err = cudaStreamSynchronize(ops->stream);
  free_index(ops);
  if (ops->planes != nullptr) cudaFree(ops->planes);
  if (ops->ready != nullptr) cudaEventDestroy(ops->ready);
  for (int r = 0; r < kRing; ++r) {
    if (ops->copied[r] != nullptr) cudaEventDestroy(ops->copied[r]);
  }
  free(ops->seg_bases);
  free(ops);
  return done(err);
}

KV_EXPORT int kv_index_ring(void) { return kRing; }

// One whole sm op, queued on the copier's stream with no Python in between:
// stage and check the index (kv_stage_index, with seg_slots: slots per pool
// segment at `stride`), upload it, make the stream wait for the work queued
// on `caller` so far, then one launch per group of planes, group g being
// [group_ends[g-1], group_ends[g]) (from 0), each followed by a new event
// written to events[g]; the caller destroys those (kv_events_destroy). With
// n == 0 only the wait and the events are queued. The ids are checked before
// anything waits, frees or is queued: if they are wrong, *refused is
// kv_stage_index's code and nothing changed. If a CUDA call fails once part
// of the op is queued, the stream is drained before the error returns, so
// nothing of a failed op runs later.
KV_EXPORT int kv_ops_run(KvOps *ops, const int64_t *blocks, const int64_t *slots, int64_t n,
                         const int64_t *seg_slots, int64_t stride, int64_t shard_offset,
                         uint8_t *seen, int to_host, void *caller, const int64_t *group_ends,
                         int64_t ngroups, void **events, int *refused) {
  *refused = 0;
  if (ops == nullptr || n < 0 || ngroups <= 0) return done(cudaErrorInvalidValue);
  for (int64_t g = 0; g < ngroups; ++g) events[g] = nullptr;
  for (int64_t g = 0, begin = 0; g < ngroups; begin = group_ends[g++]) {
    if (group_ends[g] <= begin || group_ends[g] > ops->num_planes) {
      return done(cudaErrorInvalidValue);
    }
  }
  const int unique = to_host ? 2 : 1;
  // Checked before anything waits, frees or is queued: wrong ids change nothing.
  *refused = kv_stage_index(blocks, slots, n, ops->num_blocks, seg_slots, ops->seg_bases,
                            ops->nseg, stride, shard_offset, unique, seen, nullptr);
  if (*refused != 0) return 0;
  DeviceGuard guard(ops->device);
  cudaError_t err = guard.error();
  if (err != cudaSuccess) return done(err);
  const cudaStream_t stream = ops->stream;
  bool queued = false;
  if (n > 0) {
    err = reserve_index(ops, 2 * n);
    if (err != cudaSuccess) return done(err);
    const int turn = (ops->turn + 1) % kRing;
    err = cudaEventSynchronize(ops->copied[turn]);
    if (err != cudaSuccess) return done(err);
    ops->turn = turn;
    int64_t *host = ops->host[turn];
    kv_stage_index(blocks, slots, n, ops->num_blocks, seg_slots, ops->seg_bases, ops->nseg,
                   stride, shard_offset, unique, seen, host);  // checked above: cannot refuse
    err = cudaMemcpyAsync(ops->dev, host, 2 * n * sizeof(int64_t), cudaMemcpyHostToDevice,
                          stream);
    queued = err == cudaSuccess;
    if (err == cudaSuccess) err = cudaEventRecord(ops->copied[turn], stream);
  }
  if (err == cudaSuccess) err = cudaEventRecord(ops->ready, static_cast<cudaStream_t>(caller));
  if (err == cudaSuccess) err = cudaStreamWaitEvent(stream, ops->ready, 0);
  for (int64_t g = 0, begin = 0; g < ngroups && err == cudaSuccess; begin = group_ends[g++]) {
    if (n > 0) {
      err = launch_copy(ops->planes, ops->num_planes, ops->dev, n, begin, group_ends[g],
                        ops->chunk_bytes,
                        to_host != 0, ops->ctas[to_host != 0], stream);
      queued = queued || err == cudaSuccess;
    }
    cudaEvent_t event = nullptr;
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (err == cudaSuccess) {
      events[g] = event;
      err = cudaEventRecord(event, stream);
    }
  }
  if (err != cudaSuccess) {
    // The caller is told the op failed: none of it may still run afterwards.
    if (queued) cudaStreamSynchronize(stream);
    destroy_events(events, ngroups);
  }
  return done(err);
}

// A new event recorded on `stream` (the dma path's per-group events).
KV_EXPORT int kv_event_record_new(int device, void *stream, void **event) {
  *event = nullptr;
  DeviceGuard guard(device);
  cudaError_t err = guard.error();
  cudaEvent_t created = nullptr;
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&created, cudaEventDisableTiming);
  if (err == cudaSuccess) {
    err = cudaEventRecord(created, static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) cudaEventDestroy(created);
  }
  if (err == cudaSuccess) *event = created;
  return done(err);
}

KV_EXPORT int kv_events_destroy(int device, void **events, int64_t count) {
  DeviceGuard guard(device);
  destroy_events(events, count);
  return done(guard.error());
}

// Makes `stream` (of `device`; 0 is that device's default stream) wait for
// `event`; returns at once.
KV_EXPORT int kv_stream_wait_event(int device, void *stream, void *event) {
  DeviceGuard guard(device);
  cudaError_t err = guard.error();
  if (err == cudaSuccess) {
    err = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event),
                              0);
  }
  return done(err);
}

KV_EXPORT int kv_event_synchronize(int device, void *event) {
  DeviceGuard guard(device);
  cudaError_t err = guard.error();
  if (err == cudaSuccess) err = cudaEventSynchronize(static_cast<cudaEvent_t>(event));
  return done(err);
}

// 0 if the work before `event` is done, cudaErrorNotReady if not.
KV_EXPORT int kv_event_query(int device, void *event) {
  DeviceGuard guard(device);
  cudaError_t err = guard.error();
  if (err == cudaSuccess) err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  return done(err);
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
  DeviceGuard guard(device);
  cudaError_t err = guard.error();
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
  DeviceGuard guard(device);
  cudaError_t err = guard.error();
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream));
  }
  return done(err);
}

}  // extern "C"
