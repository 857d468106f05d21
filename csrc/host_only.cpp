// Layer 5, backend: device_work.hpp and cuda_setup.hpp for a build without CUDA: every channel
// is the host's (the channel refuses CUDA tensors before it would reach the CUDA functions).
#include <stdexcept>

#include "cuda_setup.hpp"
#include "device_work.hpp"

namespace odc {

std::unique_ptr<DeviceLaunch> begin_launch(Channel&, bool) { return host_launch(); }
void* current_stream(const c10::Device&, const char*) { return nullptr; }
bool stream_is_capturing(const c10::Device&) { return false; }
RegisteredPool::StreamOrder stream_order(const c10::Device&) { return {}; }
void release_device(Channel&) {}
void* take_side_stream(const c10::Device&) { return nullptr; }
void give_side_stream(const c10::Device&, void*) {}

namespace {
[[noreturn]] void no_cuda() { throw std::logic_error("odc: this build has no CUDA support"); }
}  // namespace

std::unique_ptr<Transport> make_cuda_transport(const TransportArgs&, const CudaTransportOptions&) { no_cuda(); }
std::vector<uint8_t> gpu_uuid(int) { no_cuda(); }
void* take_async_stream(int) { no_cuda(); }
void give_async_stream(int, void*) { no_cuda(); }

}  // namespace odc
