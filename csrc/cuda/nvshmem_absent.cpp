// Layer 2, a transport's memory: a CUDA build without NVSHMEM (ODC_WITH_NVSHMEM unset) links
// this in place of nvshmem_runtime.cpp. The channel refuses groups that need NVSHMEM first
// (channel.cpp), so nothing reaches it.
#include <stdexcept>

#include "nvshmem_runtime.hpp"

namespace odc::nvshmem {

std::unique_ptr<DeviceMemory> make_memory(std::vector<int>, std::vector<bool>, int, bool) {
  throw std::logic_error("odc: this build has no NVSHMEM (ODC_WITH_NVSHMEM=1 python setup.py build_ext)");
}

}  // namespace odc::nvshmem
