// Batched tiled SGEMM: C[b] = A[b] @ B[b]; blockIdx.z is the batch index.
#include <torch/extension.h>

#define TILE 16

__global__ void bmm_kernel(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                           int64_t M, int64_t N, int64_t K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    const int64_t batch = blockIdx.z;
    A += batch * M * K;
    B += batch * K * N;
    C += batch * M * N;
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
    if (row < M && col < N) C[row * N + col] = acc;
}

torch::Tensor forward(torch::Tensor a, torch::Tensor b) {
    TORCH_CHECK(a.is_cuda() && a.scalar_type() == torch::kFloat32, "a must be a float32 CUDA tensor");
    TORCH_CHECK(b.is_cuda() && b.scalar_type() == torch::kFloat32, "b must be a float32 CUDA tensor");
    a = a.contiguous();
    b = b.contiguous();
    TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(1), "need a (B, M, K) and b (B, K, N)");
    const int64_t Bn = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
    auto c = torch::empty({Bn, M, N}, a.options());
    if (Bn == 0 || M == 0 || N == 0) return c;
    const dim3 block(TILE, TILE);
    const dim3 grid((unsigned)((N + TILE - 1) / TILE), (unsigned)((M + TILE - 1) / TILE), (unsigned)Bn);
    bmm_kernel<<<grid, block>>>(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), M, N, K);
    return c;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
