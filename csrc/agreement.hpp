// Layer 4, channel: the settings every rank of a group must share, checked once when a
// channel is set up. A knob that changes what a rank puts where its peers read (ring sizes,
// which form of a collective it runs, whether it stores descriptors, how peers are reached,
// who serves the other collectives) must be the same on every rank; one set differently on one
// rank is an error on every rank at once, naming the knob and both values, instead of a hang
// or wrong data later. Knobs that change only how a rank runs its own steps on its own GPU
// (engine thresholds, block counts, stream memory operations) may differ.
#pragma once

#include <string>
#include <vector>

#include "options.hpp"
#include "rendezvous.hpp"

namespace odc {

struct Setting {
  std::string knob;   // the ODC_* variable
  std::string value;  // as this rank has it (after defaults)
};

// The settings of `options` that every rank of a group must share, for a channel on CUDA
// tensors (`cuda`) or CPU tensors.
std::vector<Setting> shared_settings(const Options& options, bool cuda);

// Exchanges `mine` through the group's store (collective) and throws ValueError on every rank
// where some rank's settings differ, naming the first knob that differs, this rank's value and
// the other rank's.
void check_settings_agree(const TransportArgs& a, const std::string& group_name,
                          const std::vector<Setting>& mine);

}  // namespace odc
