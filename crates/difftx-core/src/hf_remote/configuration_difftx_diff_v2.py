# Written by `difftx export` beside a diff-v2 model (crates/difftx-core/src/hf_remote/).
# Load with transformers' AutoConfig / AutoModelForCausalLM and trust_remote_code=True.
"""Configuration of difftx's diff-v2 (Differential Transformer V2) language model."""

from transformers import PretrainedConfig

# Bumped whenever the modeling code changes what a checkpoint means; difftx refuses folders
# whose config.json names another version.
DIFFTX_REMOTE_CODE_VERSION = 1


class DifftxDiffV2Config(PretrainedConfig):
    """Head counts are in baseline terms, as in difftx: the model has 2 * num_attention_heads
    query heads (pairs (2j, 2j+1)), max(num_key_value_heads // 2, 1) key/value heads and
    num_attention_heads output heads of width head_dim."""

    model_type = "difftx_diff_v2"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=256,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=None,
        head_dim=None,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_style="interleaved",
        initializer_range=0.02,
        tie_word_embeddings=False,
        use_cache=True,
        difftx_remote_code_version=DIFFTX_REMOTE_CODE_VERSION,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads if head_dim is None else head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        if rope_style not in ("interleaved", "rotate_half"):
            raise ValueError(f"rope_style must be 'interleaved' or 'rotate_half', got {rope_style!r}")
        self.rope_style = rope_style
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.difftx_remote_code_version = difftx_remote_code_version
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
