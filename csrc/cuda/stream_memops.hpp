// Layer 2, a transport: stream memory operations (cuStreamWaitValue64 / cuStreamWriteValue64),
// with which the CUDA transport's copy engines wait and signal without holding an SM.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "device_memory.hpp"

namespace odc {

class StreamMemops {
 public:
  // Looked up from the driver at run time (the extension links against the runtime only), and
  // tried once: a wait on this rank's window and a store of 0 into each mapped window
  // (`bases`, counters still zero). Absent where the driver lacks them or refuses either.
  static StreamMemops load(int device, int rank, const std::vector<char*>& bases,
                           const DeviceMemory& memory);
  explicit operator bool() const { return wait_ != nullptr; }
  void wait_geq(cudaStream_t s, const uint64_t* flag, uint64_t value) const;
  void write(cudaStream_t s, uint64_t* flag, uint64_t value) const;

 private:
  using WaitValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  using WriteValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  static StreamMemops look_up(int device);
  WaitValueFn wait_ = nullptr;
  WriteValueFn write_ = nullptr;
};

}  // namespace odc
