"""A lean forward for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over ``kv_pools``, decode rows and prompt chunks in one pass.

Why not the transformers forward: at batch 1 on CPU, SmolLM2's step spent more time in per-module
Python, mask building and dispatch than in arithmetic, its CPU SDPA is 5-10× slower than two
batched GEMMs for one query token, and its cache concatenates or copies per step. Here each layer is
a fixed list of tensor ops on token-major ``(N, hidden)`` activations, where the N tokens are every
decode row of the step followed by the prompt chunks being prefilled, so one pass over the weights
serves both (SGLang's mixed chunked prefill):

    x = x + o(attn(rope(qkv(norm(x)))))        qkv: one fused GEMM for q, k and v
    x = x + down(silu(gate) * up)

The residual adds, the gate's SiLU and the × up run in the GEMMs' epilogues (oneDNN post-ops), not as passes
of their own; with adapters in the batch, the gate and up deltas go in before the activation, so there the
activation is a separate pass.

Weights are fused and prepacked for oneDNN once at load (``cpu_linear.pack``; bf16 on CPUs with native
bf16, where oneDNN's packed GEMM is 1.6-3.7× faster than ``F.linear`` on SmolLM2's decode shapes).
Decode attention per pool: scores ``q @ K^T`` as one batched GEMM over all rows and kv heads (query
heads grouped per kv head, so K is never repeated), masked by each row's length, softmax in fp32,
then ``P @ V``. Prompt chunks attend over their staging buffer (causal, offset by the chunk's start) through
``scaled_dot_product_attention``. On CPUs with AVX512-BF16 and no AMX (bf16 models), both attentions, the
RMSNorms and the rotary pass go through the compiled kernels of ``cpu_kernels`` instead (the decode kernel also
writes the step's keys and values into the pools, where the PyTorch path uses ``index_copy_``). The arithmetic follows
transformers' modules op for op (RMSNorm in fp32, rotary in the model dtype, HF's rotary module for every rope
type's angles), so logits match the transformers forward to rounding.

LoRA: ``LoraBank.add`` adds each token's adapter delta to the matching column slice of the fused
outputs (q/k/v of qkv) or to the output (o, gate, up, down: o's and down's after the residual, which is the same sum).

Not here: sliding-window attention, models whose layers differ from this shape (``fits`` says which;
the engine serves those through ``hf_runner``), tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.engines import cpu_kernels
from runtime.engines.cpu_linear import Packed, cpu_flags, pack
from runtime.engines.kv_pools import KVPools, Staging
from runtime.engines.lora_batch import LoraBank
from runtime.engines.runner import Chunk, DecodeRow, LogitsOf

_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def fits(model: nn.Module, max_len: int) -> str | None:
    """None when ``LlamaRunner`` can serve ``model`` exactly; else why not."""
    name = type(model).__name__
    if name not in _ARCHS:
        return f"{name} is not one of {sorted(_ARCHS)}"
    cfg: Any = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act}"
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", True) and window < max_len:
        return f"sliding window {window} < context {max_len}"
    if getattr(cfg, "layer_types", None) and any(t != "full_attention" for t in cfg.layer_types):
        return "layers other than full attention"
    return None


def _has_amx() -> bool:
    """Whether the CPU has AMX (``amx_bf16`` among its flags); False where they cannot be read."""
    return "amx_bf16" in cpu_flags()


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm bit for bit: normalise in fp32, cast back, then scale."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


@dataclass
class _Layer:
    name: str  # module path prefix, for LoRA sites: "model.layers.3"
    ln1: torch.Tensor
    ln2: torch.Tensor
    eps: float
    qkv: Packed
    o: Packed
    gate: Packed
    up: Packed
    down: Packed
    q_norm: tuple[torch.Tensor, float] | None  # Qwen3's per-head RMSNorm on q and k
    k_norm: tuple[torch.Tensor, float] | None


def _norm_of(module: Any) -> tuple[torch.Tensor, float]:
    return module.weight.detach(), float(module.variance_epsilon)


class LlamaRunner:
    name = "llama"

    def __init__(self, model: nn.Module, bank: LoraBank, max_len: int, *, first_cap: int = 64) -> None:
        cfg: Any = model.config  # a transformers config: attributes by architecture
        self.bank = bank
        self.dtype = next(model.parameters()).dtype
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.group = self.n_heads // self.n_kv
        self.vocab = int(cfg.vocab_size)
        names = {id(m): n for n, m in model.named_modules()}
        inner: Any = model.model
        self.scale = float(inner.layers[0].self_attn.scaling)
        self.embed = inner.embed_tokens.weight.detach()
        self.rotary = inner.rotary_emb
        self.final_norm = _norm_of(inner.norm)
        self.lm_head = pack([model.lm_head])  # type: ignore[list-item]  # an nn.Linear on every Llama-family model
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            eps = float(layer.input_layernorm.variance_epsilon)
            self.layers.append(
                _Layer(
                    name=names[id(layer)],
                    ln1=layer.input_layernorm.weight.detach(),
                    ln2=layer.post_attention_layernorm.weight.detach(),
                    eps=eps,
                    qkv=pack([att.q_proj, att.k_proj, att.v_proj]),
                    o=pack([att.o_proj]),
                    gate=pack([mlp.gate_proj]),
                    up=pack([mlp.up_proj]),
                    down=pack([mlp.down_proj]),
                    q_norm=_norm_of(att.q_norm) if hasattr(att, "q_norm") else None,
                    k_norm=_norm_of(att.k_norm) if hasattr(att, "k_norm") else None,
                )
            )
        self._max_len, self._first_cap = max_len, first_cap
        # a prompt chunk's attention in float32 where bf16 has no matrix unit (AVX512-BF16 without AMX): PyTorch's CPU
        # flash attention there took 1.22 s in bf16 and 0.70 s in fp32 for a 2,048-token prompt (SmolLM2, 2 threads)
        cpu_bf16 = self.dtype == torch.bfloat16 and self.embed.device.type == "cpu"
        self.chunk_attn_dtype = torch.float32 if cpu_bf16 and not _has_amx() else self.dtype
        # there, rather: the compiled kernels with the CPU's bf16 pair dot products, for prompt chunks (16 vs 40 ms a layer at
        # 1,990 tokens) and decode rows (reading each row's live keys only: 18 vs 44 ms for 64 rows of 150 tokens, 30 layers)
        self.kernels = cpu_kernels.ops() if cpu_bf16 and cpu_kernels.takes(self.head_dim, self.dtype) else None
        self.kv = KVPools(len(self.layers), self.n_kv, self.head_dim, self.dtype, max_len, first_cap)
        self._staging: dict[Hashable, Staging] = {}
        self.scored: dict[Hashable, LogitsOf] = {}

    def reset(self) -> None:
        """Forget every sequence (after a failed step left the cache in an unknown state)."""
        self.kv = KVPools(len(self.layers), self.n_kv, self.head_dim, self.dtype, self._max_len, self._first_cap)
        self._staging = {}
        self.scored = {}

    # ---- Runner protocol ----------------------------------------------------------------------
    def begin(self, key: Hashable, prompt_len: int) -> None:
        self._staging[key] = self.kv.staging(prompt_len)

    def release(self, key: Hashable) -> None:
        if self._staging.pop(key, None) is None and key in self.kv.where:
            self.kv.release(key)

    def step(self, decode: Sequence[DecodeRow], chunks: Sequence[Chunk]) -> torch.Tensor:
        self.scored = {}
        for row in decode:
            self.kv.make_room(row.key)
        by_key = {row.key: row for row in decode}
        pools = self.kv.active()
        if len(by_key) != len(decode) or len(decode) != sum(p.rows for p in pools) or any(k not in by_key for p in pools for k in p.owners):
            raise RuntimeError("every joined sequence decodes in every step: the decode rows and the KV pools disagree")
        order: list[DecodeRow] = [by_key[k] for p in pools for k in p.owners]  # the forward's decode order: pool by pool
        ids: list[int] = [r.token for r in order]
        positions: list[int] = [n for p in pools for n in p.lengths]
        for c in chunks:
            ids.extend(c.ids)
            positions.extend(range(c.start, c.start + len(c.ids)))
        counts = [1] * len(order) + [len(c.ids) for c in chunks]
        adapters = [r.adapter for r in order] + [c.adapter for c in chunks]
        with self.bank.rows(adapters, counts=counts):
            hidden = self._forward(torch.tensor(ids), torch.tensor(positions), pools, chunks)  # (N, hidden)
        # logits rows: decode rows in the caller's order, then each last chunk's final position
        where = {r.key: i for i, r in enumerate(order)}
        pick = [where[r.key] for r in decode]
        end = len(order)
        for c in chunks:
            end += len(c.ids)
            if c.last:
                pick.append(end - 1)
            if c.score:
                self.scored[c.key] = self._logits_of(hidden[end - len(c.ids) : end])
        for p in pools:
            self.kv.advance(p)
        for c in chunks:
            st = self._staging[c.key]
            st.filled = c.start + len(c.ids)
            if c.last:
                self.kv.join(c.key, self._staging.pop(c.key))
        if not pick:
            return torch.empty(0, self.vocab)
        x = self._rms(hidden[torch.tensor(pick)], *self.final_norm)
        return self.lm_head(x)

    def _logits_of(self, hidden: torch.Tensor) -> LogitsOf:
        """A scored chunk's logits from its hidden states ``(n, hidden)``, computed per position range when asked."""

        def rows(lo: int, hi: int) -> torch.Tensor:
            out: torch.Tensor = self.lm_head(self._rms(hidden[lo:hi], *self.final_norm))
            return out

        return rows

    # ---- the forward ------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.kernels is not None and x.dtype == torch.bfloat16 and x.shape[-1] % 16 == 0:
            return self.kernels.rms_norm(x, weight, eps)  # the same bf16 numbers as _rms, in one pass
        return _rms(x, weight, eps)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, pools: list[Any], chunks: Sequence[Chunk]) -> torch.Tensor:
        H, K, D, G = self.n_heads, self.n_kv, self.head_dim, self.group
        x = F.embedding(ids, self.embed)  # (N, hidden)
        cos, sin = self.rotary(x[None], positions[None])  # (1, N, D) each
        fused_rope = self.kernels.rope_ if self.kernels is not None and x.dtype == torch.bfloat16 else None
        if fused_rope is not None:
            rot = (cos[0].contiguous(), sin[0].contiguous())  # (N, D) each
        else:
            cos = cos[0, :, None, :]  # (N, 1, D)
            # rotate_half(x) * sin == roll(x, D/2) * (sin with its first half negated), exactly (negation is exact)
            sin = torch.cat((-sin[0, :, None, : D // 2], sin[0, :, None, D // 2 :]), dim=-1)
        # per pool: where its rows write this step (flat row indices into the (rows * K * cap, D) view of a
        # layer's buffer), and which columns each row may attend to
        pool_io = []
        for p in pools:
            n = p.rows
            lengths = torch.tensor(p.lengths)
            by_torch = None  # the kernel writes and masks by the lengths
            if self.kernels is None:
                flat = ((torch.arange(n)[:, None] * K + torch.arange(K)[None, :]) * p.cap + lengths[:, None]).view(-1)  # (n K,)
                mask = torch.zeros(n, 1, p.cap).masked_fill_((torch.arange(p.cap)[None, :] > lengths[:, None])[:, None, :], float("-inf"))
                by_torch = (flat, mask)
            pool_io.append((p, n, lengths, by_torch))
        chunk_io = []
        for c in chunks:
            st = self._staging[c.key]
            n, end = len(c.ids), c.start + len(c.ids)
            causal = None if c.start == 0 else torch.arange(end)[None, :] <= torch.arange(c.start, end)[:, None]  # (n, end)
            chunk_io.append((st, c.start, n, end, causal))
        lora = self.bank.plan is not None
        qk_width = (H + K) * D
        for li, layer in enumerate(self.layers):
            h = self._rms(x, layer.ln1, layer.eps)
            qkv = layer.qkv(h)  # (N, (H + 2K) D)
            if lora:
                self.bank.add(f"{layer.name}.self_attn.q_proj", h, qkv[:, : H * D])
                self.bank.add(f"{layer.name}.self_attn.k_proj", h, qkv[:, H * D : qk_width])
                self.bank.add(f"{layer.name}.self_attn.v_proj", h, qkv[:, qk_width:])
            qk = qkv[:, :qk_width].view(-1, H + K, D)
            if layer.q_norm is not None and layer.k_norm is not None:
                qk = torch.cat([_rms(qk[:, :H], *layer.q_norm), _rms(qk[:, H:], *layer.k_norm)], dim=1)
            if fused_rope is not None:
                fused_rope(qk, *rot, H + K)  # in place: qkv's q and k columns
            else:
                qk = qk * cos + torch.roll(qk, D // 2, dims=-1) * sin  # (N, H + K, D), transformers' rotary
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, qk_width:].view(-1, K, D)
            outs = []
            off = 0
            for p, n, lengths, by_torch in pool_io:
                kb, vb = p.k[li], p.v[li]
                if by_torch is None:  # the kernel writes each row's key and value at its length, then reads its keys up to it
                    assert self.kernels is not None
                    outs.append(self.kernels.decode(q[off : off + n], kb, vb, lengths, self.scale, k[off : off + n], v[off : off + n]).view(n, H * D))
                    off += n
                    continue
                flat, mask = by_torch
                kb.view(-1, D).index_copy_(0, flat, k[off : off + n].reshape(-1, D))
                vb.view(-1, D).index_copy_(0, flat, v[off : off + n].reshape(-1, D))
                qg = q[off : off + n].reshape(n * K, G, D)
                s = torch.bmm(qg, kb[:n].view(n * K, p.cap, D).transpose(1, 2))  # (n K, G, cap)
                s = s.view(n, K * G, p.cap).float().mul_(self.scale).add_(mask)
                prob = torch.softmax(s, dim=-1).to(self.dtype).view(n * K, G, p.cap)
                outs.append(torch.bmm(prob, vb[:n].view(n * K, p.cap, D)).view(n, H * D))
                off += n
            for st, start, n, end, causal in chunk_io:
                st.k[li][:, start:end] = k[off : off + n].transpose(0, 1)
                st.v[li][:, start:end] = v[off : off + n].transpose(0, 1)
                if self.kernels is not None:
                    outs.append(self.kernels.prompt(q[off : off + n], st.k[li], st.v[li], start, self.scale).view(n, H * D))
                    off += n
                    continue
                at = self.chunk_attn_dtype
                o = F.scaled_dot_product_attention(
                    q[off : off + n].transpose(0, 1)[None].to(at),  # (1, H, n, D)
                    st.k[li][None, :, :end].to(at),
                    st.v[li][None, :, :end].to(at),
                    attn_mask=causal,
                    is_causal=causal is None,
                    scale=self.scale,
                    enable_gqa=G > 1,
                )
                outs.append(o[0].transpose(0, 1).reshape(n, H * D).to(x.dtype))
                off += n
            attn = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = layer.o.add(attn, x)  # the residual in the GEMM's epilogue
            if lora:
                self.bank.add(f"{layer.name}.self_attn.o_proj", attn, x)
            h = self._rms(x, layer.ln2, layer.eps)
            if lora:  # the adapters' deltas go in before the activation
                gate, up = layer.gate(h), layer.up(h)
                self.bank.add(f"{layer.name}.mlp.gate_proj", h, gate)
                self.bank.add(f"{layer.name}.mlp.up_proj", h, up)
                act = F.silu(gate) * up
            else:
                act = layer.up.mul(h, layer.gate.silu(h))  # silu(gate) and × up in the GEMMs' epilogues
            x = layer.down.add(act, x)
            if lora:
                self.bank.add(f"{layer.name}.mlp.down_proj", act, x)
        return x
