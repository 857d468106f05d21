// Layer 5, backend: the c10d face's argument checks (backend.hpp): dtypes, devices, layouts
// and reduce ops, raised as Python errors naming the problem before anything is issued.
#include "backend.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/exception.h>

#include <optional>

#include "text.hpp"

namespace odc {

namespace {
std::optional<DType> dtype_of(at::ScalarType t) {  // the dtypes odc's reductions take
  switch (t) {
    case at::kFloat: return DType::F32;
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    case at::kDouble: return DType::F64;
    case at::kInt: return DType::I32;
    case at::kLong: return DType::I64;
    case at::kByte:
    case at::kBool: return DType::U8;
    case at::kChar: return DType::I8;
    default: return std::nullopt;
  }
}
}  // namespace

DType to_dtype(at::ScalarType t, const char* api) {
  const std::optional<DType> d = dtype_of(t);
  ODC_CHECK(d, TypeError, "odc: ", api, ": unsupported dtype ", c10::toString(t),
            " (reductions support float32, bfloat16, float16, float64, int32, int64, uint8, int8 "
            "and bool)");
  return *d;
}

std::string describe(const at::Tensor& t) {
  std::string dims;
  for (int64_t d : t.sizes()) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
  return cat(c10::toString(t.scalar_type()), "[", dims, "] on ", t.device());
}

void check_tensor(const at::Tensor& t, const c10::Device& device, const char* api,
                  const char* what, bool dense) {
  ODC_CHECK(t.defined(), ValueError, "odc: ", api, ": undefined ", what);
  ODC_CHECK(t.device() == device, ValueError, "odc: ", api, ": all tensors must be on one device, ",
            "got ", what, " ", describe(t), " and others on ", device);
  ODC_CHECK(device.is_cpu() || device.is_cuda(), ValueError, "odc: ", api,
            ": unsupported device ", device);
  if (dense) {
    ODC_CHECK(t.is_non_overlapping_and_dense(), ValueError, "odc: ", api, ": tensors must be dense (",
              what, " ", describe(t), " is not); call .contiguous() first");
    return;
  }
  ODC_CHECK(t.is_contiguous(), ValueError, "odc: ", api, ": tensors must be contiguous (", what,
            " ", describe(t), " is not); call .contiguous() first");
}

bool odc_reduces(at::ScalarType dtype, const c10d::ReduceOp& op) {
  if (!dtype_of(dtype)) return false;
  switch (op.op_) {  // reduce_spec's
    case c10d::ReduceOp::SUM: case c10d::ReduceOp::MAX: case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::PRODUCT: return true;
    case c10d::ReduceOp::AVG: case c10d::ReduceOp::PREMUL_SUM: return at::isFloatingType(dtype);
    default: return false;  // reduce_spec's
  }
}

const char* reduce_op_name(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

bool is_bitwise(const c10d::ReduceOp& op) {
  return op.op_ == c10d::ReduceOp::BAND || op.op_ == c10d::ReduceOp::BOR ||
         op.op_ == c10d::ReduceOp::BXOR;
}

ReduceSpec OdcBackend::reduce_spec(const at::Tensor& t, const c10d::ReduceOp& op, const char* api,
                                   std::vector<at::Tensor>& factors, RedOp* red_op) {
  ReduceSpec spec;
  spec.dtype = to_dtype(t.scalar_type(), api);
  const bool floating = at::isFloatingType(t.scalar_type());
  const bool boolean = t.scalar_type() == at::kBool;
  *red_op = RedOp::Sum;
  switch (op.op_) {
    case c10d::ReduceOp::SUM:  // of booleans: a logical or, as NCCL's
      spec.combine = boolean ? Combine::Max : Combine::Sum;
      break;
    case c10d::ReduceOp::AVG:
      ODC_CHECK(floating, TypeError, "odc: ", api, ": AVG needs a floating-point dtype, got ",
                c10::toString(t.scalar_type()));
      spec.scale = 1.0 / getSize();
      *red_op = RedOp::Avg;
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      ODC_CHECK(floating, TypeError, "odc: ", api, ": PREMUL_SUM needs a floating-point dtype");
      *red_op = RedOp::PreMulSum;
      auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      ODC_CHECK(sup, ValueError, "odc: ", api, ": PREMUL_SUM without a factor");
      if (sup->tensor_factor.defined()) {
        factors.push_back(sup->tensor_factor.to(t.device(), at::kFloat).contiguous());
        spec.scale_ptr = factors.back().data_ptr<float>();
      } else {
        spec.scale = sup->double_factor;
      }
      break;
    }
    case c10d::ReduceOp::MAX: spec.combine = Combine::Max; *red_op = RedOp::Max; break;
    case c10d::ReduceOp::MIN: spec.combine = Combine::Min; *red_op = RedOp::Min; break;
    case c10d::ReduceOp::PRODUCT:  // of booleans: a logical and
      spec.combine = boolean ? Combine::Min : Combine::Product;
      *red_op = RedOp::Product;
      break;
    default:
      ODC_CHECK(false, ValueError, "odc: ", api, ": unsupported reduce op ", reduce_op_name(op),
                " (odc reduces with SUM, AVG, PREMUL_SUM, MAX, MIN and PRODUCT; with "
                "ODC_SELF_SERVE=0 the collectives FSDP does not issue, bitwise ones included, go "
                "to the inner gloo / NCCL backend)");
  }
  return spec;
}

c10::Device device_of(const std::vector<at::Tensor>& ts) {
  ODC_CHECK(!ts.empty() && ts[0].defined(), ValueError, "odc: collective called with no tensors");
  return ts[0].device();
}

c10::Device check_collective(const std::vector<at::Tensor>& outputs,
                             const std::vector<at::Tensor>& inputs, bool ag, int world,
                             const char* api) {
  ODC_CHECK(!inputs.empty() && inputs.size() == outputs.size(), ValueError, "odc: ", api,
            " needs as many outputs as inputs (got ", outputs.size(), " and ", inputs.size(), ")");
  const c10::Device device = inputs[0].device();
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& in = inputs[i];
    const at::Tensor& out = outputs[i];
    check_tensor(in, device, api, "input");
    check_tensor(out, device, api, "output");
    ODC_CHECK(in.scalar_type() == out.scalar_type(), TypeError, "odc: ", api,
              ": input and output dtype differ (", c10::toString(in.scalar_type()), " vs ",
              c10::toString(out.scalar_type()), ")");
    const int64_t big = ag ? out.numel() : in.numel();
    const int64_t small = ag ? in.numel() : out.numel();
    ODC_CHECK(big == small * world, ValueError, "odc: ", api, ": size mismatch: ",
              ag ? "output" : "input", " has ", big, " elements but must have ",
              ag ? "input" : "output", " size x world size = ", small, " x ", world);
  }
  return device;
}

}  // namespace odc
