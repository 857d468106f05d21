// Layer 2, a transport: the CUDA transport's copy engines (cuda_transport.hpp): each lane on a
// stream of its own, forked from the operation's stream and joined back; waits and signals as
// small kernels or stream memory operations, copies as cudaMemcpyAsync, reductions as kernels.
#include "cuda_transport.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace odc {

// ---- The copy-engine engine: each lane on its own stream, forked from and joined
// back to the operation's stream.

// Each run of puts with its graph, made before anything is enqueued.
std::vector<CudaTransport::PutRun> CudaTransport::prepare_put_runs() {
  std::vector<PutRun> puts;
  for (size_t i = 0; i < steps_.size(); ++i) {
    if (!steps_[i].guarded) continue;
    if (puts.empty()) retire_puts();
    size_t end = i;
    while (end < steps_.size() && steps_[end].guarded) ++end;
    puts.push_back(prepare_puts(i, end));
    i = end - 1;
  }
  return puts;
}

// Data on one lane only (a zero-copy all-gather of 2 ranks, any zero-copy reduce-scatter):
// nothing to overlap, so every lane runs on the operation's stream in issue order (which
// is deadlock-free, see issue_step). Fewer launches and no fork or join; waits and signals
// of one point share a flag kernel. Returns whether it merged the lanes.
bool CudaTransport::merge_lanes_if_one_carries_data() {
  int data_lane = -1;
  bool one_data_lane = !memory_->any_routed();
  for (const Step& s : steps_) {
    if (s.kind == kStepWait || s.kind == kStepSignal || s.kind == kStepStore) continue;
    if (data_lane >= 0 && s.lane != data_lane) one_data_lane = false;
    data_lane = s.lane;
  }
  if (one_data_lane) {
    for (Step& s : steps_) s.lane = 0;
  }
  return one_data_lane;
}

void CudaTransport::run_on_copy_engines() {
  std::vector<PutRun> puts = prepare_put_runs();
  size_t next_puts = 0;
  const bool one_lane = merge_lanes_if_one_carries_data();
  cur_ = &lanes_for(op_stream_);
  cudaEvent_t start = nullptr;
  if (wait_value_) {
    start = events_->take();
    check(cudaEventRecord(start, op_stream_), "recording an event");
    op_waits_.clear();
  }
  if (!one_lane) check(cudaEventRecord(cur_->fork, op_stream_), "recording the fork event");
  std::fill(lane_used_.begin(), lane_used_.end(), false);
  flagged_.assign(a_.world, false);
  ce_reduce_blocks_ = 0;
  std::vector<uint64_t*> sigs;  // scratch, reused from step to step
  std::vector<const void*> srcs;
  for (size_t i = 0; i < steps_.size(); ++i) {
    if (steps_[i].guarded) {  // a run of puts: one graph on the op stream
      size_t end = i;
      while (end < steps_.size() && steps_[end].guarded) ++end;
      issue_puts(puts[next_puts++]);
      i = end - 1;
      continue;
    }
    issue_step(steps_[i], sigs, srcs);
  }
  for (int lane = 0; lane < a_.world; ++lane) flush_signals(lane);
  // The SMs it may hold at once: its largest reduction, and a flag kernel per lane that ran one.
  last_use_ = EngineUse{EngineUse::kCopyEngine,
                        ce_reduce_blocks_ + static_cast<int>(std::count(flagged_.begin(), flagged_.end(), true))};
  for (int lane = 1; lane < a_.world; ++lane) {
    if (!lane_used_[lane]) continue;
    check(cudaEventRecord(cur_->join[lane - 1], cur_->side[lane - 1]), "recording a join event");
    check(cudaStreamWaitEvent(op_stream_, cur_->join[lane - 1], 0), "joining a lane");
  }
  if (wait_value_) track_for_watchdog(start);
}

// One recorded step on its lane's stream (sigs, srcs: scratch).
void CudaTransport::issue_step(const Step& s, std::vector<uint64_t*>& sigs,
                                  std::vector<const void*>& srcs) {
  switch (s.kind) {
    case kStepWait:
      // Signals issued on other lanes before this wait go out first. Streams may share a
      // hardware queue (few connections per process, fewer under MPS), and a queue runs
      // in order: a signal held back behind this wait could then wait for it, and two
      // ranks would wait for each other. Issue order itself is deadlock-free (the
      // protocol's chunk-major order), so keeping every queue in issue order is too.
      for (int lane = 0; lane < a_.world; ++lane) {
        if (lane != s.lane) flush_signals(lane);
      }
      launch_flags(s.lane, &s);
      break;
    case kStepSignal:
    case kStepStore:
      sigs.clear();
      for (int i = 0; i < s.n; ++i) {
        sigs.push_back(static_cast<uint64_t*>(const_cast<void*>(ptrs_[s.first + i])));
      }
      issue_signal(s.lane, sigs, s.value, /*payload=*/s.kind == kStepStore);
      break;
    case kStepCopy:
      issue_copy(s.lane, s.dst, s.src, s.value);
      break;
    case kStepReduce:
      srcs.assign(ptrs_.begin() + s.first, ptrs_.begin() + s.first + s.n);
      issue_reduce(s.lane, s.dst, srcs, s.value, s.spec);
      break;
    case kStepReduceLocated:  // the words follow the sources in ptrs_
      srcs.assign(ptrs_.begin() + s.first, ptrs_.begin() + s.first + s.n);
      issue_reduce(s.lane, s.dst, srcs, s.value, s.spec, &ptrs_[s.first + s.n], s.desc_id, &s.site);
      break;
    case kStepCopyLocated:
      issue_copy_located(s);
      break;
    case kStepAccumulate:  // never to a routed peer: refused when the arena is created
      issue_prepare(s.lane);
      check(launch_accumulate(static_cast<float*>(s.dst), s.src, s.value, s.spec.dtype,
                              accumulate_blocks_, lane_stream(s.lane)),
            "launching the accumulation");
      break;
    case kStepZero:
      issue_prepare(s.lane);
      check(cudaMemsetAsync(s.dst, 0, s.value, lane_stream(s.lane)), "cudaMemsetAsync");
      break;
  }
}

// The watchdog watches the operation's device-side waits from `start` to its end.
void CudaTransport::track_for_watchdog(cudaEvent_t start) {
  Tracked t;
  t.start = start;
  t.end = events_->take();
  check(cudaEventRecord(t.end, op_stream_), "recording an event");
  t.waits = std::move(op_waits_);
  t.watch = watch_;
  op_waits_ = {};
  std::lock_guard<std::mutex> lk(wd_mu_);
  tracked_.push_back(std::move(t));
}

cudaStream_t CudaTransport::lane_stream(int lane) const {
  return lane == 0 ? op_stream_ : cur_->side[lane - 1];
}

void CudaTransport::launch_flags(int lane, const Step* wait) {
  fork_lane(lane);
  if (wait && wait_value_) {  // stream memory operations: no kernel, no SM (signals went out at once)
    const CUstream s = reinterpret_cast<CUstream>(lane_stream(lane));
    for (int i = 0; i < wait->n; ++i) {
      const auto* flag = static_cast<const uint64_t*>(ptrs_[wait->first + i]);
      if (wait_value_(s, reinterpret_cast<CUdeviceptr>(flag), wait->value,
                      CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS) {
        throw std::runtime_error("odc: cuStreamWaitValue64 failed");
      }
      op_waits_.push_back(WaitRec{flag, wait->value, peers_[wait->first + i], wait->site});
    }
    if (!wait->desc) return;
    // The descriptors are checked by a flag kernel behind those waits (met by then).
  }
  FlagOp op{};
  PendingSignals& p = pending_[lane];
  for (int b = 0; b < p.batches; ++b) {
    op.n_signal[b] = static_cast<int>(p.flags[b].size());
    std::copy(p.flags[b].begin(), p.flags[b].end(), op.signal[b]);
    op.signal_value[b] = p.value[b];
    op.payload[b] = p.payload[b];
  }
  if (wait) {
    op.n_wait = wait->n;
    for (int i = 0; i < wait->n; ++i) {
      op.wait[i] = static_cast<const uint64_t*>(ptrs_[wait->first + i]);
      op.wait_peer[i] = peers_[wait->first + i];
      if (wait->desc) op.desc[i] = static_cast<const uint64_t*>(ptrs_[wait->first + wait->n + i]);
    }
    op.check = wait_check(*wait);
  }
  check(launch_flag_op(op, lane_stream(lane)), "launching a flag kernel");
  flagged_[lane] = true;
  p = PendingSignals{};
}


void CudaTransport::issue_prepare(int lane) {
  flush_signals(lane);
  fork_lane(lane);
}

// A side lane's first step of an operation waits for everything before the operation.
void CudaTransport::fork_lane(int lane) {
  if (lane > 0 && !lane_used_[lane]) {
    check(cudaStreamWaitEvent(lane_stream(lane), cur_->fork, 0), "forking a lane");
    lane_used_[lane] = true;
  }
}

void CudaTransport::issue_copy(int lane, void* dst, const void* src, size_t bytes) {
  issue_prepare(lane);
  if (memory_->routed(dst) || memory_->routed(src)) {
    memory_->copy_routed(static_cast<int>(ring_) * a_.world + lane, dst, src, bytes,
                         lane_stream(lane));
    return;
  }
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, lane_stream(lane)),
        "cudaMemcpyAsync");
}

void CudaTransport::issue_reduce(int lane, void* dst, const std::vector<const void*>& srcs,
                                    size_t numel, const ReduceSpec& spec,
                                    const void* const* where, uint64_t located_offset,
                                    const WaitSite* site) {
  issue_prepare(lane);
  ReduceOpArgs r{};
  r.n_src = static_cast<int>(srcs.size());
  bool aligned = reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  for (int i = 0; i < r.n_src; ++i) {
    r.src[i] = srcs[i];
    aligned = aligned && reinterpret_cast<uintptr_t>(srcs[i]) % 16 == 0;
  }
  if (where) {  // located sources: their words decide on the device (kernels.cuh)
    for (int i = 0; i < r.n_src; ++i) r.where[i] = static_cast<const uint64_t*>(where[i]);
    r.segments = segments_->views();
    r.located_offset = located_offset;
    r.elem_size = dtype_size(spec.dtype);
    r.err = err_dev_;
    r.op_seq = site->op_seq;
    r.op = site->op;
    aligned = aligned && located_offset % 16 == 0;
  }
  r.dst = dst;
  r.numel = numel;
  // fp32 scale for the fp32-accumulated types (as ever), fp64 for float64
  r.scale = spec.dtype == DType::F64 ? spec.scale : static_cast<float>(spec.scale);
  r.scale_ptr = spec.scale_ptr;
  r.vectorized = aligned;
  // Bulk copies where sources lie across NVLink: there a block's loads are latency-bound
  // (about 51 against 73 GB/s per block, H100); from this GPU's memory the register kernel is
  // as fast or faster (kernels.cu).
  const bool bulk = spec.reads_peers && peers_on_other_gpus_;
  ce_reduce_blocks_ = std::max(ce_reduce_blocks_, reduce_grid(numel, reduce_blocks_));
  check(launch_reduce(r, spec.dtype, spec.combine, reduce_blocks_, bulk, lane_stream(lane)),
        "launching the reduction");
}

// A located copy: an SM kernel of ODC_REDUCE_BLOCKS blocks at most (its source is known only
// on the device, after the owner's "ready").
void CudaTransport::issue_copy_located(const Step& s) {
  issue_prepare(s.lane);
  LocatedCopyOp op{};
  op.dst = s.dst;
  op.src = LocatedSrc{reinterpret_cast<const uint64_t*>(s.desc), static_cast<const char*>(s.src),
                      s.desc_id, s.n};
  op.bytes = s.value;
  op.segments = segments_->views();
  op.err = err_dev_;
  op.op_seq = s.site.op_seq;
  op.op = s.site.op;
  ce_reduce_blocks_ = std::max(ce_reduce_blocks_, reduce_blocks_);
  check(launch_located_copy(op, reduce_blocks_, lane_stream(s.lane)), "launching a located copy");
}

}  // namespace odc
