"""pagewise itself, in-process, through the offline `LLM.generate` API."""

from __future__ import annotations

from engine.bench.datasets import SampleRequest


class EngineBackend:
    name = "engine"

    def __init__(self, args):
        self.args = args
        self.llm = None

    def load(self) -> None:
        from engine import LLM
        from engine.arg_utils import engine_config_kwargs

        # Every engine flag as given (model and dtype already resolved by the runner).
        self.llm = LLM(**engine_config_kwargs(self.args))
        self.loras = None
        if getattr(self.args, "lora_path", None):
            from engine import LoRARequest

            if not self.args.enable_lora:
                raise ValueError("--lora-path needs --enable-lora (and --max-loras for the adapters to spread over)")
            self.loras = [LoRARequest(f"lora{i}", i, self.args.lora_path) for i in range(1, self.args.max_loras + 1)]

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        """The context a request's prompt and output must fit in (start_backend checks the requests)."""
        return self.llm.engine.max_model_len

    def generate(self, requests: list[SampleRequest], use_tqdm: bool = True) -> list[list[int]]:
        from engine import SamplingParams

        lens = {r.output_len for r in requests}
        if len(lens) == 1:
            params = SamplingParams(max_tokens=lens.pop(), ignore_eos=True, temperature=0.0)
        else:
            params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
                      for r in requests]
        loras = None if self.loras is None else [self.loras[i % len(self.loras)] for i in range(len(requests))]
        outs = self.llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=use_tqdm, lora_request=loras)
        return [list(o.outputs[0].token_ids) for o in outs]

    def info(self) -> dict:
        import engine

        out = {"pagewise": engine.__version__}
        try:
            out["engine_stats"] = self.llm.engine.stats()
        except Exception as e:  # stats are a bonus for the report, never a reason to fail
            out["engine_stats_error"] = repr(e)
        return out
