// Shared by the quantized kernels (quantgemm.cpp, quantlayer.cpp).
#pragma once

#include "rowkernels.h"

namespace specdraft_quant {

// out (M, N) = x (M, K) @ w^T for a packed block-quantized weight (quantgemm.cpp's layout and arithmetic); checks
// that the packed tensor matches K and N.
void multiply(const float* x, int64_t M, int64_t K, const at::Tensor& packed, int64_t kind, int64_t N, float* out,
              bool vnni);

}  // namespace specdraft_quant
