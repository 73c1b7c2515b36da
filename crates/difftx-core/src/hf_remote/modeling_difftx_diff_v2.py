# Written by `difftx export` beside a diff-v2 model (crates/difftx-core/src/hf_remote/).
# Load with transformers' AutoModelForCausalLM and trust_remote_code=True.
"""difftx's diff-v2 (Differential Transformer V2) in PyTorch: training, generate with a KV cache,
SDPA attention. The equations are those of difftx's docs/design.md (section 1.3):

    2H query heads, pairs (2j, 2j+1) sharing one kv head; one causal attention over all of them
    lambda_{t,j} = sigmoid(h_t . W_lambda[j])      (h: the layer's normed input)
    O_j = attn_{2j} - lambda_{t,j} * attn_{2j+1}   (no sub-layer norm, no lambda_init factor)

The rest is a Llama decoder (RMSNorm, RoPE on q and k, SwiGLU MLP, untied or tied head).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_difftx_diff_v2 import DIFFTX_REMOTE_CODE_VERSION, DifftxDiffV2Config


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_angles(config, positions, device):
    """cos, sin of shape [B, T, d/2] at integer positions [B, T] (f32, as difftx computes them)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    angles = positions.float()[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin, style):
    """x: [B, heads, T, d]; cos, sin: [B, T, d/2]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class DiffV2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.d = config.head_dim
        self.n_out = config.num_attention_heads
        self.n_q = 2 * config.num_attention_heads
        self.n_kv = max(config.num_key_value_heads // 2, 1)
        if self.n_q % self.n_kv or (self.n_q // self.n_kv) % 2:
            raise ValueError("the two query heads of a pair must share a kv head: 2H / kv heads must be even")
        dm = config.hidden_size
        self.q_proj = nn.Linear(dm, self.n_q * self.d, bias=False)
        self.k_proj = nn.Linear(dm, self.n_kv * self.d, bias=False)
        self.v_proj = nn.Linear(dm, self.n_kv * self.d, bias=False)
        self.lambda_proj = nn.Linear(dm, self.n_out, bias=False)
        self.o_proj = nn.Linear(self.n_out * self.d, dm, bias=False)

    def forward(self, h, cos, sin, mask, past_key_values=None):
        b, t, _ = h.shape
        q = self.q_proj(h).view(b, t, self.n_q, self.d).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.n_kv, self.d).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.n_kv, self.d).transpose(1, 2)
        q = apply_rope(q, cos, sin, self.config.rope_style)
        k = apply_rope(k, cos, sin, self.config.rope_style)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        group = self.n_q // self.n_kv
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        # One attention over all 2H query heads, [B, 2H, T, d].
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(self.d))
        lam = torch.sigmoid(self.lambda_proj(h)).transpose(1, 2)[..., None]  # [B, H, T, 1]
        o = o[:, 0::2] - lam * o[:, 1::2]  # O_j = attn_{2j} - lambda_{t,j} attn_{2j+1}
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.n_out * self.d))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DiffV2Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, past_key_values=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, past_key_values)
        return x + self.mlp(self.post_attention_layernorm(x))


class DifftxDiffV2PreTrainedModel(PreTrainedModel):
    config_class = DifftxDiffV2Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)


class DifftxDiffV2Model(DifftxDiffV2PreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        if getattr(config, "difftx_remote_code_version", None) != DIFFTX_REMOTE_CODE_VERSION:
            raise ValueError(
                f"config.json was written for difftx remote code version "
                f"{getattr(config, 'difftx_remote_code_version', None)}, this code is version {DIFFTX_REMOTE_CODE_VERSION}"
            )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        if kwargs.get("cache") is not None:
            past_key_values = kwargs["cache"]
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, t, _ = x.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=x.device)[None].expand(b, t)
        cos, sin = rope_angles(self.config, position_ids, x.device)
        # Causal mask over the cached and new positions, and the padding of attention_mask.
        s = past + t
        allowed = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(diagonal=past)[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, None, :s].bool()
        for layer in self.layers:
            x = layer(x, cos, sin, allowed, past_key_values if use_cache else None)
        return self.norm(x), (past_key_values if use_cache else None)


class DifftxDiffV2ForCausalLM(DifftxDiffV2PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = DifftxDiffV2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        # transformers 5 passes the KV cache as `cache`, 4.x as `past_key_values`.
        if kwargs.get("cache") is not None:
            past_key_values = kwargs["cache"]
        h, cache = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) and logits_to_keep > 0 else slice(None)
        logits = self.lm_head(h[:, keep])
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        # The output's cache field is `cache` in transformers 5, `past_key_values` in 4.x.
        field = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{field: cache})
