// softmax(q @ k.T / sqrt(d)) per (slice, query row): one block per row; each thread computes the scores of its
// strided keys into the output row, then block max / sum reductions and an in-place normalisation of its own entries.
#include <torch/extension.h>

#define THREADS 128  // a power of two: the tree reductions halve it

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

// grid: (S, BH); q, k: (BH, S, D); out: (BH, S, S)
__global__ void attention_scores_softmax_kernel(const float* __restrict__ q, const float* __restrict__ k, float* __restrict__ out,
                                                int64_t S, int64_t D, float scale) {
    __shared__ float buf[THREADS];
    const int64_t bh = blockIdx.y, i = blockIdx.x;
    const float* qi = q + (bh * S + i) * D;
    const float* kb = k + bh * S * D;
    float* orow = out + (bh * S + i) * S;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < S; j += THREADS) {
        const float* kj = kb + j * D;
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
        const float s = dot * scale;
        orow[j] = s;
        m = fmaxf(m, s);
    }
    m = block_max(m, buf);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < S; j += THREADS) {
        const float e = expf(orow[j] - m);
        orow[j] = e;
        sum += e;
    }
    const float inv = 1.0f / block_sum(sum, buf);
    for (int64_t j = threadIdx.x; j < S; j += THREADS) orow[j] *= inv;
}

torch::Tensor forward(torch::Tensor q, torch::Tensor k) {
    TORCH_CHECK(q.is_cuda() && q.scalar_type() == torch::kFloat32, "q must be a float32 CUDA tensor");
    TORCH_CHECK(k.is_cuda() && k.scalar_type() == torch::kFloat32, "k must be a float32 CUDA tensor");
    q = q.contiguous();
    k = k.contiguous();
    TORCH_CHECK(q.dim() == 3 && q.sizes() == k.sizes(), "need q and k of the same shape (BH, S, D)");
    const int64_t BH = q.size(0), S = q.size(1), D = q.size(2);
    auto out = torch::empty({BH, S, S}, q.options());
    if (BH == 0 || S == 0) return out;
    const dim3 grid((unsigned)S, (unsigned)BH);
    attention_scores_softmax_kernel<<<grid, THREADS>>>(q.data_ptr<float>(), k.data_ptr<float>(), out.data_ptr<float>(), S, D,
                                                       1.0f / sqrtf((float)D));
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
