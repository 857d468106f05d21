// Layer 2, a transport's kernels: the device-side helpers every kernel file shares (waits on
// a peer's counter with the group's timeout, error records, descriptor checks, dtype
// conversions; the reductions' arithmetic is ../reduce_math.hpp). Internal to cuda/*.cu (each gets its own copy).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "../reduce_math.hpp"
#include "kernels.cuh"

namespace odc {
namespace {
__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_relaxed(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Orders everything before it (this thread's accesses, and by cumulativity what it has
// observed: earlier work on the stream, the block's steps before a __syncthreads) before
// this thread's later stores. One MEMBAR.ALL.SYS: a signal point costs one fence, not one
// per store (__threadfence_system is the costlier sequentially consistent MEMBAR.SC.SYS).
__device__ __forceinline__ void fence_release() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The group's first failure wins: fill the record, then publish its code (the host reads
// the fields once it sees the code); then, where the failed collective was announced
// (`announced`: this rank's announcement of it, 0 if none), tell every peer it was given up
// (layout.hpp, kAnnounceStopped), so that their waits on this rank fail now rather than time
// out. Codes: StopCode (layout.hpp; kernels.cuh, DeviceError).
__device__ void record_error(DeviceError* err_ptr, int code, int peer, unsigned long long op_seq,
                             const char* op, const char* what, unsigned long long mine,
                             unsigned long long theirs, unsigned long long target,
                             unsigned long long seen, unsigned long long announced) {
  volatile DeviceError* err = err_ptr;
  if (err->code != 0 || atomicCAS(err_ptr->claim, 0, 1) != 0) return;
  err->peer = peer;
  err->op_seq = op_seq;
  err->mine = mine;
  err->theirs = theirs;
  err->target = target;
  err->seen = seen;
  err->op = op;
  err->what = what;
  __threadfence_system();
  err->code = code;
  __threadfence_system();
  if (announced == 0) return;
  const uint64_t stopped = stopped_word(announced, code);
  const uint64_t slot = (announced & kAnnounceSeqMask) % kAnnounceSlots;
  for (int i = 0; i < err->n_notify; ++i) store_relaxed(err->notify[i] + slot, stopped);
  __threadfence_system();
}

// Spin until *flag >= target. Returns false when the wait timed out (recorded in
// err) or the group already failed (err->code set by another wait).
// With watch.slots, also fail as soon as the peer announced another collective under the
// number of this rank's announcement, or gave it up (PeerWatch, layout.hpp).
__device__ bool wait_counter(const uint64_t* flag, uint64_t target, uint64_t start,
                             unsigned long long timeout_ns, DeviceError* err_ptr, int peer,
                             unsigned long long op_seq, const char* op, const char* what,
                             const PeerWatch& watch) {
  volatile DeviceError* err = err_ptr;
  uint64_t seen;
  uint32_t iter = 0;
  const uint64_t* watched = watch.slots ? watch.slot_of(peer) : nullptr;
  const unsigned long long announced = watch.slots ? watch.word : 0;
  while ((seen = load_acquire(flag)) < target) {
    if ((++iter & 1023u) != 0) continue;
    if (err->code != 0) return false;  // the group already failed: drain the stream quickly
    if (watched) {
      const uint64_t theirs = load_acquire(watched);
      // (a counter that arrived meanwhile comes first: its descriptor says more)
      if (watch.differs(theirs) && load_acquire(flag) < target) {
        record_error(err_ptr, gave_up_same(watch.word, theirs) ? kStopPeerStopped : kStopAnnounced, peer, op_seq,
                     op, what, watch.word, theirs, 0, 0, announced);
        return false;
      }
    }
    if (global_ns() - start > timeout_ns) {
      record_error(err_ptr, kStopTimeout, peer, op_seq, op, what, 0, 0, target, seen, announced);
      return false;
    }
  }
  return true;
}

// After wait_counter saw the peer's counter reached (the same thread: its acquire orders
// these reads after the peer's stores): false, with the mismatch recorded in err, when the
// descriptor the peer stored with it differs from this rank's or came with another id (the
// chunk's number, or a registered collective's RegisteredId).
__device__ bool check_desc(const uint64_t* desc, unsigned long long expected,
                           unsigned long long chunk, DeviceError* err_ptr, int peer,
                           unsigned long long op_seq, const char* op, unsigned long long announced) {
  const volatile uint64_t* d = reinterpret_cast<const volatile uint64_t*>(desc);
  const unsigned long long theirs = d[0], their_chunk = d[1];
  if (theirs == expected && their_chunk == chunk) return true;
  record_error(err_ptr, kStopMismatch, peer, op_seq, op, nullptr, expected, theirs, chunk,
               their_chunk, announced);
  return false;
}

// Located (../transport.hpp) on the device (after the wait for the owner's "ready", which ordered the
// owner's Location word before it): the source of `len` bytes the word names; null, reading
// nothing, once the group has failed (a failed wait of the copy-engine path does not stop the
// stream: the word may be another call's) or where the word names a segment this GPU has not
// mapped or a range past its end (recorded as code 4: the owner names only segments its peers
// acknowledged, so that is a bug, never a race). A word that says "not mapped" gives `staged`
// and sets *unmapped (a push's destination: staged null, nothing to write).
__device__ const char* resolve_located(const uint64_t* where, int owner, const char* staged,
                                       unsigned long long offset, unsigned long long len,
                                       const SegmentView* segments, DeviceError* err,
                                       unsigned long long op_seq, const char* op,
                                       bool after_failure_check = true,
                                       unsigned long long announced = 0,
                                       bool* unmapped = nullptr) {
  // (the fused kernel stops at a failed wait itself: no read of the host-side record there)
  if (after_failure_check && static_cast<volatile DeviceError*>(err)->code != 0) return nullptr;
  const Location loc = Location::decode(load_acquire(where));
  if (!loc.mapped) {
    if (unmapped) *unmapped = true;
    return staged;
  }
  const volatile SegmentView* v = segments + static_cast<size_t>(owner) * kSegmentSlots + loc.slot;
  const char* base = v->base;
  const unsigned long long have = v->gen;
  const unsigned long long at = loc.offset + offset;
  if (base == nullptr || (have & Location::kGenMask) != loc.gen || at + len > v->bytes) {
    record_error(err, kStopMemory, owner, op_seq, op, "a mapping of the memory of", loc.gen, have,
                 loc.slot, at + len, announced);
    return nullptr;
  }
  return base + at;
}

// Copy `bytes` with the whole block, in the widest unit both pointers allow.
template <typename U, int kUnrollCopy>
__device__ __forceinline__ void block_copy_units(char* dst, const char* src, size_t n_units) {
  const U* s = reinterpret_cast<const U*>(src);
  U* d = reinterpret_cast<U*>(dst);
  const size_t step = static_cast<size_t>(blockDim.x) * kUnrollCopy;
  size_t i = threadIdx.x;
  for (; i + (kUnrollCopy - 1) * blockDim.x < n_units; i += step) {
    U v[kUnrollCopy];
#pragma unroll
    for (int r = 0; r < kUnrollCopy; ++r) v[r] = s[i + r * blockDim.x];
#pragma unroll
    for (int r = 0; r < kUnrollCopy; ++r) d[i + r * blockDim.x] = v[r];
  }
  for (; i < n_units; i += blockDim.x) d[i] = s[i];
}

__device__ void block_copy(void* dst_v, const void* src_v, size_t bytes) {
  char* dst = static_cast<char*>(dst_v);
  const char* src = static_cast<const char*>(src_v);
  const uintptr_t mis = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  size_t done;
  if (mis % 16 == 0) {
    block_copy_units<uint4, 8>(dst, src, bytes / 16);
    done = bytes / 16 * 16;
  } else if (mis % 8 == 0) {
    block_copy_units<uint2, 8>(dst, src, bytes / 8);
    done = bytes / 8 * 8;
  } else if (mis % 4 == 0) {
    block_copy_units<uint32_t, 8>(dst, src, bytes / 4);
    done = bytes / 4 * 4;
  } else if (mis % 2 == 0) {
    block_copy_units<uint16_t, 8>(dst, src, bytes / 2);
    done = bytes / 2 * 2;
  } else {
    done = 0;
  }
  for (size_t i = done + threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
}

// [begin, end) of `units` units, part `part` of `parts`: whole multiples of `align` units.
__device__ __forceinline__ void slice_of(size_t units, size_t align, int part, int parts,
                                         size_t* begin, size_t* end) {
  const size_t per = ((units + align - 1) / align + parts - 1) / parts * align;
  *begin = min(units, per * part);
  *end = min(units, *begin + per);
}

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

template <typename T, typename A> __device__ __forceinline__ A to_acc(T v) { return static_cast<A>(v); }
template <> __device__ __forceinline__ float to_acc<__nv_bfloat16, float>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_acc<__half, float>(__half v) { return __half2float(v); }
template <typename T, typename A> __device__ __forceinline__ T from_acc(A v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16, float>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_acc<__half, float>(float v) { return __float2half_rn(v); }

}  // namespace

// Each kernel file's part of preload_kernels (kernels.cu).
cudaError_t preload_wait_kernels();
cudaError_t preload_fused_kernel();
void resolve_fused_launch(int device);
cudaError_t preload_accumulate_kernels();
cudaError_t preload_located_kernels();
cudaError_t preload_reduce_kernels(int device);

}  // namespace odc
