// Layer 2, a transport: what the CUDA transport's engines (fused_engine.hpp, copy_engines.hpp,
// put_graphs.hpp) read of the transport while they run one recorded operation.
#pragma once

#include <cuda_runtime.h>

#include "device_memory.hpp"
#include "kernels.cuh"
#include "steps.hpp"

namespace odc {

struct OpEnv {
  const TransportArgs& args;
  DeviceMemory& memory;
  DeviceError* err;             // the error record, as the GPU writes it
  const SegmentView* segments;  // the peers' segments (null without direct collectives)
  PeerWatch watch;              // the announcements its waits watch
  cudaStream_t stream;          // the operation's
  Ring ring;
  int device;
};

// What a device-side wait for `w` checks: its target and descriptor, the group's timeout (read
// now: a changed timeout reaches later launches), the error record and the watch.
inline WaitCheck wait_check(const WaitStep& w, const OpEnv& env) {
  WaitCheck c{};
  c.target = w.target;
  c.desc_expected = w.checked ? w.desc : 0;
  c.desc_id = w.desc_id;
  c.timeout_ns = static_cast<unsigned long long>(env.args.timeout().count()) * 1000000ull;
  c.op_seq = w.site.op_seq;
  c.op = w.site.op;
  c.what = w.site.what;
  c.err = env.err;
  c.watch_slots = env.watch.slots;
  c.watch_word = env.watch.word;
  return c;
}

}  // namespace odc
