// Fused (x @ weight) * scale + residual: tiled SGEMM with the scale and the residual add in the epilogue.
#include <torch/extension.h>

#define TILE 16

__global__ void matmul_scale_residual_kernel(const float* __restrict__ A, const float* __restrict__ B, const float* __restrict__ R,
                                             float* __restrict__ C, int64_t M, int64_t N, int64_t K, float scale) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t row = (int64_t)blockIdx.y * TILE + ty;
    const int64_t col = (int64_t)blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += TILE) {
        As[ty][tx] = (row < M && k0 + tx < K) ? A[row * K + k0 + tx] : 0.0f;
        Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(k0 + ty) * N + col] : 0.0f;
        __syncthreads();
        for (int k = 0; k < TILE; ++k) acc += As[ty][k] * Bs[k][tx];
        __syncthreads();
    }
    if (row < M && col < N) C[row * N + col] = acc * scale + R[row * N + col];
}

torch::Tensor forward(torch::Tensor x, torch::Tensor residual, torch::Tensor weight) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32, "x must be a float32 CUDA tensor");
    TORCH_CHECK(residual.is_cuda() && residual.scalar_type() == torch::kFloat32, "residual must be a float32 CUDA tensor");
    TORCH_CHECK(weight.is_cuda() && weight.scalar_type() == torch::kFloat32, "weight must be a float32 CUDA tensor");
    x = x.contiguous();
    residual = residual.contiguous();
    weight = weight.contiguous();
    TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(0), "need x (M, K) and weight (K, N)");
    const int64_t M = x.size(0), K = x.size(1), N = weight.size(1);
    TORCH_CHECK(residual.dim() == 2 && residual.size(0) == M && residual.size(1) == N, "residual must be (M, N)");
    auto out = torch::empty({M, N}, x.options());
    if (M == 0 || N == 0) return out;
    const dim3 block(TILE, TILE);
    const dim3 grid((unsigned)((N + TILE - 1) / TILE), (unsigned)((M + TILE - 1) / TILE));
    matmul_scale_residual_kernel<<<grid, block>>>(x.data_ptr<float>(), weight.data_ptr<float>(), residual.data_ptr<float>(),
                                                  out.data_ptr<float>(), M, N, K, 0.5f);
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
