// Layer 1, layout and descriptors (layout.hpp).
#include "layout.hpp"

#include <stdexcept>

namespace odc {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    case DType::F64: return "float64";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::U8: return "uint8";
    case DType::I8: return "int8";
  }
  return "?";
}

size_t dtype_size(DType d) {
  switch (d) {
    case DType::F64:
    case DType::I64: return 8;
    case DType::F32:
    case DType::I32: return 4;
    case DType::BF16:
    case DType::F16: return 2;
    case DType::U8:
    case DType::I8: return 1;
  }
  return 1;
}

uint64_t op_desc(OpKind kind, int scalar_type, uint64_t bytes, int red_op, int root) {
  constexpr uint64_t kBytesMask = (uint64_t{1} << 40) - 1;  // 1 TiB per rank or pair
  return (uint64_t{1} << 63) | (static_cast<uint64_t>(kind) & 15) << 59 |
         (static_cast<uint64_t>(red_op) & 7) << 56 |
         (static_cast<uint64_t>(scalar_type) & 255) << 48 |
         (static_cast<uint64_t>(root) & 255) << 40 | (bytes & kBytesMask);
}

const char* kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::AllGather: return "all_gather";
    case OpKind::ReduceScatter: return "reduce_scatter";
    case OpKind::AllReduce: return "all_reduce";
    case OpKind::Broadcast: return "broadcast";
    case OpKind::AllToAll: return "all_to_all";
    case OpKind::Scatter: return "scatter";
    case OpKind::Gather: return "gather";
    case OpKind::AllGatherRegistered: return "all_gather (registered memory)";
    case OpKind::ReduceScatterRegistered: return "reduce_scatter (registered memory)";
    case OpKind::AllGatherRegisteredPush: return "all_gather (registered memory, pushed)";
    case OpKind::AllGatherPut: return "all_gather (pushed into landing rings)";
    case OpKind::AllGatherDirect: return "all_gather (direct)";
    case OpKind::ReduceScatterDirect: return "reduce_scatter (direct)";
  }
  return "unknown collective";
}

OpDescFields decode_op_desc(uint64_t desc) {
  return {static_cast<OpKind>((desc >> 59) & 15), static_cast<int>((desc >> 48) & 255),
          desc & ((uint64_t{1} << 40) - 1), static_cast<int>((desc >> 56) & 7),
          static_cast<int>((desc >> 40) & 255)};
}

WindowLayout::WindowLayout(int world_, size_t chunk_bytes_, int slots_)
    : world(world_), chunk_bytes(chunk_bytes_), slots(slots_) {
  if (world <= 0 || slots <= 0 || chunk_bytes == 0 || chunk_bytes % 16 != 0) {
    throw std::invalid_argument(
        "odc: invalid window geometry (chunk bytes must be a positive multiple of 16, "
        "ring slots positive)");
  }
  flags_bytes = static_cast<size_t>(kNumFlagArrays) * world * kFlagStride;
  descs = flags_bytes;
  announce = descs + static_cast<size_t>(kNumDescArrays) * world * slots * kDescBytes;
  const size_t announce_end = announce + static_cast<size_t>(world) * kAnnounceSlots * 8;
  ag_ring = (announce_end + 4095) / 4096 * 4096;
  rs_ring = ag_ring + static_cast<size_t>(slots) * chunk_bytes;
  total = rs_ring + static_cast<size_t>(world) * slots * chunk_bytes;
}

namespace {
size_t align64(size_t x) { return (x + 63) / 64 * 64; }
}  // namespace

ArenaLayout::ArenaLayout(int world_, const std::vector<size_t>& shard_numel,
                         const std::vector<size_t>& param_elem_size,
                         const std::vector<size_t>& grad_numel_)
    : world(world_), numel(shard_numel), grad_numel(grad_numel_) {
  size_t off = align64(group_done(static_cast<int>(numel.size()), 0));  // the counters first
  for (size_t g = 0; g < numel.size(); ++g) {
    pub_bytes.push_back(numel[g] * param_elem_size[g]);
    pub_off.push_back(off);
    off = align64(off + pub_bytes.back());
    acc_off.push_back(off);
    off = align64(off + grad_numel[g] * sizeof(float));
  }
  total = off;
}

}  // namespace odc
