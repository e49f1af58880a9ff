"""Hugging Face transformers' batched `generate`, in its best honest configuration.

Requests are sorted by prompt length and cut into batches of `--hf-batch-size`, so each
batch wastes little on padding; prompts are left-padded with an attention mask; the KV
cache is on; greedy; the same dtype as the other backends. EOS is ignored by clearing the
generation config's eos_token_id, so every row runs to max_new_tokens (a batch runs to
its longest wanted output; each request is credited only the tokens it asked for).
"""

from __future__ import annotations

from engine.bench.datasets import SampleRequest


def torch_dtype(name: str, device: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, name)


class HFBackend:
    name = "hf"

    def __init__(self, args):
        self.args = args
        self.model = None
        self.tokenizer = None

    def load(self) -> None:
        import torch
        import transformers

        a = self.args
        cuda = a.device == "cuda" or (a.device in (None, "auto") and torch.cuda.is_available())
        self.device = "cuda" if cuda else "cpu"
        self.dtype = torch_dtype(a.dtype, self.device)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(getattr(a, "tokenizer", None) or a.model)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=self.dtype).to(self.device)
        self.model.eval()
        gc = self.model.generation_config
        gc.eos_token_id = None  # ignore EOS: generate exactly max_new_tokens
        gc.pad_token_id = self.pad_id = self._pad_id()
        gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
        torch.manual_seed(a.seed)

    def _pad_id(self) -> int:
        tok, cfg = self.tokenizer, self.model.config
        for pid in (tok.pad_token_id, getattr(cfg, "pad_token_id", None), tok.eos_token_id, 0):
            if isinstance(pid, int):
                return pid
        return 0

    def generate(self, requests: list[SampleRequest], use_tqdm: bool = True) -> list[list[int]]:
        import torch
        from tqdm import tqdm

        bs = max(1, self.args.hf_batch_size)
        order = sorted(range(len(requests)), key=lambda i: requests[i].prompt_len)
        results: list[list[int] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="hf generate", disable=not use_tqdm)
        for start in range(0, len(order), bs):
            idx = order[start:start + bs]
            batch = [requests[i] for i in idx]
            width = max(r.prompt_len for r in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):
                ids[row, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
                mask[row, width - r.prompt_len:] = 1
            new = max(r.output_len for r in batch)
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                    max_new_tokens=new, do_sample=False, use_cache=True,
                )
            for row, i in enumerate(idx):
                results[i] = out[row, width:].tolist()[: requests[i].output_len]
            bar.update(len(batch))
        bar.close()
        return results  # type: ignore[return-value]

    def info(self) -> dict:
        import transformers

        return {
            "transformers": transformers.__version__,
            "hf_batch_size": self.args.hf_batch_size,
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "device": self.device,
        }
