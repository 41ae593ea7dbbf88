// dsv4::topk_rows_cuda: the CUDA top-k of topk_rows.cu as a torch operator.
//
// The schema is defined here, in C++, so that any process that loads this library has the op:
// Python (torch.ops.load_library, dsv4_ops/native.py; the fake kernel is Python's,
// dsv4_ops/ops/topk_cuda.py) and the C++ runner of AOTInductor packages (csrc/runner/dsv4_run.cpp,
// which dlopens the library and whose packages call the op through AOTInductor's proxy executor).
// The implementation checks its arguments (a ValueError in Python naming the argument and the
// limit), allocates the output and launches the kernel on the current CUDA stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <string>

#include "topk_rows.h"

namespace {

// The messages below are built from strings alone (std::to_string, never an ostream's number
// formatting): a library compiled by another GCC than torch's crashed inside the process's older
// libstdc++ when c10::str streamed an integer.
std::string num(int64_t v) { return std::to_string(v); }

std::string shape(at::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + num(sizes[i]);
  return out + "]";
}

// [B, S, topk] int32: per row of scores [B, S, N] (fp32, last dim contiguous) the min(topk, visible)
// best of its first visible[b, s] entries (clamped to [0, N]), descending score then ascending index,
// then -1.
at::Tensor topk_rows_cuda(const at::Tensor& scores, const at::Tensor& visible, int64_t topk) {
  TORCH_CHECK_VALUE(scores.dim() == 3, "topk_rows_cuda: scores must be [B, S, N], got shape ", shape(scores.sizes()));
  TORCH_CHECK_VALUE(scores.scalar_type() == at::kFloat, "topk_rows_cuda: scores must be float32, got ",
                    scores.scalar_type());
  TORCH_CHECK_VALUE(scores.is_cuda(), "topk_rows_cuda: scores must be a CUDA tensor, got ", scores.device());
  const int64_t B = scores.size(0), S = scores.size(1), N = scores.size(2);
  TORCH_CHECK_VALUE(N == 1 || scores.stride(2) == 1,
                    "topk_rows_cuda: scores must have a contiguous last dim (stride 1), got strides ",
                    shape(scores.strides()));
  TORCH_CHECK_VALUE(1 <= N && N <= dsv4::kTopkRowsMaxEntries, "topk_rows_cuda: scores' last dim N (got ", num(N),
                    ") must be in [1, ", num(dsv4::kTopkRowsMaxEntries), "]");
  TORCH_CHECK_VALUE(1 <= topk && topk <= dsv4::kTopkRowsMaxTopk, "topk_rows_cuda: topk (got ", num(topk),
                    ") must be in [1, ", num(dsv4::kTopkRowsMaxTopk), "]");
  TORCH_CHECK_VALUE(B * S <= std::numeric_limits<int32_t>::max(), "topk_rows_cuda: B * S (got ", num(B * S),
                    ") must be at most ", num(std::numeric_limits<int32_t>::max()), " rows (one CUDA block a row)");
  TORCH_CHECK_VALUE(visible.scalar_type() == at::kInt, "topk_rows_cuda: visible must be int32, got ",
                    visible.scalar_type());
  TORCH_CHECK_VALUE(visible.dim() == 2 && visible.size(0) == B && visible.size(1) == S,
                    "topk_rows_cuda: visible must be [B, S] = [", num(B), ", ", num(S), "] of scores, got shape ",
                    shape(visible.sizes()));
  TORCH_CHECK_VALUE(visible.device() == scores.device(), "topk_rows_cuda: visible must be on scores' device ",
                    scores.device(), ", got ", visible.device());

  const c10::cuda::CUDAGuard guard(scores.device());
  at::Tensor out = at::empty({B, S, topk}, scores.options().dtype(at::kInt));
  if (B == 0 || S == 0) return out;
  const cudaError_t err = dsv4::topk_rows(
      scores.data_ptr<float>(), scores.stride(0), scores.stride(1), visible.data_ptr<int32_t>(), visible.stride(0),
      visible.stride(1), out.data_ptr<int32_t>(), out.stride(0), out.stride(1), out.stride(2), B, S,
      static_cast<int>(N), static_cast<int>(topk), c10::cuda::getCurrentCUDAStream(scores.get_device()).stream());
  TORCH_CHECK(err == cudaSuccess, "topk_rows_cuda: the kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

// (pt2_compliant_tag: as torch.library.custom_op tags the Python ops; tests/ops/indexer_topk/test_topk_rows_cuda.py opchecks it)
TORCH_LIBRARY_FRAGMENT(dsv4, m) {
  m.def("topk_rows_cuda(Tensor scores, Tensor visible, int topk) -> Tensor", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) {
  m.impl("topk_rows_cuda", &topk_rows_cuda);
}
