// Layer 2, a transport: stream memory operations (stream_memops.hpp).
#include "stream_memops.hpp"

#include <stdexcept>

namespace odc {

StreamMemops StreamMemops::look_up(int device) {
  using AttrFn = CUresult (*)(int*, CUdevice_attribute, CUdevice);
  void* attr_fn = nullptr;
  void* wait_fn = nullptr;
  void* write_fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  auto found = [&](const char* name, void** fn) {
    return cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
           q == cudaDriverEntryPointSuccess;
  };
  StreamMemops m;
  if (!found("cuDeviceGetAttribute", &attr_fn) || !found("cuStreamWaitValue64", &wait_fn) ||
      !found("cuStreamWriteValue64", &write_fn)) {
    (void)cudaGetLastError();
    return m;  // an old driver: flag kernels
  }
  int ok = 0;
  if (reinterpret_cast<AttrFn>(attr_fn)(&ok, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
                                        device) != CUDA_SUCCESS || !ok) {
    return m;
  }
  m.wait_ = reinterpret_cast<WaitValueFn>(wait_fn);
  m.write_ = reinterpret_cast<WriteValueFn>(write_fn);
  return m;
}

StreamMemops StreamMemops::load(int device, int rank, const std::vector<char*>& bases,
                                const DeviceMemory& memory) {
  StreamMemops m = look_up(device);
  if (!m) return m;
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "creating a stream");
  const CUstream s = reinterpret_cast<CUstream>(stream);
  bool ok = m.wait_(s, reinterpret_cast<CUdeviceptr>(bases[rank]), 0, CU_STREAM_WAIT_VALUE_GEQ) ==
            CUDA_SUCCESS;
  for (size_t r = 0; ok && r < bases.size(); ++r) {
    if (memory.routed(bases[r])) continue;  // a placeholder address
    ok = m.write_(s, reinterpret_cast<CUdeviceptr>(bases[r]), 0, CU_STREAM_WRITE_VALUE_DEFAULT) ==
         CUDA_SUCCESS;
  }
  ok = ok && cudaStreamSynchronize(stream) == cudaSuccess;
  (void)cudaStreamDestroy(stream);
  if (!ok) {  // refused through a peer's mapping or on our own: flag kernels
    (void)cudaGetLastError();
    return StreamMemops{};
  }
  return m;
}

void StreamMemops::wait_geq(cudaStream_t s, const uint64_t* flag, uint64_t value) const {
  if (wait_(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag), value,
            CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS) {
    throw std::runtime_error("odc: cuStreamWaitValue64 failed");
  }
}

void StreamMemops::write(cudaStream_t s, uint64_t* flag, uint64_t value) const {
  // Payloads too: the v2 entry points refuse CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER.
  if (write_(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag), value,
             CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS) {
    throw std::runtime_error("odc: cuStreamWriteValue64 failed");
  }
}

}  // namespace odc
