// Layer 5, backend: the host's side of device_work.hpp (shared by every build).
#include "device_work.hpp"

namespace odc {
namespace {
class HostLaunch final : public DeviceLaunch {
 public:
  void* stream() const override { return nullptr; }
  std::unique_ptr<DeviceCompletion> finish(std::vector<at::Tensor>&, std::vector<at::Tensor>&,
                                           bool, bool) override {
    return nullptr;
  }
};
}  // namespace

std::unique_ptr<DeviceLaunch> host_launch() { return std::make_unique<HostLaunch>(); }

}  // namespace odc
