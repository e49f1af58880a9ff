"""The model runner's copy of one stream (CachedRequestState), kept across its steps: read by the
runner's forward and step inputs (engine/runner/model_runner.py, engine/runner/step_inputs.py) and by what a step
hands back (engine/runner/step_outputs.py)."""

from __future__ import annotations

import torch

from engine.request import TokenSequence
from engine.scheduler_output import NewRequestData


class CachedRequestState(TokenSequence):
    """The runner's copy of one stream: what its forwards read, plus what the sampler keeps for
    it (a seeded choice's generator, its penalty counts). Kept from the step that sends it
    (NewRequestData) until the step that names it finished, preemptions included, so that a
    seeded stream's draws go on where they stopped."""

    def __init__(self, new: NewRequestData):
        self.req_id = new.req_id
        self.index = new.index
        self.prompt_token_ids = new.prompt_token_ids
        self.output_token_ids = list(new.output_token_ids)
        self.sampling_params = new.sampling_params
        self.lora_request = new.lora_request
        self.block_ids = list(new.block_ids)
        self.num_computed_tokens = new.num_computed_tokens
        self.generator: torch.Generator | None = None
        self.penalty_state = None
        self.logit_bias_tensors = None
        self.allowed_token_tensor = None  # allowed_token_ids on the logits' device, made at its first sample
        self.pooled_sum: torch.Tensor | None = None  # mean pooling: the final hidden states so far
        self.grammar = None  # structured output: its matcher, on the sampling rank (made at its first sample)
        # Its row of the persistent block table (engine.runner.step_inputs), how many of block_ids that
        # row holds, and the last step that used it.
        self.table_row: int | None = None
        self.table_blocks = 0
        self.table_step = 0
