// Matrix-vector product: one block of THREADS threads per output row, strided dot products, tree reduction.
#include <torch/extension.h>

#define THREADS 256  // a power of two: the tree reduction halves it

__global__ void matvec_kernel(const float* __restrict__ A, const float* __restrict__ v, float* __restrict__ out, int64_t K) {
    __shared__ float buf[THREADS];
    const int t = threadIdx.x;
    const float* row = A + (int64_t)blockIdx.x * K;
    float acc = 0.0f;
    for (int64_t j = t; j < K; j += THREADS) acc += row[j] * v[j];
    buf[t] = acc;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (t < s) buf[t] += buf[t + s];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = buf[0];
}

torch::Tensor forward(torch::Tensor a, torch::Tensor v) {
    TORCH_CHECK(a.is_cuda() && a.scalar_type() == torch::kFloat32, "a must be a float32 CUDA tensor");
    TORCH_CHECK(v.is_cuda() && v.scalar_type() == torch::kFloat32, "v must be a float32 CUDA tensor");
    a = a.contiguous();
    v = v.contiguous();
    TORCH_CHECK(a.dim() == 2 && v.dim() == 2 && v.size(1) == 1 && a.size(1) == v.size(0), "need a (M, K) and v (K, 1)");
    const int64_t M = a.size(0), K = a.size(1);
    auto out = torch::empty({M, 1}, a.options());
    if (M == 0) return out;
    matvec_kernel<<<(unsigned)M, THREADS>>>(a.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(), K);
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
