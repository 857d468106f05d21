// Layer 5, backend: how an all-gather or reduce-scatter of the c10d face (backend.hpp) runs:
// the path each tensor takes (staged, registered, pushed, direct), chosen alike on every
// rank, and its issue on the protocol, in one transport operation per call.
#include <c10/util/Exception.h>

#include "backend.hpp"

namespace odc {

void OdcBackend::issue_collective(Channel& ch, void* stream, uint64_t seq, bool ag,
                                  std::vector<at::Tensor>& inputs,
                                  std::vector<at::Tensor>& outputs,
                                  const std::vector<ReduceSpec>& specs, RedOp red_op) {
  uint64_t bytes = 0;
  // A staged all-gather pushed through the landing rings also moves chunks on the
  // reduce-scatter's ring.
  const Ring also = ag && options_->staged_ag_push ? Ring::kReduceScatter : Ring::kNone;
  ch.protocol->operation(stream, ag ? Ring::kAllGather : Ring::kReduceScatter, [&] {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const size_t per_rank = (ag ? inputs[i] : outputs[i]).numel() * inputs[i].element_size();
      const Path path = path_of(ch, ag, inputs[i], outputs[i], per_rank);
      const Tensors t{inputs[i], outputs[i], per_rank};
      bytes += path.way == Path::Way::Direct   ? issue_direct(ch, ag, t, specs[i], red_op, seq)
               : path.way == Path::Way::Staged ? issue_staged(ch, ag, t, specs[i], red_op, seq)
                                               : issue_registered(ch, path, ag, t, specs[i], red_op, seq);
    }
  }, also);
  count(ag ? Stat::AllGatherOps : Stat::ReduceScatterOps, 1);
  count(ag ? Stat::AllGatherBytes : Stat::ReduceScatterBytes, bytes);
  count_engine(ch);
}

OdcBackend::Path OdcBackend::path_of(Channel& ch, bool ag, const at::Tensor& in,
                                     const at::Tensor& out, size_t per_rank) const {
  // Only buffers as allocate_tensor handed them out qualify, so that every rank takes the same
  // path: a reduce-scatter's whole input; an all-gather's whole input, or its input as this
  // rank's part of its whole output (in place, as FSDP2 issues it); a pushed all-gather's
  // whole output. Other tensors in registered memory (views of it, such as FSDP2's
  // gradients) take the staged path: whether a view is registered can differ between ranks.
  Path path;
  if (ch.protocol->reads_in_place()) path.way = Path::Way::Direct;  // unless registered
  const RegisteredPool* pool = ch.pool.get();
  const int rank = getRank(), world = getSize();
  const size_t whole = per_rank * world;
  size_t off = 0;
  if (!pool || whole == 0) return path;
  const char* in_p = static_cast<const char*>(in.data_ptr());
  size_t part = 0;  // where rank r's piece lies past pool->address(r, off)
  if (!ag) {
    if (!pool->is_block(in_p, whole, &off)) return path;
    path.way = Path::Way::Registered;
  } else if (ch.push_all_gather) {
    if (!pool->is_block(out.data_ptr(), whole, &off)) return path;
    path.way = Path::Way::RegisteredPush;  // peers' outputs: this rank writes its part there
  } else if (pool->is_block(in_p, per_rank, &off)) {
    path.way = Path::Way::Registered;  // every rank's whole input
  } else if (in_p == static_cast<const char*>(out.data_ptr()) + static_cast<size_t>(rank) * per_rank &&
             pool->is_block(out.data_ptr(), whole, &off)) {
    path.way = Path::Way::Registered;  // in place: rank r's input is its part of its output
    part = per_rank;
  } else {
    return path;
  }
  path.id.offset = off;
  for (int r = 0; r < world; ++r) path.at.push_back(pool->address(r, off) + r * part);
  return path;
}

uint64_t OdcBackend::issue_direct(Channel& ch, bool ag, const Tensors& t, const ReduceSpec& spec,
                                  RedOp red_op, uint64_t seq) {
  const size_t elem = t.in.element_size();
  const size_t in_bytes = ag ? t.per_rank : t.in.numel() * elem;
  // The owner's choice for its own input: in place where every peer has it mapped.
  const uint64_t where = ch.protocol->locate(t.in.data_ptr(), in_bytes);
  count(Stat::DirectOps, 1);
  if (where) count(Stat::DirectInPlaceOps, 1);
  if (ag && options_->ag_push == 1) {
    // Pushed, where asked for (ODC_AG_PUSH=1; reads measured faster on 4 x H200, performance.md):
    // the peers write into this rank's output where every peer has it mapped. A push writes
    // into a peer's memory: its descriptor is always checked, also with ODC_MATCH_CHECK=0.
    const uint64_t out_where = ch.protocol->locate(t.out.data_ptr(), t.per_rank * getSize());
    if (out_where) count(Stat::DirectPushedOps, 1);
    const uint64_t d = op_desc(OpKind::AllGatherDirect, static_cast<int>(t.in.scalar_type()), t.per_rank, 0);
    ch.protocol->all_gather_direct(t.out.data_ptr(), t.in.data_ptr(), t.per_rank, where, seq, d,
                                   &out_where);
    return t.per_rank * getSize();
  }
  const uint64_t d = desc(ag ? OpKind::AllGatherDirect : OpKind::ReduceScatterDirect, t.in,
                          t.per_rank, red_op, !ag);
  if (ag) {
    ch.protocol->all_gather_direct(t.out.data_ptr(), t.in.data_ptr(), t.per_rank, where, seq, d);
    return t.per_rank * getSize();
  }
  ch.protocol->reduce_scatter_direct(t.out.data_ptr(), t.in.data_ptr(), t.out.numel(), elem, spec,
                                     where, seq, d);
  return in_bytes;
}

uint64_t OdcBackend::issue_staged(Channel& ch, bool ag, const Tensors& t, const ReduceSpec& spec,
                                  RedOp red_op, uint64_t seq) {
  const int world = getSize();
  if (ag && options_->staged_ag_push) {
    // Pushed through the landing rings: an exchange whose every pair carries this rank's
    // shard, of a kind of its own (ranks that chose otherwise fail at once).
    const int me = getRank();
    Protocol::Exchange x;
    x.send = std::vector<size_t>(world, t.per_rank);
    x.send_off = std::vector<size_t>(world, 0);  // every peer gets this rank's whole input
    x.recv = std::vector<size_t>(world, t.per_rank);
    for (int p = 0; p < world; ++p) x.recv_off.push_back(p * t.per_rank);
    x.kind = OpKind::AllGatherPut;
    x.scalar_type = static_cast<int>(t.in.scalar_type());
    x.check = options_->match_check;
    x.talk_empty = true;
    const bool in_place = t.in.data_ptr() == static_cast<char*>(t.out.data_ptr()) + me * t.per_rank;
    if (in_place) x.send[me] = x.recv[me] = 0;  // nothing to copy to itself
    ch.protocol->exchange(t.out.data_ptr(), t.in.data_ptr(), x, seq);
    return t.per_rank * world;
  }
  // What this rank calls, for the peers to check against theirs (ODC_MATCH_CHECK).
  const uint64_t d = desc(ag ? OpKind::AllGather : OpKind::ReduceScatter, t.in, t.per_rank,
                          red_op, !ag);
  if (ag) {
    ch.protocol->all_gather(t.out.data_ptr(), t.in.data_ptr(), t.per_rank, seq, d);
    return t.per_rank * world;
  }
  const size_t elem = t.in.element_size();
  ch.protocol->reduce_scatter(t.out.data_ptr(), t.in.data_ptr(), t.out.numel(), elem, spec, seq, d);
  return t.in.numel() * elem;
}

uint64_t OdcBackend::issue_registered(Channel& ch, const Path& path, bool ag, const Tensors& t,
                                      const ReduceSpec& spec, RedOp red_op, uint64_t seq) {
  count(Stat::RegisteredOps, 1);
  const bool push = path.way == Path::Way::RegisteredPush;
  const OpKind kind = !ag    ? OpKind::ReduceScatterRegistered
                      : push ? OpKind::AllGatherRegisteredPush
                             : OpKind::AllGatherRegistered;
  // A push writes into the peers' memory: its descriptor (with the buffer's place) is always
  // checked, also with ODC_MATCH_CHECK=0.
  const uint64_t d = push ? op_desc(kind, static_cast<int>(t.in.scalar_type()), t.per_rank, 0)
                          : desc(kind, t.in, t.per_rank, red_op, !ag);
  if (!ag) {
    ch.protocol->reduce_scatter_registered(t.out.data_ptr(), path.at, t.out.numel(),
                                           t.in.element_size(), spec, path.id, seq, d);
  } else if (push) {
    ch.protocol->all_gather_pushed(t.out.data_ptr(), t.in.data_ptr(), path.at, t.per_rank, path.id,
                                   seq, d);
    count(Stat::AllGatherPushOps, 1);
  } else {
    ch.protocol->all_gather_registered(t.out.data_ptr(), path.at, t.per_rank, path.id, seq, d);
  }
  return t.per_rank * getSize();
}

}  // namespace odc
