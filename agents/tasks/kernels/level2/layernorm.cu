// LayerNorm over rows (eps 1e-5): one block per row; mean, then biased variance of (x - mean), then the affine map.
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

__global__ void layernorm_kernel(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                                 float* __restrict__ out, int64_t cols, float eps) {
    __shared__ float buf[THREADS];
    const float* row = x + (int64_t)blockIdx.x * cols;
    float* orow = out + (int64_t)blockIdx.x * cols;
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < cols; j += THREADS) s += row[j];
    const float mean = block_sum(s, buf) / (float)cols;
    float q = 0.0f;
    for (int64_t j = threadIdx.x; j < cols; j += THREADS) {
        const float d = row[j] - mean;
        q += d * d;
    }
    const float var = block_sum(q, buf) / (float)cols;
    const float inv = rsqrtf(var + eps);
    for (int64_t j = threadIdx.x; j < cols; j += THREADS) orow[j] = (row[j] - mean) * inv * w[j] + b[j];
}

torch::Tensor forward(torch::Tensor x, torch::Tensor weight, torch::Tensor bias) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32, "x must be a float32 CUDA tensor");
    TORCH_CHECK(x.dim() == 2, "x must be 2-D (rows, cols)");
    x = x.contiguous();
    const int64_t rows = x.size(0), cols = x.size(1);
    TORCH_CHECK(weight.is_cuda() && weight.scalar_type() == torch::kFloat32 && weight.numel() == cols, "weight must be float32 CUDA, one per column");
    TORCH_CHECK(bias.is_cuda() && bias.scalar_type() == torch::kFloat32 && bias.numel() == cols, "bias must be float32 CUDA, one per column");
    weight = weight.contiguous();
    bias = bias.contiguous();
    auto out = torch::empty_like(x);
    if (rows == 0 || cols == 0) return out;
    layernorm_kernel<<<(unsigned)rows, THREADS>>>(x.data_ptr<float>(), weight.data_ptr<float>(), bias.data_ptr<float>(),
                                                  out.data_ptr<float>(), cols, 1e-5f);
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
