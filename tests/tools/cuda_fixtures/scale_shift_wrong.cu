// Deliberately WRONG solution for scale_shift.py: y[i, j] = x[i, j] * w[j] + 1.
#include <torch/extension.h>
#include <cuda_runtime.h>

__global__ void scale_shift_kernel(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int64_t n, int64_t cols) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * w[i % cols] + 2.0f;  // deliberately wrong: off by one everywhere
}

torch::Tensor forward(torch::Tensor x, torch::Tensor w) {
    TORCH_CHECK(x.is_cuda() && w.is_cuda(), "inputs must be CUDA tensors");
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    int64_t n = xc.numel();
    const int threads = 256;
    const int blocks = (int)((n + threads - 1) / threads);
    scale_shift_kernel<<<blocks, threads>>>(xc.data_ptr<float>(), w.contiguous().data_ptr<float>(), y.data_ptr<float>(), n, w.numel());
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
