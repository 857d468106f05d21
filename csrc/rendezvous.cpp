// Layer 2, transport set-up: the window rendezvous through the group's store (rendezvous.hpp).
#include "rendezvous.hpp"

#include "text.hpp"

namespace odc {

std::vector<std::vector<uint8_t>> exchange_blobs(const TransportArgs& a, const std::string& name,
                                                 const std::vector<uint8_t>& mine) {
  const std::string base = a.key_prefix + name + "/";
  a.store->set(base + std::to_string(a.rank), mine);
  std::vector<std::vector<uint8_t>> all(a.world);
  for (int r = 0; r < a.world; ++r) {
    if (r == a.rank) {
      all[r] = mine;
      continue;
    }
    const std::string key = base + std::to_string(r);
    if (a.timeout().count() > 0) {  // the group's timeout, not the store's (often longer)
      try {
        a.store->wait({key}, a.timeout());
      } catch (const std::exception&) {
        throw CommError(cat("odc: setting up ", name, ": rank ", r, " did not arrive within ",
                            static_cast<long long>(a.timeout().count()),
                            " ms (every rank of the group must take this step: it is dead, "
                            "stuck, or took another path)"));
      }
    }
    all[r] = a.store->get(key);
  }
  return all;
}

void store_barrier(const TransportArgs& a, const std::string& name) {
  exchange_blobs(a, name, {1});
}

}  // namespace odc
