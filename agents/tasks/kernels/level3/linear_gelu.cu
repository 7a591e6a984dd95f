// Fused nn.Linear + exact GELU: out = gelu(x @ weight.T + bias) with gelu(y) = 0.5 y (1 + erf(y / sqrt 2)).
#include <torch/extension.h>

#define TILE 16

// C (M, N) = epilogue(A (M, K) @ W (N, K).T): W is row-major (N, K) like nn.Linear.weight. Block (TILE, TILE)
// computes one TILE x TILE tile of C; tiles of A and W go through shared memory.
__global__ void linear_gelu_kernel(const float* __restrict__ A, const float* __restrict__ W, const float* __restrict__ bias, float* __restrict__ C,
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
        const float y = acc + bias[col];
        C[row * N + col] = 0.5f * y * (1.0f + erff(y * 0.70710678118654752f));
    }
}

torch::Tensor forward(torch::Tensor x, torch::Tensor weight, torch::Tensor bias) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32, "x must be a float32 CUDA tensor");
    TORCH_CHECK(weight.is_cuda() && weight.scalar_type() == torch::kFloat32, "weight must be a float32 CUDA tensor");
    TORCH_CHECK(bias.is_cuda() && bias.scalar_type() == torch::kFloat32, "bias must be a float32 CUDA tensor");
    x = x.contiguous();
    weight = weight.contiguous();
    bias = bias.contiguous();
    TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "need x (M, K) and weight (N, K)");
    TORCH_CHECK(bias.numel() == weight.size(0), "bias must have one entry per output feature");
    const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
    auto out = torch::empty({M, N}, x.options());
    if (M == 0 || N == 0) return out;
    const dim3 block(TILE, TILE);
    const dim3 grid((unsigned)((N + TILE - 1) / TILE), (unsigned)((M + TILE - 1) / TILE));
    linear_gelu_kernel<<<grid, block>>>(x.data_ptr<float>(), weight.data_ptr<float>(), bias.data_ptr<float>(), out.data_ptr<float>(), M, N, K);
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
