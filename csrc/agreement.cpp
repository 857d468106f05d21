// Layer 4, channel: the settings every rank of a group must share (agreement.hpp).
#include "agreement.hpp"

#include <sstream>

#include "text.hpp"

namespace odc {

namespace {
std::vector<uint8_t> encode(const std::vector<Setting>& s) {
  std::string text;
  for (const auto& x : s) text += x.knob + "=" + x.value + "\n";
  return std::vector<uint8_t>(text.begin(), text.end());
}

std::vector<Setting> decode(const std::vector<uint8_t>& blob) {
  std::vector<Setting> out;
  std::istringstream in(std::string(blob.begin(), blob.end()));
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) out.push_back({line.substr(0, eq), line.substr(eq + 1)});
  }
  return out;
}

std::string value_of(const std::vector<Setting>& s, const std::string& knob) {
  for (const auto& x : s) {
    if (x.knob == knob) return x.value;
  }
  return "(not known to its build)";
}
}  // namespace

std::vector<Setting> shared_settings(const Options& o, bool cuda) {
  std::vector<Setting> s = {
      {"ODC_CHUNK_BYTES", cat(o.chunk_bytes_for(cuda))},
      {"ODC_RING_SLOTS", cat(o.ring_slots)},
      {"ODC_MATCH_CHECK", cat(o.match_check ? 1 : 0)},
      {"ODC_STAGED_AG_PUSH", cat(o.staged_ag_push ? 1 : 0)},
      {"ODC_AG_PUSH", o.ag_push < 0 ? "auto" : cat(o.ag_push)},
      {"ODC_SELF_SERVE", o.self_serve == SelfServe::Auto ? "auto" : cat(static_cast<int>(o.self_serve))},
      {"ODC_HOST_SIZE", cat(o.host_size)},
      {"ODC_POOL_BYTES", cat(o.pool_bytes_for(cuda))},
  };
  if (cuda) {
    s.push_back({"ODC_ZERO_COPY", cat(o.zero_copy ? 1 : 0)});
    const char* kinds[] = {"auto", "nvshmem", "ipc"};
    s.push_back({"ODC_TRANSPORT", kinds[static_cast<int>(o.transport)]});
    s.push_back({"ODC_NVSHMEM_STAGE", o.nvshmem_stage_always ? "always" : "auto"});
  }
  return s;
}

void check_settings_agree(const TransportArgs& a, const std::string& group_name,
                          const std::vector<Setting>& mine) {
  const auto all = exchange_blobs(a, "settings", encode(mine));
  for (int r = 0; r < a.world; ++r) {
    if (r == a.rank) continue;
    const std::vector<Setting> theirs = decode(all[r]);
    for (const auto& x : mine) {
      const std::string other = value_of(theirs, x.knob);
      ODC_CHECK(other == x.value, ValueError, "odc: group '", group_name, "': rank ", r,
                " set ", x.knob, " differently: this rank (", a.rank, ") has ", x.knob, "=",
                x.value, ", rank ", r, " has ", x.knob, "=", other, ". Every rank of a group "
                "must have the same ", x.knob, " (it decides what a rank writes where its peers "
                "read); set it alike in every rank's environment (docs/configuration.md)");
    }
  }
}

}  // namespace odc
