// Layer 5, backend: the group-wide values odc.balance shares through the group's store
// (OdcBackend::claim / forget / publish / lookup, backend.hpp): atomic counters for dynamic
// work sharing and small published values (the ranks' measured speeds). No transport.
#include "backend.hpp"

namespace odc {

int64_t OdcBackend::claim(const std::string& key, int64_t amount) {
  settle_default_backend_type();
  return store_->add("odc_claim/" + key, amount) - amount;
}

void OdcBackend::forget(const std::string& key) { store_->deleteKey("odc_claim/" + key); }

void OdcBackend::publish(const std::string& key, const std::string& value) {
  store_->set("odc_claim/" + key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string OdcBackend::lookup(const std::string& key) {
  const std::vector<uint8_t> v = store_->get("odc_claim/" + key);  // waits up to the timeout
  return std::string(v.begin(), v.end());
}

}  // namespace odc
