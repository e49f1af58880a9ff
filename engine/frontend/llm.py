"""LLM: the offline API. Submit many prompts, step the engine until all finish, return in order."""

from __future__ import annotations

import itertools
import time

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.core.interface import CoreClient
from engine.frontend import chat_template
from engine.frontend.core_factory import start_core
from engine.frontend.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.request import LoRARequest
from engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict  # a dict: vLLM's {"prompt": text} or {"prompt_token_ids": ids}


class LLM:
    def __init__(self, model: str | None = None, **config):
        self.config = EngineConfig(model=model, **config)
        self.engine: CoreClient = start_core(self.config)
        self.tokenizer = self.engine.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._specials = None  # chat_template.SpecialsAsText, built by the first chat

    def shutdown(self) -> None:
        """Stop the engine's worker or replica processes (none for one process). Idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """lora_request: the adapter every prompt runs with, or one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, list):
            raise ValueError(f"prompts must be a string, a list of token ids, a dict ({{'prompt': ...}} or "
                             f"{{'prompt_token_ids': ...}}) or a list of those, got {type(prompts).__name__}")
        return self._run([self._prompt(p, i) for i, p in enumerate(prompts)], sampling_params, use_tqdm,
                         lora_request)

    def embed(self, prompts: Prompt | list[Prompt], pooling: str = "last", use_tqdm: bool = True) -> list[list[float]]:
        """One embedding per prompt: the final hidden states (after the last norm) of its last token
        ("last") or their mean ("mean"), L2-normalised, as /v1/embeddings returns them."""
        outs = self.generate(prompts, SamplingParams(max_tokens=1, pooling=pooling), use_tqdm)
        for out in outs:
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        return [out.embedding for out in outs]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None,
             parse_special_tokens_in_messages: bool = False,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """As vLLM's LLM.chat: continue_final_message leaves the last message open for the model to
        continue (add_generation_prompt must then be False); chat_template_kwargs are more variables
        for the template (e.g. Qwen3's enable_thinking). Special-token text in the messages is plain
        text, as at the server, unless parse_special_tokens_in_messages (transformers' reading)."""
        one = isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict)
        if not one and not (isinstance(messages, list) and messages and all(isinstance(c, list) for c in messages)):
            raise ValueError("messages must be a conversation (a list of {'role': ..., 'content': ...} dicts) or a "
                             f"list of conversations, got {str(messages)[:100]!r}")
        conversations = [chat_template.conversation(messages)] if one else [
            chat_template.conversation(c, f"messages[{j}]") for j, c in enumerate(messages)]
        if self._specials is None and not parse_special_tokens_in_messages:
            self._specials = chat_template.SpecialsAsText(self.tokenizer)
        specials = None if parse_special_tokens_in_messages else self._specials
        prompts = [chat_template.encode(self.tokenizer, c, specials=specials,
                                        add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message,
                                        template_kwargs=chat_template_kwargs) for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm, lora_request)

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling_params samples with: the API's defaults, with the model's
        generation_config.json settings over them (vLLM's; EngineConfig.generation_config)."""
        return self.engine.sampling_defaults.params()

    def _prompt(self, prompt: Prompt, i: int) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of prompts[i]; ValueError naming it when it is neither."""
        if isinstance(prompt, dict) and set(prompt) in ({"prompt"}, {"prompt_token_ids"}):
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompts[{i}] must be a string, a list of token ids or a dict with one key, 'prompt' or "
                         f"'prompt_token_ids', got {str(prompt)[:100]!r}")

    def _run(self, prompts: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | list[SamplingParams] | None, use_tqdm: bool,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts (give one, or one per prompt)")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
        order = {}
        try:
            for (text, ids), p, lora in zip(prompts, params, loras):
                rid = str(next(self._ids))
                self.engine.check_request(ids, p, lora)
                self.engine.add_request(rid, ids, p, lora_request=lora)
                self.output_processor.add_request(rid, text, ids, p, delta=False)
                order[rid] = len(order)
        except BaseException:
            self.engine.abort_request(list(order))  # nothing half-submitted stays behind (blocks freed now)
            for rid in order:
                self.output_processor.abort(rid)
            raise
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Generating", unit="req", disable=not use_tqdm)
        start, generated = time.perf_counter(), 0
        while any(r is None for r in results):
            for out in self._step():
                if out.request_id in order:
                    results[order[out.request_id]] = out
                    generated += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    bar.set_postfix(output_tok_s=f"{generated / (time.perf_counter() - start):.1f}")
        bar.close()
        return results

    def _step(self) -> list[RequestOutput]:
        """One engine step and its output processing: the requests that finished, complete. A stop
        string found in the text ends its choice in the engine before the next step."""
        outputs, stops = self.output_processor.process(self.engine.step())
        for stop in stops:
            self.engine.finish_choice(stop.request_id, stop.index, stop.stop)
        return outputs
