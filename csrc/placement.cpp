// Layer 2, transport set-up: where a group's ranks are (placement.hpp).
#include "placement.hpp"

#include <unistd.h>

#include <algorithm>

#include "text.hpp"

namespace odc {

std::string host_name() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

namespace {

std::vector<std::string> host_labels(const TransportArgs& a, const Options& o) {
  std::string mine = host_name();
  const int64_t g = o.global_ranks_in_group.empty() ? a.rank : o.global_ranks_in_group[a.rank];
  if (o.host_size > 0) mine += cat(" #", g / o.host_size);
  std::vector<std::string> labels;
  for (const auto& l : exchange_blobs(a, "host", std::vector<uint8_t>(mine.begin(), mine.end()))) {
    labels.emplace_back(l.begin(), l.end());
  }
  return labels;
}

// "'a' (ranks 0, 1), 'b' (ranks 2, 3)": the group's ranks by host, hosts in order of their
// first rank.
std::string describe_hosts(const std::vector<std::string>& labels) {
  std::vector<std::string> hosts;
  std::vector<std::string> ranks;
  for (size_t r = 0; r < labels.size(); ++r) {
    const size_t h = std::find(hosts.begin(), hosts.end(), labels[r]) - hosts.begin();
    if (h == hosts.size()) {
      hosts.push_back(labels[r]);
      ranks.emplace_back();
    }
    ranks[h] += cat(ranks[h].empty() ? "" : ", ", r);
  }
  std::string out;
  for (size_t h = 0; h < hosts.size(); ++h) {
    out += cat(h ? ", '" : "'", hosts[h], "' (rank", ranks[h].find(',') == std::string::npos ? " " : "s ",
               ranks[h], ")");
  }
  return out;
}

// The hosts, described, when some two ranks on different hosts are not `connected`; else
// empty. Decided over every pair, so that every rank decides alike.
std::string unconnected(const std::vector<std::string>& labels,
                        const std::function<bool(int, int)>& connected) {
  const int n = static_cast<int>(labels.size());
  for (int r = 0; r < n; ++r) {
    for (int q = 0; q < r; ++q) {
      if (labels[q] != labels[r] && !connected(q, r)) return describe_hosts(labels);
    }
  }
  return {};
}

}  // namespace

Placement place_host_ranks(const TransportArgs& a, const Options& o) {
  Placement p;
  p.rank = a.rank;
  p.hosts = host_labels(a, o);
  p.routed.assign(a.world, false);
  p.unconnected_hosts = unconnected(p.hosts, [](int, int) { return false; });
  return p;
}

Placement place_gpu_ranks(const TransportArgs& a, const Options& o,
                          const std::vector<uint8_t>& gpu_uuid) {
  Placement p;
  p.rank = a.rank;
  p.hosts = host_labels(a, o);
  const std::string host = host_name();
  std::vector<uint8_t> mine(host.begin(), host.end());
  mine.push_back('/');
  mine.insert(mine.end(), gpu_uuid.begin(), gpu_uuid.end());
  p.gpus = exchange_blobs(a, "device", mine);
  const auto& g = o.global_ranks_in_group;
  auto global = [&](int r) -> int64_t { return g.empty() ? r : g[r]; };
  p.routed.assign(a.world, false);
  for (int r = 0; r < a.world; ++r) p.routed[r] = o.routes_peer(global(a.rank), global(r));
  p.unconnected_hosts = unconnected(
      p.hosts, [&](int q, int r) { return o.routes_peer(global(q), global(r)); });
  return p;
}

bool Placement::some_ranks_share_a_gpu() const {
  for (size_t r = 0; r < gpus.size(); ++r) {
    for (size_t q = 0; q < r; ++q) {
      if (gpus[q] == gpus[r]) return true;
    }
  }
  return false;
}

int Placement::ranks_on_gpu() const {
  int n = 0;
  for (size_t r = 0; r < gpus.size(); ++r) n += !routed[r] && gpus[r] == gpus[rank];
  return n;
}

bool Placement::peers_on_other_gpus() const {
  for (size_t r = 0; r < gpus.size(); ++r) {
    if (!routed[r] && gpus[r] != gpus[rank]) return true;
  }
  return false;
}

bool Placement::own_gpus() const {
  for (size_t r = 0; r < gpus.size(); ++r) {
    if (routed[r]) return false;
    for (size_t q = 0; q < r; ++q) {
      if (gpus[q] == gpus[r]) return false;
    }
  }
  return true;
}

}  // namespace odc
