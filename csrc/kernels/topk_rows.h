// The CUDA top-k of fp32 score rows (the lightning indexer's selection): the kernel's entry point
// (topk_rows.cu) and what one launch serves. No torch here, so that the kernel builds with nvcc
// alone; the torch op that launches it is topk_rows_op.cpp.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace dsv4 {

// Rows of 1 .. kTopkRowsMaxEntries scores (64 a thread of a 512-thread block) and 1 .. kTopkRowsMaxTopk
// picks a row (what the sort holds in shared memory). dsv4_ops/ops/topk_cuda.py mirrors both
// (MAX_ENTRIES, MAX_TOPK; tests/ops/indexer_topk/test_topk_rows_cuda_build.py checks that they agree).
constexpr int kTopkRowsMaxEntries = 32768;
constexpr int kTopkRowsMaxTopk = 2048;

// For every row (b, s) of scores [B, S, N] (strides in elements; the last dim contiguous):
// out[b, s, :] = the min(topk, visible) best of the row's first visible[b, s] entries (clamped to
// [0, N]) in descending score order, ties to the lower index, then -1. Scores compare by an
// order-preserving uint32 key (-0.0 == +0.0). Launched on `stream`, on the current device.
// Returns cudaSuccess (also for no rows), cudaErrorInvalidValue when N or topk is outside the
// limits above or B * S is past one grid, else the launch's error.
cudaError_t topk_rows(const float* scores, int64_t ss_b, int64_t ss_s, const int* visible, int64_t sv_b,
                      int64_t sv_s, int* out, int64_t so_b, int64_t so_s, int64_t so_k, int64_t B, int64_t S,
                      int N, int topk, cudaStream_t stream);

}  // namespace dsv4
