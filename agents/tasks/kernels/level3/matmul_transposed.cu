// Tiled SGEMM with the second operand transposed: C = A @ B.T, B stored (N, K) row-major.
#include <torch/extension.h>

#define TILE 16

// C (M, N) = epilogue(A (M, K) @ W (N, K).T): W is row-major (N, K) like nn.Linear.weight. Block (TILE, TILE)
// computes one TILE x TILE tile of C; tiles of A and W go through shared memory.
__global__ void matmul_nt_kernel(const float* __restrict__ A, const float* __restrict__ W, float* __restrict__ C,
                                 int64_t M, int64_t N, int64_t K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Ws[TILE][TILE];  // Ws[k][c] = W[col0 + c][k0 + k]
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t row = (int64_t)blockIdx.y * TILE + ty;
    const int64_t col = (int64_t)blockIdx.x * TILE + tx;
    const int64_t wrow = (int64_t)blockIdx.x * TILE + tx;  // the W row (output column) this thread loads
    float acc = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += TILE) {
        As[ty][tx] = (row < M && k0 + tx < K) ? A[row * K + k0 + tx] : 0.0f;
        Ws[ty][tx] = (wrow < N && k0 + ty < K) ? W[wrow * K + k0 + ty] : 0.0f;
        __syncthreads();
        for (int k = 0; k < TILE; ++k) acc += As[ty][k] * Ws[k][tx];
        __syncthreads();
    }
    if (row < M && col < N) {
        C[row * N + col] = acc;
    }
}

torch::Tensor forward(torch::Tensor a, torch::Tensor b) {
    TORCH_CHECK(a.is_cuda() && a.scalar_type() == torch::kFloat32, "a must be a float32 CUDA tensor");
    TORCH_CHECK(b.is_cuda() && b.scalar_type() == torch::kFloat32, "b must be a float32 CUDA tensor");
    a = a.contiguous();
    b = b.contiguous();
    TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1), "need a (M, K) and b (N, K)");
    const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
    auto c = torch::empty({M, N}, a.options());
    if (M == 0 || N == 0) return c;
    const dim3 block(TILE, TILE);
    const dim3 grid((unsigned)((N + TILE - 1) / TILE), (unsigned)((M + TILE - 1) / TILE));
    matmul_nt_kernel<<<grid, block>>>(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), M, N, K);
    return c;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
