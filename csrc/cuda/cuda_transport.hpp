// Layer 2, a transport: the CUDA transport (GPUs), made by cuda_setup.cpp (../cuda_setup.hpp:
// CudaTransportOptions). A short coordinator of parts that each own their state:
//  * where its windows and arenas live (device_memory.hpp: CUDA IPC, or a piece of NVSHMEM's
//    symmetric heap mapped peer-to-peer with ODC_TRANSPORT=nvshmem);
//  * the record of the operation being issued (steps.hpp): the protocol's calls between
//    begin_op and end_op, run at end_op by one of two engines:
//  * the fused engine (fused_engine.hpp): operations whose copies and reductions are all small
//    run as one kernel, each lane on blocks of its own;
//  * the copy engines (copy_engines.hpp): larger ones, each lane on a stream of its own, data by
//    cudaMemcpyAsync, waits and signals as stream memory operations or flag kernels, puts as
//    CUDA graphs (put_graphs.hpp);
//  * the watchdog (watchdog.hpp): a host thread, never in the data path, that times out the
//    stream waits, which cannot time out by themselves;
//  * the error record (error_record.hpp) the device-side waits write a failure into;
//  * the order between operations of a ring (ring_order.hpp);
//  * with direct collectives (ODC_ZERO_COPY), the peers' allocator segments mapped here
//    (segment_table.hpp).
// Everything is ordered on streams: the CPU only enqueues.
#pragma once

#include <memory>
#include <vector>

#include "../cuda_setup.hpp"
#include "copy_engines.hpp"
#include "device_memory.hpp"
#include "error_record.hpp"
#include "fused_engine.hpp"
#include "ring_order.hpp"
#include "segment_table.hpp"
#include "steps.hpp"
#include "watchdog.hpp"

namespace odc {

class CudaTransport final : public Transport, public ZeroCopyReads, public Arenas {
 public:
  // memory: CUDA IPC (make_ipc_memory) or NVSHMEM's heap, where the windows and arenas live.
  CudaTransport(const TransportArgs& args, const CudaTransportOptions& options,
                std::unique_ptr<DeviceMemory> memory);
  ~CudaTransport() override;

  // ---- Transport: recorded, run at end_op
  char* window(int rank, Part part = kCounters) override {
    return part == kRings ? rings_[rank] : bases_[rank];
  }
  void wait(int lane, const std::vector<const uint64_t*>& flags, const std::vector<int>& peers,
            uint64_t target, const WaitSite& site, const DescCheck* check) override {
    recording_.wait(lane, flags, peers, target, site, check);
  }
  void signal(int lane, const std::vector<uint64_t*>& flags, uint64_t value) override {
    recording_.signal(lane, flags, value);
  }
  void store(int lane, const std::vector<uint64_t*>& words, uint64_t value) override {
    recording_.store(lane, words, value);
  }
  void copy(int lane, void* dst, const void* src, size_t bytes) override {
    recording_.copy(lane, dst, src, bytes);
  }
  void put_after(int lane, const uint64_t* flag, int peer, uint64_t target, const WaitSite& site,
                 const DescCheck* check, void* dst, const void* src, size_t bytes,
                 uint64_t* done) override;
  void reduce(int lane, void* dst, const std::vector<const void*>& srcs, size_t numel,
              const ReduceSpec& spec) override {
    recording_.reduce(lane, dst, srcs, numel, spec);
  }
  void begin_op(void* stream, Ring ring, Ring also) override;
  void end_op() override;
  std::shared_ptr<void> completion(void* stream, bool after_last_op) override;
  EngineUse last_engine() const override { return op_.use; }
  std::string async_error() override { return errors_->text(a_.rank, a_.timeout()); }

  // ---- ZeroCopyReads (offered with ODC_ZERO_COPY)
  uint64_t locate(const void* p, size_t bytes) override;
  void copy_located(int lane, void* dst, const Located& src, size_t bytes) override {
    recording_.copy_located(lane, dst, src, bytes);
  }
  void push_located(int lane, const Located& dst, const void* src, size_t bytes,
                    uint64_t guess) override;
  void publish_output(uint64_t number, uint64_t word) override;
  uint64_t published_output(int peer, uint64_t number) override;
  std::pair<uint64_t, uint64_t> guessed_pushes() override;
  void reduce_located(int lane, void* dst, const std::vector<Located>& srcs, size_t numel,
                      const ReduceSpec& spec) override {
    recording_.reduce_located(lane, dst, srcs, numel, spec);
  }

  // ---- Arenas
  int create_arena(size_t bytes) override;
  bool release_arena(int id) override;
  char* arena(int id, int rank) override { return arenas_.at(id).at(rank); }
  void accumulate(int lane, float* dst, const void* src, size_t numel, DType dtype) override {
    recording_.accumulate(lane, dst, src, numel, dtype);
  }
  void fill_zero(int lane, void* dst, size_t bytes) override {
    recording_.fill_zero(lane, dst, bytes);
  }
  bool accumulates_everywhere() const override { return !memory_->any_routed(); }
  bool maps_every_peer() const override { return !memory_->any_routed(); }

 private:
  struct CurrentOp {  // the operation begun last
    cudaStream_t stream = nullptr;
    Ring ring = Ring::kAllGather;
    Ring also = Ring::kNone;
    EngineUse use;  // what ran it
  };

  TransportArgs a_;
  int device_;
  std::unique_ptr<DeviceMemory> memory_;
  std::vector<char*> bases_;                // every rank's window: its counters
  // Every rank's rings (the window's bytes from layout.ag_ring on), apart from its counters:
  // given back with the last arena (release_arena: a trainer that offloads the model then
  // holds little on the GPU) and taken again at the group's next operation or arena, points
  // every rank reaches alike (no arena is left whose operations ranks issue unalike).
  std::vector<char*> rings_;
  int rings_made_ = 0;
  void take_rings();  // collective, where rings_ is empty
  std::vector<std::vector<char*>> arenas_;  // per arena: every rank's base
  std::unique_ptr<SegmentTable> segments_;  // direct collectives: the segments ranks share
  std::unique_ptr<DeviceErrorRecord> errors_;
  StepRecording recording_;
  std::unique_ptr<FusedEngine> fused_;
  std::unique_ptr<CopyEngines> copy_engines_;
  std::unique_ptr<Watchdog> watchdog_;      // where the copy engines wait with stream memops
  RingOrder order_;
  CurrentOp op_;
};

}  // namespace odc
