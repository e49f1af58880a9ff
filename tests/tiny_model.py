"""Build a tiny random Hugging Face causal LM (plus a real local tokenizer) for tests.

No hub access: the tokenizer is a byte-level BPE trained here on a small corpus, so any
text round-trips, and the same tokenizer serves every model type. Weights are random but
seeded, so two builds with the same arguments are identical.

    from tests.tiny_model import build_tiny_model
    path = build_tiny_model(tmp_path / "tiny", model_type="qwen3", head_dim=32)
"""

from __future__ import annotations

import os
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    # Qwen3's switch (a template variable, set through chat_template_kwargs): an empty thought
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)

BOS, EOS, PAD, UNK = "<|endoftext|>", "<|im_end|>", "<|pad|>", "<|unk|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, UNK, "<|im_start|>"]

# Enough varied English to give BPE real merges; the words matter, not the meaning.
CORPUS = [
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "The capital of Italy is Rome. The capital of Spain is Madrid.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join while others decode.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Once upon a time there was a small model that liked to count: one two three four five.",
    "Hello world! How are you today? I am fine, thank you very much.",
    "system user assistant: answer the question in one word, please.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000.",
    "Prefill computes the prompt; decode adds one token at a time to each sequence.",
    "The scheduler spends a token budget and preempts the newest request when blocks run out.",
    "Why is the sky blue? Because shorter wavelengths scatter more in the air.",
]


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer wrapped as PreTrainedTokenizerFast, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(model_type: str, vocab_size: int, tokenizer, **kw):
    import transformers

    classes = {
        "llama": "LlamaConfig",
        "mistral": "MistralConfig",
        "qwen2": "Qwen2Config",
        "qwen3": "Qwen3Config",
        "mixtral": "MixtralConfig",
        "qwen2_moe": "Qwen2MoeConfig",
        "qwen3_moe": "Qwen3MoeConfig",
    }
    if model_type not in classes:
        raise ValueError(f"model_type must be one of {sorted(classes)}, got {model_type!r}")
    args = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Wider than HF's 0.02 so logits are peaked: greedy argmax is then stable under the
        # tiny float differences between batched and single-sequence execution.
        initializer_range=0.2,
        dtype="float32",
    )
    if model_type in ("mistral", "mixtral"):
        args["sliding_window"] = None  # full attention: the engine's default path
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        args["use_sliding_window"] = False
    args.update({k: v for k, v in kw.items() if v is not None})
    return getattr(transformers, classes[model_type])(**args)


def build_tiny_model(
    path: str | os.PathLike,
    model_type: str = "llama",
    tie_word_embeddings: bool | None = None,
    head_dim: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    seed: int = 0,
    **overrides,
) -> str:
    """Write config.json, model.safetensors (float32) and the tokenizer into `path`.

    `overrides` go straight to the transformers config (hidden_size, num_hidden_layers,
    max_position_embeddings, vocab_size, initializer_range, ...). The model's vocab_size
    defaults to exactly the tokenizer's size, so every id the model can emit decodes.
    Returns the folder path as a string.
    """
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    vocab_size = overrides.pop("vocab_size", len(tokenizer))
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} does not cover the tokenizer ({len(tokenizer)} tokens)")
    cfg = _config(
        model_type, vocab_size, tokenizer,
        tie_word_embeddings=tie_word_embeddings, head_dim=head_dim,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        **overrides,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    generation_config = path / "generation_config.json"
    if generation_config.exists():
        # A random model has no sampling defaults worth keeping; engines read plain config.
        generation_config.unlink()
    return str(path)


def build_tiny_llama(path: str | os.PathLike, **overrides) -> str:
    """The default tiny model: Llama, 2 layers, hidden 64, 4 heads / 2 KV heads."""
    return build_tiny_model(path, model_type="llama", **overrides)


if __name__ == "__main__":
    import sys

    print(build_tiny_model(sys.argv[1], model_type=sys.argv[2] if len(sys.argv) > 2 else "llama"))
