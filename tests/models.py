"""Tiny random-weight models built from configs, one per supported family (no downloads)."""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 97


def _seq2seq_config(cls, d_model=32, ffn=48, **extra):
    return cls(vocab_size=VOCAB, d_model=d_model, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, max_position_embeddings=64,
               pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, **extra)


def t5_config(cls=tf.T5Config, **extra):
    """Odd sizes (head dim 7, inner dim 21 != d_model 30), few buckets and a
    short max distance so that short inputs reach the logarithmic buckets; the decoder starts from pad (T5's)."""
    settings = dict(vocab_size=VOCAB, d_model=30, d_kv=7, d_ff=45, num_layers=2, num_heads=3,
                    relative_attention_num_buckets=8, relative_attention_max_distance=12, dropout_rate=0.0,
                    pad_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return cls(**{**settings, **extra})


def lively_t5(model):
    """T5's init (embeddings of std 1, tied to the LM head) makes a tiny random model repeat one token (mostly
    the padding id it starts from); a smaller embedding and larger layers and position biases make its
    outputs vary more, so that generation tests see different tokens, EOS and the far position buckets."""
    with torch.no_grad():
        model.shared.weight.mul_(0.1)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not model.lm_head:
                module.weight.mul_(2.5)
            elif isinstance(module, torch.nn.Embedding) and module is not model.shared:
                module.weight.mul_(12.0)  # relative_attention_bias
        # Logits of a few tens, not hundreds: fp32 rounding differences stay within the tests' tolerances.
        model.decoder.final_layer_norm.weight.mul_(0.1)
    return model


SEQ2SEQ = ("bart", "mbart", "marian", "t5", "mt5", "m2m_100", "pegasus")
DECODER_ONLY = ("gpt2", "llama", "mistral", "qwen2")

BUILDERS = {
    "bart": lambda: tf.BartForConditionalGeneration(_seq2seq_config(tf.BartConfig, activation_function="gelu")),
    "mbart": lambda: tf.MBartForConditionalGeneration(_seq2seq_config(tf.MBartConfig, activation_function="gelu")),
    "marian": lambda: tf.MarianMTModel(_seq2seq_config(tf.MarianConfig, activation_function="swish",
                                                       scale_embedding=True)),
    # T5 with its tied, scaled LM head and ReLU; mT5 with gated-GELU (T5 v1.1, no scaling).
    "t5": lambda: lively_t5(tf.T5ForConditionalGeneration(t5_config())),
    "mt5": lambda: lively_t5(tf.MT5ForConditionalGeneration(t5_config(tf.MT5Config, feed_forward_proj="gated-gelu"))),
    "m2m_100": lambda: tf.M2M100ForConditionalGeneration(_seq2seq_config(tf.M2M100Config, d_model=36, ffn=45,
                                                                         activation_function="relu",
                                                                         scale_embedding=True)),
    "pegasus": lambda: tf.PegasusForConditionalGeneration(_seq2seq_config(tf.PegasusConfig, d_model=36, ffn=45,
                                                                          activation_function="gelu",
                                                                          scale_embedding=True)),
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                    pad_token_id=0, bos_token_id=2, eos_token_id=2)),
    "bert": lambda: tf.BertModel(tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=48,
                                               max_position_embeddings=64)),
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                        num_attention_heads=4, num_key_value_heads=2,
                                                        intermediate_size=48, max_position_embeddings=64,
                                                        pad_token_id=0)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                              num_attention_heads=4, num_key_value_heads=1,
                                                              intermediate_size=48, max_position_embeddings=64,
                                                              pad_token_id=0, sliding_window=6)),
    # Qwen2: layer 0 full attention, layer 1 a window of 5 (max_window_layers), shorter than most test prompts.
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                        num_attention_heads=4, num_key_value_heads=2,
                                                        intermediate_size=48, max_position_embeddings=64,
                                                        pad_token_id=0, use_sliding_window=True, sliding_window=5,
                                                        max_window_layers=1)),
}

# Decoder-only families of issue 20: head dims that are not powers of two, grouped-query attention, and
# sliding windows shorter than the test prompts where the family has them.
_ROTARY = dict(vocab_size=VOCAB, num_hidden_layers=2, intermediate_size=40, max_position_embeddings=64,
               pad_token_id=0, bos_token_id=2, eos_token_id=1)
DECODER_FAMILIES = {
    "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(vocab_size=VOCAB, hidden_size=36, num_hidden_layers=2,
                                                  num_attention_heads=3, ffn_dim=40, max_position_embeddings=64,
                                                  word_embed_proj_dim=36, pad_token_id=1, bos_token_id=2,
                                                  eos_token_id=2)),
    "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=40, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64, rotary_pct=0.4, use_parallel_residual=True, bos_token_id=2, eos_token_id=1,
        pad_token_id=0)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                                                     partial_rotary_factor=0.5, sliding_window=7, **_ROTARY)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                                        head_dim=12, **_ROTARY)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
                                                        head_dim=12, **_ROTARY)),
    # Small caps so that soft-capping changes the scores and logits of random weights.
    "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=12, query_pre_attn_scalar=10,
        sliding_window=5, attn_logit_softcapping=0.05, final_logit_softcapping=3.0,
        **{**_ROTARY, "num_hidden_layers": 3})),
    "gemma3_text": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=12, query_pre_attn_scalar=10,
        sliding_window=5, sliding_window_pattern=2, final_logit_softcapping=3.0,
        **{**_ROTARY, "num_hidden_layers": 3})),
}
BUILDERS.update(DECODER_FAMILIES)
DECODER_ONLY += tuple(DECODER_FAMILIES)


def build(family: str, seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = BUILDERS[family]().eval().to(dtype)
    # Random init leaves LayerNorm at identity; perturb every parameter so norms are really tested.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
        bias = getattr(model, "final_logits_bias", None)  # a buffer (BART family), zeros as built
        if bias is not None:
            bias.add_(torch.randn_like(bias) * 0.02)
    return model


def padded_batch(family: str, batch: int, length: int, seed: int = 0, left_pad: bool | None = None):
    """Random ids with ragged lengths; decoder-only families pad on the left, others on the right."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    if left_pad is None:
        left_pad = family in DECODER_ONLY
    for row in range(1, batch):
        pad = int(torch.randint(0, length // 2 + 1, (1,), generator=gen))
        if pad:
            if left_pad:
                mask[row, :pad] = 0
                ids[row, :pad] = 0 if family != "bert" else 0
            else:
                mask[row, length - pad:] = 0
                ids[row, length - pad:] = 1
    return ids, mask


def forward_logits(model, family, ids, mask, **extra):
    kwargs = dict(input_ids=ids, attention_mask=mask, **extra)
    if family in SEQ2SEQ and "decoder_input_ids" not in extra:
        kwargs["decoder_input_ids"] = ids[:, : max(1, ids.shape[1] // 2)]
    with torch.no_grad():
        out = model(**kwargs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def valid_positions(family, mask, out):
    # Padded query positions of encoder-only/decoder-only models carry no meaning; compare the rest.
    if family in SEQ2SEQ:
        return torch.ones(out.shape[:2], dtype=torch.bool)
    return mask.bool()
