// SwiGLU MLP in two tiled kernels: h = silu(x @ w1.T) * (x @ w3.T) (both products share the x tile), then
// out = h @ w2.T. Weights are nn.Linear layout (out_features, in_features), row-major.
#include <torch/extension.h>

#define TILE 16

// h (M, H) = silu(x (M, K) @ w1 (H, K).T) * (x @ w3 (H, K).T)
__global__ void swiglu_gate_kernel(const float* __restrict__ X, const float* __restrict__ W1, const float* __restrict__ W3,
                                   float* __restrict__ Hout, int64_t M, int64_t H, int64_t K) {
    __shared__ float Xs[TILE][TILE];
    __shared__ float W1s[TILE][TILE];  // W1s[k][c] = W1[col0 + c][k0 + k]
    __shared__ float W3s[TILE][TILE];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t row = (int64_t)blockIdx.y * TILE + ty;
    const int64_t col = (int64_t)blockIdx.x * TILE + tx;
    float a1 = 0.0f, a3 = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += TILE) {
        Xs[ty][tx] = (row < M && k0 + tx < K) ? X[row * K + k0 + tx] : 0.0f;
        const bool ok = col < H && k0 + ty < K;
        W1s[ty][tx] = ok ? W1[col * K + k0 + ty] : 0.0f;
        W3s[ty][tx] = ok ? W3[col * K + k0 + ty] : 0.0f;
        __syncthreads();
        for (int k = 0; k < TILE; ++k) {
            a1 += Xs[ty][k] * W1s[k][tx];
            a3 += Xs[ty][k] * W3s[k][tx];
        }
        __syncthreads();
    }
    if (row < M && col < H) Hout[row * H + col] = a1 / (1.0f + expf(-a1)) * a3;
}

// out (M, N) = h (M, K) @ w2 (N, K).T
__global__ void swiglu_down_kernel(const float* __restrict__ A, const float* __restrict__ W, float* __restrict__ C,
                                   int64_t M, int64_t N, int64_t K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Ws[TILE][TILE];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t row = (int64_t)blockIdx.y * TILE + ty;
    const int64_t col = (int64_t)blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += TILE) {
        As[ty][tx] = (row < M && k0 + tx < K) ? A[row * K + k0 + tx] : 0.0f;
        Ws[ty][tx] = (col < N && k0 + ty < K) ? W[col * K + k0 + ty] : 0.0f;
        __syncthreads();
        for (int k = 0; k < TILE; ++k) acc += As[ty][k] * Ws[k][tx];
        __syncthreads();
    }
    if (row < M && col < N) C[row * N + col] = acc;
}

torch::Tensor forward(torch::Tensor x, torch::Tensor w1, torch::Tensor w2, torch::Tensor w3) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32, "x must be a float32 CUDA tensor");
    TORCH_CHECK(w1.is_cuda() && w1.scalar_type() == torch::kFloat32, "w1 must be a float32 CUDA tensor");
    TORCH_CHECK(w2.is_cuda() && w2.scalar_type() == torch::kFloat32, "w2 must be a float32 CUDA tensor");
    TORCH_CHECK(w3.is_cuda() && w3.scalar_type() == torch::kFloat32, "w3 must be a float32 CUDA tensor");
    x = x.contiguous();
    w1 = w1.contiguous();
    w2 = w2.contiguous();
    w3 = w3.contiguous();
    TORCH_CHECK(x.dim() == 2 && w1.dim() == 2 && w1.sizes() == w3.sizes() && x.size(1) == w1.size(1), "need x (M, D), w1 and w3 (H, D)");
    TORCH_CHECK(w2.dim() == 2 && w2.size(1) == w1.size(0), "need w2 (D_out, H)");
    const int64_t M = x.size(0), D = x.size(1), H = w1.size(0), N = w2.size(0);
    auto h = torch::empty({M, H}, x.options());
    auto out = torch::empty({M, N}, x.options());
    if (M == 0 || N == 0) return out;
    const dim3 block(TILE, TILE);
    if (H > 0) {
        const dim3 grid_h((unsigned)((H + TILE - 1) / TILE), (unsigned)((M + TILE - 1) / TILE));
        swiglu_gate_kernel<<<grid_h, block>>>(x.data_ptr<float>(), w1.data_ptr<float>(), w3.data_ptr<float>(), h.data_ptr<float>(), M, H, D);
    }
    const dim3 grid_o((unsigned)((N + TILE - 1) / TILE), (unsigned)((M + TILE - 1) / TILE));
    swiglu_down_kernel<<<grid_o, block>>>(h.data_ptr<float>(), w2.data_ptr<float>(), out.data_ptr<float>(), M, N, H);
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
