// Layer 2, a transport: the CUDA transport's error record (cuda_transport.hpp): where a wait on
// the GPU, or the watchdog, records the failure that breaks the group, and its text.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "device_memory.hpp"
#include "kernels.cuh"

namespace odc {

class DeviceErrorRecord {
 public:
  // In mapped host memory; a failure is also told to the peers through this rank's announcement
  // slot in each window of `bases` that this GPU maps (DeviceError::notify).
  DeviceErrorRecord(const TransportArgs& a, const std::vector<char*>& bases,
                    const DeviceMemory& memory);
  ~DeviceErrorRecord();
  DeviceErrorRecord(const DeviceErrorRecord&) = delete;
  DeviceErrorRecord& operator=(const DeviceErrorRecord&) = delete;

  DeviceError* on_device() const { return dev_; }
  volatile DeviceError* on_host() const { return host_; }
  // The recorded failure as the group's error ("": none).
  std::string text(int rank, std::chrono::milliseconds timeout) const;

 private:
  DeviceError* host_ = nullptr;
  DeviceError* dev_ = nullptr;
  int* claim_ = nullptr;  // DeviceError::claim
};

}  // namespace odc
