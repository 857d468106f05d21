// Layer 2, a transport: the CUDA transport (GPUs). Made by cuda_setup.cpp
// (../cuda_setup.hpp: CudaTransportOptions). Depends on the transport interface (../transport.hpp), where its
// memory lives (device_memory.hpp: CUDA IPC or NVSHMEM) and its kernels (kernels.cuh).
//
// The CUDA transport: GPUs of one host. Each window is a cudaMalloc'd buffer
// opened by every peer through CUDA IPC (or, with ODC_TRANSPORT=nvshmem, a piece of
// NVSHMEM's symmetric heap mapped peer-to-peer: see DeviceMemory). The steps of one
// operation are recorded between begin_op and end_op, then run by one of two engines:
//  * copy engines (large operations): data moves by cudaMemcpyAsync (no SMs), one
//    stream per peer lane; counters are waited on and signalled with stream memory
//    operations (cuStreamWaitValue64 / cuStreamWriteValue64: no SM is held while a
//    lane waits), or by one-warp kernels where the device lacks them; the owner's
//    reduction is a kernel with a bounded number of blocks;
//    writes into a peer's memory that only a successful wait may let through (put_after:
//    a pushed all-gather) run as a CUDA graph whose copies sit in a conditional node;
//  * one fused kernel (operations whose copies and reductions are all <= small_op_bytes):
//    each lane's blocks run that lane's steps with SM loads and stores (kernels.cuh,
//    FusedOp), so the collective costs one launch instead of a dozen.
// Everything is ordered on streams: the CPU only enqueues. A stream wait cannot time
// out by itself, so a watchdog thread (never in the data path) watches the operations
// that use them: one that has run longer than the group's timeout is diagnosed from
// the counters, recorded as the group's error, and its waits are released.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "../cuda_setup.hpp"
#include "../rendezvous.hpp"
#include "device_memory.hpp"
#include "kernels.cuh"
#include "segment_table.hpp"

namespace odc {

// Events reused rather than created and destroyed per operation (each a driver call). Shared
// by the transport and the events it hands out, which may outlive it (a Work's completion).
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  ~EventPool();
  cudaEvent_t take();  // on the current device
  void give(cudaEvent_t ev);
  // `ev`, given back to the pool when its last holder drops it
  std::shared_ptr<void> share(cudaEvent_t ev);

 private:
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

class CudaTransport final : public Transport {
 public:
  // memory: CUDA IPC (make_ipc_memory) or NVSHMEM's heap, where the windows and arenas live.
  CudaTransport(const TransportArgs& args, const CudaTransportOptions& options,
                std::unique_ptr<DeviceMemory> memory);
  ~CudaTransport() override;

  char* window(int rank) override { return bases_[rank]; }
  void wait(int lane, const std::vector<const uint64_t*>& flags, const std::vector<int>& peers,
            uint64_t target, const WaitSite& site, const DescCheck* check) override;
  void signal(int lane, const std::vector<uint64_t*>& flags, uint64_t value) override;
  void store(int lane, const std::vector<uint64_t*>& words, uint64_t value) override;
  void copy(int lane, void* dst, const void* src, size_t bytes) override;
  void put_after(int lane, const uint64_t* flag, int peer, uint64_t target, const WaitSite& site,
                 const DescCheck* check, void* dst, const void* src, size_t bytes,
                 uint64_t* done) override;
  void reduce(int lane, void* dst, const std::vector<const void*>& srcs, size_t numel,
              const ReduceSpec& spec) override;
  bool reads_in_place() const override { return segments_ != nullptr; }
  uint64_t locate(const void* p, size_t bytes) override;
  void copy_located(int lane, void* dst, const Located& src, size_t bytes) override;
  void reduce_located(int lane, void* dst, const std::vector<Located>& srcs, size_t numel,
                      const ReduceSpec& spec) override;
  void begin_op(void* stream, Ring ring) override;
  void also_on(Ring ring) override { also_ = ring; }
  int create_arena(size_t bytes) override;
  char* arena(int id, int rank) override { return arenas_.at(id).at(rank); }
  void accumulate(int lane, float* dst, const void* src, size_t numel, DType dtype) override;
  void fill_zero(int lane, void* dst, size_t bytes) override;
  bool accumulates_everywhere() const override { return !memory_->any_routed(); }
  bool maps_every_peer() const override { return !memory_->any_routed(); }
  void end_op() override;
  std::shared_ptr<void> completion(void* stream, bool after_last_op) override;
  EngineUse last_engine() const override { return last_use_; }
  std::string async_error() override;

 private:
  // One recorded step; counters / reduce sources live in ptrs_ / peers_ [first, first + n),
  // a checked wait's descriptors after them, in [first + n, first + 2n).
  struct Step {
    StepKind kind;
    int lane;
    int first, n;
    uint64_t value;  // wait target, signal value, copy bytes, reduce numel
    uint64_t desc;   // wait: the descriptor the peers must have stored (0: unchecked)
    uint64_t desc_id;  // wait: and the id stored with it (DescCheck::id)
    void* dst;
    const void* src;
    ReduceSpec spec;
    WaitSite site;
    bool guarded = false;  // a step of a put_after: runs only if its wait succeeded
  };
  // ---- stream memory operations and their watchdog
  using WaitValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  using WriteValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  struct WaitRec {
    const uint64_t* flag;
    uint64_t target;
    int peer;
    WaitSite site;
  };
  struct Tracked {  // one copy-engine operation that used stream waits
    cudaEvent_t start, end;
    std::vector<WaitRec> waits;
    bool started = false;
    std::chrono::steady_clock::time_point started_at;
    PeerWatch watch;  // the announcements its waits watch (announced_other)
  };
  // How long a started operation waits before the watchdog reads the announcements.
  static constexpr std::chrono::milliseconds kWatchAfter{100};
  bool announced_other(const Tracked& op);
  void load_memops();
  void watchdog_loop();
  bool diagnose_and_release(const Tracked& op);  // caller holds wd_mu_
  void tell_peers_given_up(const PeerWatch& watch, int code);


  // ---- Puts on the copy engines (put_after; puts.cpp): a CUDA graph per set of puts, made at its
  // first use and kept (FSDP's buffers recur every step): a gate kernel waits for every
  // peer's counter and checks its descriptor, then a conditional node, which runs only when
  // the gate set its condition, holds the copies and the signals (each a copy of the gate's
  // `go` word to the peer's counter), one after another on the operation's stream. Measured
  // on 4 GPUs: one gate per operation beat one per put (64 MiB: 180-184 against 210-213 us),
  // and writes one after another beat a stream per peer (performance.md).
  struct PutGraph {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    std::vector<cudaGraphNode_t> gates;
    std::vector<cudaGraphConditionalHandle> conds;
    uint64_t* go = nullptr;  // one word per put
    cudaEvent_t last = nullptr;  // recorded after its last launch
  };
  struct PutSet {  // the puts behind one gate (all of an operation's, up to kMaxGatePeers)
    std::vector<const Step*> waits, copies, signals;  // copies[k] null: nothing to copy
  };
  struct PutRun {  // a run of guarded steps of the operation being issued
    std::vector<PutSet> sets;
    PutGraph* graph;  // stays in put_graphs_ until the next operation's retire_puts
  };
  PutRun prepare_puts(size_t first, size_t end);  // steps_[first, end)
  void issue_puts(const PutRun& run);
  std::vector<PutSet> put_sets(size_t first, size_t end) const;
  PutGraph& put_graph(const std::vector<PutSet>& sets, const std::vector<uintptr_t>& key);
  void build_puts(const std::vector<PutSet>& sets, PutGraph& g);
  void retire_puts();
  static void destroy(PutGraph& g);
  // What a device-side wait for the step `w` checks: its target and descriptor, the group's
  // timeout (read now: a changed timeout reaches later launches), error record and watch.
  WaitCheck wait_check(const Step& w) const;
  GateOp gate_of(const std::vector<const Step*>& waits, uint64_t* go,
                 cudaGraphConditionalHandle cond) const;
  std::map<std::vector<uintptr_t>, PutGraph> put_graphs_;
  std::vector<PutGraph> retired_puts_;  // dropped from the map, destroyed once idle

  bool fusable();            // and plans the blocks (fused_plan_)
  bool plan_fused_blocks();
  void run_fused();
  void run_on_copy_engines();
  std::vector<PutRun> prepare_put_runs();
  bool merge_lanes_if_one_carries_data();
  void issue_step(const Step& s, std::vector<uint64_t*>& sigs, std::vector<const void*>& srcs);
  void track_for_watchdog(cudaEvent_t start);

  cudaStream_t lane_stream(int lane) const;
  void flush_signals(int lane);
  // payload: a Transport::store (stored before the counters' fence)
  void issue_signal(int lane, const std::vector<uint64_t*>& flags, uint64_t value, bool payload);
  void issue_direct_signal(int lane, const std::vector<uint64_t*>& flags, uint64_t value,
                           bool payload);
  void issue_prepare(int lane);
  void fork_lane(int lane);
  void issue_copy(int lane, void* dst, const void* src, size_t bytes);
  void issue_reduce(int lane, void* dst, const std::vector<const void*>& srcs, size_t numel,
                    const ReduceSpec& spec, const void* const* where = nullptr,
                    uint64_t located_offset = 0, const WaitSite* site = nullptr);
  void issue_copy_located(const Step& s);
  // A flag kernel on the lane: its pending signals, then (if any) the waits of `wait`.
  void launch_flags(int lane, const Step* wait);

  // Side lanes belong to the stream an operation runs on, so collectives issued
  // on different user streams (FSDP's all-gather and reduce-scatter streams) never
  // queue behind each other.
  struct Lanes {
    std::vector<cudaStream_t> side;        // lane i>0 runs on side[i-1]
    std::vector<cudaEvent_t> join;
    cudaEvent_t fork = nullptr;
  };
  Lanes& lanes_for(cudaStream_t stream);

  TransportArgs a_;
  int device_;
  std::unique_ptr<DeviceMemory> memory_;
  int reduce_blocks_;
  bool peers_on_other_gpus_;
  int accumulate_blocks_;  // blocks of each peer's put-accumulate kernel (decoupled mode)
  size_t small_op_bytes_;
  // Most blocks of one fused kernel: ODC_FUSED_BLOCKS, within this rank's share of the GPU's
  // SMs for two collectives at once (a 1024-thread block fills an SM; the ranks' kernels wait
  // on each other, so their blocks should be resident together).
  int fused_blocks_;
  std::vector<int> fused_plan_;  // blocks per lane of the fused op being issued
  unsigned* arrivals_ = nullptr;  // kFusedArrivalsPerOp counters per ring (FusedOp::arrivals)
  std::vector<Step> steps_;
  std::vector<const void*> ptrs_;
  std::vector<int> peers_;
  std::vector<char*> bases_;
  std::list<std::pair<cudaStream_t, Lanes>> lanes_;  // a list: cur_ must stay valid
  cudaStream_t op_stream_ = nullptr;
  Ring ring_ = kAgRing;
  Ring also_ = kNumRings;  // also_on's ring (kNumRings: none)
  std::shared_ptr<EventPool> events_ = std::make_shared<EventPool>();
  cudaStream_t ring_stream_[kNumRings] = {};    // the stream of each ring's last op
  std::shared_ptr<void> ring_done_[kNumRings];  // recorded at the end of that op
  std::shared_ptr<void> last_done_;             // the last op's, if begin_op came before it
  EngineUse last_use_;
  int ce_reduce_blocks_ = 0;   // the copy-engine op being issued: its largest reduction's grid,
  std::vector<bool> flagged_;  // and the lanes that ran a flag kernel
  std::vector<std::vector<char*>> arenas_;    // per arena (decoupled mode, registered
                                              // memory): every rank's base
  std::vector<size_t> arena_bytes_;
  Lanes* cur_ = nullptr;
  std::vector<bool> lane_used_;
  // Signals issued on a lane are folded into that lane's next wait kernel (unless a wait on
  // another lane comes first: then they go out on their own kernel before it): up to
  // kSignalBatches batches of words, each with its value; the payload batches are stored
  // first, then one fence, then the counters (FlagOp).
  struct PendingSignals {
    std::vector<uint64_t*> flags[kSignalBatches];
    uint64_t value[kSignalBatches] = {};
    bool payload[kSignalBatches] = {};
    int batches = 0;
  };
  std::vector<PendingSignals> pending_;
  WaitValueFn wait_value_ = nullptr;
  WriteValueFn write_value_ = nullptr;
  std::vector<WaitRec> op_waits_;  // waits of the operation being issued
  std::mutex wd_mu_;
  std::condition_variable wd_cv_;
  std::deque<Tracked> tracked_;
  bool wd_stop_ = false;
  std::thread watchdog_;
  cudaStream_t wd_stream_ = nullptr;
  DeviceError* err_host_ = nullptr;
  DeviceError* err_dev_ = nullptr;
  // Direct collectives (ODC_ZERO_COPY): the segments this rank and its peers share.
  std::unique_ptr<SegmentTable> segments_;
};

}  // namespace odc
