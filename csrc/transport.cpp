#include "transport.hpp"

#include "text.hpp"

namespace odc {

std::vector<std::vector<uint8_t>> exchange_blobs(const TransportArgs& a, const std::string& name,
                                                 const std::vector<uint8_t>& mine) {
  const std::string base = a.key_prefix + name + "/";
  a.store->set(base + std::to_string(a.rank), mine);
  std::vector<std::vector<uint8_t>> all(a.world);
  for (int r = 0; r < a.world; ++r) {
    all[r] = r == a.rank ? mine : a.store->get(base + std::to_string(r));
  }
  return all;
}

void store_barrier(const TransportArgs& a, const std::string& name) {
  exchange_blobs(a, name, {1});
}

std::string describe_wait(const WaitSite& site, int peer, uint64_t target, uint64_t seen,
                          std::chrono::milliseconds timeout) {
  return cat("odc: ", site.op, " #", site.op_seq, " timed out after ",
             static_cast<long long>(timeout.count()), " ms waiting for ", site.what, " rank ",
             peer, " (counter ", seen, ", needed ", target,
             "); that rank is dead, stuck, or issued different collectives. The group cannot "
             "be used any more.");
}

}  // namespace odc
