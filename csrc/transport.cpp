// Layer 2, the transport interface: what every transport shares (transport.hpp).
#include "transport.hpp"

#include <c10/core/ScalarType.h>

#include <stdexcept>

#include "text.hpp"

namespace odc {

std::string describe_wait(const WaitSite& site, int peer, uint64_t target, uint64_t seen,
                          std::chrono::milliseconds timeout) {
  return cat("odc: ", site.op, " #", site.op_seq, " timed out after ",
             static_cast<long long>(timeout.count()), " ms waiting for ", site.what, " rank ",
             peer, " (counter ", seen, ", needed ", target,
             "); that rank is dead, stuck, or issued different collectives. The group cannot "
             "be used any more.");
}

std::string describe_desc(uint64_t desc) {
  if (desc == 0) return "nothing (no descriptor was stored: a different collective)";
  const OpDescFields f = decode_op_desc(desc);
  const char* kind = kind_name(f.kind);
  const std::string type =
      f.scalar_type < static_cast<int>(c10::ScalarType::NumOptions)
          ? std::string(c10::getDtypeNames(static_cast<c10::ScalarType>(f.scalar_type)).first)
          : "unknown dtype";
  static const char* const kOps[] = {"", ", SUM", ", AVG", ", PREMUL_SUM", ", MAX", ", MIN", ", PRODUCT"};
  const char* op = f.red_op >= 0 && f.red_op < 7 ? kOps[f.red_op] : ", unknown reduce op";
  const bool rooted = f.kind == OpKind::Broadcast || f.kind == OpKind::Scatter ||
                      f.kind == OpKind::Gather;
  const char* per = f.kind == OpKind::AllToAll || f.kind == OpKind::Scatter ||
                            f.kind == OpKind::Gather
                        ? " bytes between the two ranks ("
                        : f.kind == OpKind::Broadcast || f.kind == OpKind::AllReduce
                              ? " bytes ("
                              : " bytes per rank (";
  return cat(kind, " of ", f.bytes, per, type, op, ")", rooted ? cat(" from/to root ", f.root) : "");
}

namespace {
// "reduce_scatter": an announcement's collective (protocol.hpp, announce_word).
const char* collective_name(uint64_t word) { return kind_name(decode_op_desc(word).kind); }
}  // namespace

std::string describe_stopped(const WaitSite& site, int rank, int peer, uint64_t theirs) {
  const int code = stop_code(theirs);
  const char* why = code == kStopMismatch || code == kStopAnnounced
                        ? "it found that the ranks issued different collectives here (its error names both sides)"
                    : code == kStopTimeout ? "a wait of its own timed out (its error names the rank it waited for)"
                    : code == kStopMemory ? "a peer named memory it cannot read"
                    : code == kStopPeerStopped ? "another rank gave it up first"
                    : code == kStopExited ? "a rank it waited for has exited"
                                          : "of an error of its own";
  return cat("odc: ", site.op, " #", site.op_seq, ": rank ", peer, " gave up this collective because ",
             why, ", so this rank (rank ", rank, ") stopped waiting for ", site.what, " rank ", peer,
             ". The group cannot be used any more.");
}

std::string describe_announced(const WaitSite& site, int rank, int peer, uint64_t mine,
                               uint64_t theirs) {
  if (gave_up_same(mine, theirs)) return describe_stopped(site, rank, peer, theirs);
  return cat("odc: ", site.op, " #", site.op_seq, ": rank ", peer,
             " issued a different collective than this rank (rank ", rank,
             ") at the same point: this rank called ", collective_name(mine), ", rank ", peer,
             " called ", collective_name(theirs),
             ". Every rank of a group must issue the same collectives in the same order. "
             "The group cannot be used any more.");
}

std::string describe_mismatch(const WaitSite& site, int rank, int peer, uint64_t mine,
                              uint64_t theirs, uint64_t chunk, uint64_t their_chunk) {
  const char* end = ". The group cannot be used any more.";
  const OpKind kind = decode_op_desc(mine).kind;
  if (theirs == mine &&
      (kind == OpKind::AllGatherRegistered || kind == OpKind::AllGatherRegisteredPush ||
       kind == OpKind::ReduceScatterRegistered)) {
    const RegisteredId a = RegisteredId::decode(chunk), b = RegisteredId::decode(their_chunk);
    if (a.number != b.number) {
      return cat("odc: ", site.op, " #", site.op_seq, ": rank ", peer, " and this rank (rank ",
                 rank, ") are no longer in step: this rank runs its registered collective #",
                 a.number, ", rank ", peer, " its #", b.number, end);
    }
    return cat("odc: ", site.op, " #", site.op_seq, ": the registered buffers of rank ", peer,
               " and this rank (rank ", rank, ") are not at the same place: this rank's ",
               kind == OpKind::ReduceScatterRegistered ? "input" : "output", " starts at byte ",
               a.offset, " of its registered pool, rank ", peer, "'s at byte ", b.offset,
               ". Zero-copy collectives read their peers' buffers at the same place in the peer's "
               "pool: every rank must allocate them (allocate_tensor) with the same sizes in the "
               "same order, and free them in the same order", end);
  }
  if (theirs == mine) {  // the same collective, but not the same place in the sequence
    return cat("odc: ", site.op, " #", site.op_seq, ": rank ", peer, " and this rank (rank ",
               rank, ") are no longer in step: this rank waits for chunk ", chunk, " of rank ",
               peer, " but got chunk ", their_chunk, " (", describe_desc(mine),
               "); an earlier collective differed between the ranks (one issued a collective "
               "the other did not, or they named different roots)", end);
  }
  return cat("odc: ", site.op, " #", site.op_seq, ": rank ", peer,
             " issued a different collective than this rank (rank ", rank, "): this rank's is ",
             describe_desc(mine), ", rank ", peer, "'s is ", describe_desc(theirs),
             ". Every rank of a group must issue the same collectives in the same order, with "
             "the same sizes, dtypes, reduce ops and roots", end);
}

}  // namespace odc
