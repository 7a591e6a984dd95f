// Row softmax: one block per row; max, then sum of exp(x - max), then normalise (three passes over the row).
#include <torch/extension.h>

#define THREADS 256  // a power of two: the tree reductions below halve it

// Block-wide reductions over THREADS threads; buf is THREADS floats of shared memory, free again on return.
__device__ float block_sum(float v, float* buf) {
    const int t = threadIdx.x;
    buf[t] = v;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (t < s) buf[t] += buf[t + s];
        __syncthreads();
    }
    const float total = buf[0];
    __syncthreads();
    return total;
}

__device__ float block_max(float v, float* buf) {
    const int t = threadIdx.x;
    buf[t] = v;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (t < s) buf[t] = fmaxf(buf[t], buf[t + s]);
        __syncthreads();
    }
    const float best = buf[0];
    __syncthreads();
    return best;
}

__device__ float block_min(float v, float* buf) {
    const int t = threadIdx.x;
    buf[t] = v;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (t < s) buf[t] = fminf(buf[t], buf[t + s]);
        __syncthreads();
    }
    const float best = buf[0];
    __syncthreads();
    return best;
}

__global__ void softmax_kernel(const float* __restrict__ x, float* __restrict__ out, int64_t cols) {
    __shared__ float buf[THREADS];
    const float* row = x + (int64_t)blockIdx.x * cols;
    float* orow = out + (int64_t)blockIdx.x * cols;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < cols; j += THREADS) m = fmaxf(m, row[j]);
    m = block_max(m, buf);
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < cols; j += THREADS) s += expf(row[j] - m);
    s = block_sum(s, buf);
    const float inv = 1.0f / s;
    for (int64_t j = threadIdx.x; j < cols; j += THREADS) orow[j] = expf(row[j] - m) * inv;
}

torch::Tensor forward(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32, "x must be a float32 CUDA tensor");
    TORCH_CHECK(x.dim() == 2, "x must be 2-D (rows, cols)");
    x = x.contiguous();
    const int64_t rows = x.size(0), cols = x.size(1);
    auto out = torch::empty_like(x);
    if (rows == 0 || cols == 0) return out;
    softmax_kernel<<<(unsigned)rows, THREADS>>>(x.data_ptr<float>(), out.data_ptr<float>(), cols);
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
