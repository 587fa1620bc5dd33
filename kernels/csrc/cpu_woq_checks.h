// The argument checks both kernels on the packed quantized weights share (`cpu_woq_linear.cpp`, AMX, and
// `cpu_woq_gemv.cpp`, VNNI): the layout `kernels/cpu_woq.py: pack_woq` makes, and x / out around it.
#pragma once

#include <ATen/ATen.h>

namespace structgen_cpu {

// Checks x [M, K] bf16 (or fp32 with `allow_fp32`), qweight [N/16, K/32, 16, 16 | 32], scales (and mins at 4
// bits) fp16 [N/16, K/32, 16] and out [M, N] of x's dtype; every message starts with `op`.
inline void check_woq_args(const char* op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const at::Tensor& mins, int64_t bits, const at::Tensor& out, bool allow_fp32 = false) {
  TORCH_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8, got ", bits);
  const bool x_dtype_ok = x.scalar_type() == at::kBFloat16 || (allow_fp32 && x.scalar_type() == at::kFloat);
  TORCH_CHECK(x.dim() == 2 && x_dtype_ok && x.is_contiguous(), op, ": x must be a contiguous ",
              allow_fp32 ? "bf16 or fp32" : "bf16", " [M, K]");
  TORCH_CHECK(qweight.dim() == 4 && qweight.is_contiguous() && qweight.size(2) == 16 &&
                  qweight.size(3) == (bits == 4 ? 16 : 32) &&
                  qweight.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              op, ": qweight must be contiguous ", bits == 4 ? "uint8 [NB, KB, 16, 16]" : "int8 [NB, KB, 16, 32]");
  const int64_t nb = qweight.size(0), kb = qweight.size(1);
  TORCH_CHECK(x.size(1) == kb * 32, op, ": x has K = ", x.size(1), ", the weight ", kb * 32);
  auto check_scales = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 3 && t.size(0) == nb &&
                    t.size(1) == kb && t.size(2) == 16,
                op, ": ", name, " must be contiguous fp16 [NB, KB, 16]");
  };
  check_scales(scales, "scales");
  if (bits == 4) check_scales(mins, "mins");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == nb * 16 && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type(),
              op, ": out must be a contiguous [M, N] of x's dtype");
}

}  // namespace structgen_cpu
