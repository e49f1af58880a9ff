"""A tiny Llama that writes a script: its next token depends only on its current one, through a
table of edges, so greedy decoding from a prompt's last token follows the script exactly, and
under a grammar takes the highest-ranked token the grammar allows. It makes a model "think" in a
test: `<think>`, reasoning words, `</think>`, then an answer, each one added token.

How: one layer whose attention and MLP outputs are zero (o_proj and down_proj zero), so the final
hidden state is the current token's embedding: a one-hot vector per scripted token (every other
token shares one more), and the LM head's column for that vector holds the logits of the next
tokens. Tokens the table does not name prefer the end token (EOS)."""

from __future__ import annotations

import os
from pathlib import Path

HIDDEN = 64
OTHER = HIDDEN - 1  # the one-hot slot every unscripted token shares


def build_scripted_model(path: str | os.PathLike, edges: dict[str, dict[str, float]], chat_template: str,
                         added: list[str], special: list[str] = ()) -> str:
    """`edges`: token text -> {next token text: logit} (unlisted next tokens: logit 0; EOS: 1 after an
    unscripted token); `added`: the script's own tokens, added to the tiny tokenizer as plain
    added tokens (`special`: as special ones). Returns the folder."""
    import torch
    import transformers
    from tokenizers import AddedToken

    from tests.tiny_model import _config, build_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in special], special_tokens=True)
    tok.chat_template = chat_template
    cfg = _config("llama", len(tok), tok, num_hidden_layers=1, hidden_size=HIDDEN)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = {t: tok.convert_tokens_to_ids(t) for t in set(edges) | {n for e in edges.values() for n in e}}
    slots = {tok_id: i for i, tok_id in enumerate(sorted({ids[t] for t in edges}))}
    assert len(slots) < OTHER, "too many scripted tokens for the hidden size"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = torch.zeros(len(tok), HIDDEN)
        embed[:, OTHER] = 1.0
        for tok_id, slot in slots.items():
            embed[tok_id] = 0.0
            embed[tok_id, slot] = 1.0
        model.model.embed_tokens.weight.copy_(embed)
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros(len(tok), HIDDEN)
        head[tok.eos_token_id, OTHER] = 1.0
        scale = HIDDEN ** 0.5  # RMSNorm makes a one-hot vector this long
        for text, nexts in edges.items():
            for nxt, logit in nexts.items():
                head[ids[nxt], slots[ids[text]]] = logit / scale
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    (path / "generation_config.json").unlink(missing_ok=True)
    return str(path)
