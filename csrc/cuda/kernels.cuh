// Layer 2, a transport's kernels: the device code of the CUDA transport (launchers
// callable from host code). Depends on the layout (../layout.hpp: element types, reductions).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../layout.hpp"

namespace odc {

constexpr int kMaxPeers = 64;

// Written by a device-side wait that timed out or found a peer's descriptor different
// from this rank's; read by the host (mapped memory).
struct DeviceError {
  int code;  // 0: none, else a StopCode (layout.hpp): 1 a wait timed out, 2 a descriptor
             // mismatch, 3 a peer announced another collective at this point (mine / theirs:
             // the announcements), 4 a peer named a segment not mapped here (mine / theirs: its
             // generation and ours; target: the slot), 5 a peer gave the collective up (theirs:
             // its word, layout.hpp kAnnounceStopped)
  int peer;
  unsigned long long op_seq;
  unsigned long long target;  // timeout: the counter value waited for, and the one seen;
  unsigned long long seen;    // mismatch: the chunk waited for, and the peer's
  unsigned long long mine;    // mismatch: this rank's descriptor, and the peer's
  unsigned long long theirs;
  const char* op;    // WaitSite strings are literals: their addresses stay valid
  const char* what;
  // Set when the transport is made: this rank's announcement slots in each peer's window
  // ([kAnnounceSlots] words each; peers NVSHMEM routes are left out). The first failure stores
  // the collective's announcement, marked given up, there (stopped_word).
  uint64_t* notify[kMaxPeers];
  int n_notify;
  // In device memory: claimed (atomically, 0 -> 1) by the first of the GPU's failing waits to
  // record, so that two failing at once (blocks of one lane, lanes of one kernel) never mix
  // their fields under one code. (The watchdog, on the host, writes only where no code is set
  // yet and cannot take the claim: a device-side record at the same moment could still mix
  // with its own; it is rare, as the watchdog acts only on waits past the timeout.)
  int* claim;
};

constexpr int kSignalBatches = 4;  // e.g. the announcement, descriptors, chunk numbers, the data counters

// What a device-side wait checks of each peer it waits for, alike in a flag kernel and a
// gate: that the peer's counter reaches `target` within the timeout and, with
// desc_expected != 0, that the descriptor stored with it equals desc_expected and its id
// desc_id (DescCheck); a timeout or a mismatch is recorded in `err`, naming op_seq, op, what.
struct WaitCheck {
  unsigned long long target;
  unsigned long long desc_expected;
  unsigned long long desc_id;
  unsigned long long timeout_ns;
  unsigned long long op_seq;
  const char* op;
  const char* what;
  DeviceError* err;
  const uint64_t* watch_slots;    // PeerWatch: this rank's announce slots (null: no watch)
  unsigned long long watch_word;  // and this rank's own announcement
};

// Store the payload batches (descriptors), then one fence, then the counter batches
// (announcing the work that precedes this kernel on its stream: Transport::signal's
// contract; counters of one FlagOp are not ordered among themselves). Then wait for every
// wait counter as `check` says; on a timeout or a mismatch return.
struct FlagOp {
  uint64_t* signal[kSignalBatches][kMaxPeers];
  const uint64_t* wait[kMaxPeers];
  const uint64_t* desc[kMaxPeers];  // parallel to wait
  int wait_peer[kMaxPeers];
  int n_signal[kSignalBatches];
  bool payload[kSignalBatches];  // Transport::store: before the fence and the counters
  int n_wait;
  unsigned long long signal_value[kSignalBatches];
  WaitCheck check;
};

// The gate of puts (Transport::put_after) on the copy engines: its threads wait for the peers'
// counters and check their descriptors as a flag kernel does (WaitCheck); only where every one succeeds
// does it store the target in each put's `go` word (which the put's signal copies to the
// peer) and set `cond`, the condition of the graph node that holds the puts' copies. A failed
// gate leaves the condition 0: the copies never run.
constexpr int kMaxGatePeers = 16;
struct GateOp {
  const uint64_t* flag[kMaxGatePeers];
  const uint64_t* desc[kMaxGatePeers];  // the peers' descriptors (null: unchecked)
  int peer[kMaxGatePeers];
  int n;
  WaitCheck check;
  uint64_t* go;                   // n words
  cudaGraphConditionalHandle cond;
};

// The gate of an operation's pushes to guessed places (guessed_puts.hpp): it waits for every
// peer's counter and checks its descriptor as a put's gate (GateOp); then, where all passed,
// for each push whose peer's word at where[i] equals guess[i], hits[i] = serial and cond[i] is
// set. A failed wait or check sets none.
struct GuessGateOp {
  const uint64_t* flag[kMaxGatePeers];
  const uint64_t* desc[kMaxGatePeers];
  int peer[kMaxGatePeers];
  const uint64_t* where[kMaxGatePeers];
  unsigned long long guess[kMaxGatePeers];
  cudaGraphConditionalHandle cond[kMaxGatePeers];
  int n;
  WaitCheck check;
  uint64_t* hits;
  unsigned long long serial;
  unsigned long long* tally;  // [0] += pushes it examined, [1] += those confirmed (stats)
};

// The signals of the puts behind one gate, in its conditional node after their copies: one
// fence (the copies completed before this kernel started), then done[i] = go[i].
struct PutSignalOp {
  uint64_t* done[kMaxGatePeers];
  const uint64_t* go;
  int n;
};

// A peer's allocator segment as this GPU reaches it (SegmentTable keeps one per peer and slot,
// in device memory the kernels read): its mapping here and its generation (0: none).
struct SegmentView {
  const char* base;
  unsigned long long gen;
  unsigned long long bytes;  // the segment's size: no read goes past it
};

// Located (../transport.hpp) on the device: after the wait for its owner's "ready", the owner's Location
// word at `where` says whether the source is the owner's segment (its mapping here, at the
// word's offset plus `offset`) or `staged` (resolve_located, device_common.cuh).
struct LocatedRef {
  const uint64_t* where;
  const char* staged;
  unsigned long long offset;
  int owner;
};

// A located copy on the copy-engine path: an SM kernel (a copy engine needs its source when
// the copy is enqueued): from `far` (a peer's memory, where its word says) to `local`; with
// `push` the other way (far: a peer's output, or nowhere where its word says "not mapped").
struct LocatedCopyOp {
  void* local;
  LocatedRef far;
  bool push;
  const uint64_t* hit;        // set: nothing to do where *hit == serial (GuessedPuts copied it)
  unsigned long long serial;
  unsigned long long bytes;
  const SegmentView* segments;  // [world][kSegmentSlots]
  DeviceError* err;
  unsigned long long op_seq;
  const char* op;
};

struct ReduceOpArgs {
  const void* src[kMaxPeers];
  // Located sources (ZeroCopyReads::reduce_located): where[j] set, src j is located (its owner is j,
  // src[j] its staged address, located_offset past the owner's word's offset); null: src[j].
  const uint64_t* where[kMaxPeers];
  const SegmentView* segments;
  unsigned long long located_offset;
  unsigned long long elem_size;  // (a located source's bytes: numel * elem_size)
  DeviceError* err;
  unsigned long long op_seq;
  const char* op;
  int n_src;
  void* dst;
  size_t numel;
  double scale;            // Sum of floats (in the accumulation type: fp32, or fp64 for float64)
  const float* scale_ptr;  // overrides `scale` when set (device pointer)
  bool vectorized;         // every pointer 16-byte aligned (located ones: checked again on the device)
};

// A collective as one kernel: each lane's blocks run that lane's steps in order with SM
// loads and stores, so the operation costs one launch (the copy-engine path costs a kernel
// or copy per step, events per lane). A lane's blocks all take part in its waits and split
// its copies and reductions; at a signal point after data the last of them to arrive (a
// counter in `arrivals`) stores the point's payloads and counters and becomes the lane's
// leader, which signals the points without data (fused_kernel.cu). (kStepAccumulate and
// kStepZero run on the copy-engine path only, never fused.) The located steps
// (ZeroCopyReads::copy_located, reduce_located, push_located): a copy's source is `located`
// with `owner` (and src, its staged address); a push's destination is `located` with `owner`
// (src its source, dst unused); a reduction has its n staged sources, then their n Location
// words (null: the source itself), in ptrs, and located.offset.
enum StepKind : uint8_t { kStepWait = 0, kStepSignal, kStepCopy, kStepReduce, kStepAccumulate, kStepZero,
                         kStepStore, kStepCopyLocated, kStepReduceLocated, kStepPushLocated };

// A wait's check (DescCheck): the descriptor each awaited peer stored (0: unchecked), at
// ptrs[first + n + i], with the id `id`.
struct FusedCheck {
  unsigned long long desc;
  unsigned long long id;
};
// A located step's source: a copy's owner's Location word (a reduction's are in ptrs), and the
// offset past each word's offset.
struct FusedLocated {
  const uint64_t* where;
  unsigned long long offset;
};

struct FusedStep {
  uint8_t kind;
  uint8_t dtype;             // reduce: DType
  uint16_t n;                // wait/signal/store: counters (words); reduce: sources
  uint16_t first;            // first entry of this step in FusedOp::ptrs / peers
  uint16_t owner;            // located copy: its source's owner (push: its destination's)
  float scale;               // reduce
  unsigned long long value;  // wait target, signal value, copy bytes or reduce numel
  union {
    FusedCheck check;        // wait
    FusedLocated located;    // located copy, push and reduction
  };
  void* dst;
  const void* src;
  const float* scale_ptr;    // reduce: tensor factor (device, fp32) or null
  const char* what;          // wait: what it waits for (error text)
};

constexpr int kFusedMaxLanes = 8;
constexpr int kFusedMaxSteps = 40;
constexpr int kFusedMaxPtrs = 96;
constexpr int kFusedThreads = 1024;
// Arrival counters per lane of one fused operation (at most one per signal point); a
// transport keeps one such array per ring (operations of a ring run one at a time).
constexpr int kFusedArrivalsPerOp = kFusedMaxLanes * kFusedMaxSteps;
// A lane gets a block per this many bytes of its largest copy or reduction (within the
// transport's fused_blocks per operation).
constexpr size_t kFusedBytesPerBlock = 64 << 10;
// More than this per block, and the operation takes the copy-engine path instead (where few
// blocks are left to a rank: many ranks on one GPU).
constexpr size_t kFusedMaxBytesPerBlock = 1 << 20;

struct FusedOp {
  FusedStep steps[kFusedMaxSteps];  // grouped by lane
  const void* ptrs[kFusedMaxPtrs];  // counters (wait/signal), descriptors, reduce sources
  short peers[kFusedMaxPtrs];       // wait: the peer each counter is about
  unsigned short lane_begin[kFusedMaxLanes + 1];   // the lane's steps
  unsigned short block_begin[kFusedMaxLanes + 1];  // the lane's blocks (the grid: block_begin[lanes])
  unsigned* arrivals;  // kFusedArrivalsPerOp zeroed counters, left zeroed (lanes of several blocks)
  const SegmentView* segments;  // the located steps' peers' segments
  int lanes;
  unsigned long long timeout_ns;
  unsigned long long op_seq;
  const char* op;
  DeviceError* err;
  const uint64_t* watch_slots;    // PeerWatch, as in FlagOp
  unsigned long long watch_word;
};
static_assert(sizeof(FusedOp) <= 4000, "kernel parameters are limited to 4 KiB");
static_assert(sizeof(FlagOp) <= 4000, "kernel parameters are limited to 4 KiB");

// device: the current device (its context runs the kernel)
cudaError_t launch_fused(const FusedOp& op, int device, cudaStream_t stream);
cudaError_t launch_flag_op(const FlagOp& op, cudaStream_t stream);
// A graph kernel node's parameters that run the gate kernel with args = {GateOp*} (both must
// live until the node is added or its parameters set: the argument is copied then).
cudaKernelNodeParams gate_node_params(void** args);
// The same for the signal kernel, args = {PutSignalOp*}, and a guessed push's gate, {GuessGateOp*}.
cudaKernelNodeParams put_signal_node_params(void** args);
cudaKernelNodeParams guess_gate_node_params(void** args);
// Load every kernel's module now. Under lazy loading (PyTorch's default) the
// first launch of a kernel may wait for the kernels already running, and a
// running flag kernel may be waiting for a peer that is itself stuck loading:
// a cross-rank deadlock. Loading up front removes it.
cudaError_t preload_kernels();
// dst = combine of the sources in rank order (ReduceSpec's semantics: layout.hpp). `bulk`:
// the floating-point Sum may stream its sources through the TMA engine (worth it where some
// are read across NVLink; reduce_kernels.cu).
cudaError_t launch_reduce(const ReduceOpArgs& args, DType dtype, Combine combine, int blocks,
                          bool bulk, cudaStream_t stream);
// The blocks launch_reduce runs a reduction of `numel` elements on, at most `blocks`.
int reduce_grid(size_t numel, int blocks);
// A located copy (or push) with located_grid(op.bytes, blocks) blocks (fewer for a small copy).
cudaError_t launch_located_copy(const LocatedCopyOp& op, int blocks, cudaStream_t stream);
int located_grid(size_t bytes, int blocks);
// dst[i] += src[i] with system-scope atomics (dst may be a peer's memory; other GPUs add
// into it concurrently); src in `dtype`, dst fp32.
cudaError_t launch_accumulate(float* dst, const void* src, size_t numel, DType dtype, int blocks,
                              cudaStream_t stream);

}  // namespace odc
