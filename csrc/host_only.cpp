// Layer 5, backend: device_work.hpp for a build without CUDA: every channel is the host's.
#include "device_work.hpp"

namespace odc {

std::unique_ptr<DeviceLaunch> begin_launch(Channel&, bool) { return host_launch(); }
RegisteredPool::StreamOrder stream_order(const c10::Device&) { return {}; }
void release_device(Channel&) {}

}  // namespace odc
