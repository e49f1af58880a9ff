"""Planning estimators: model specs, training memory and time, serving memory and KV capacity.

Plain arithmetic, no torch: `engine plan` starts instantly and the engine sizes its KV cache with the
same functions (`kv_bytes_per_token`, `kv_budget_bytes`, `kv_capacity_tokens`). One exception, imported
only by `engine plan serve --slo --gpu cpu`: measure.py measures this CPU with torch.
"""

from engine.planning.serving import ServePlan, kv_budget_bytes, kv_bytes_per_token, kv_capacity_tokens, plan_serving
from engine.planning.spec import ModelSpec

__all__ = [
    "ModelSpec",
    "ServePlan",
    "kv_budget_bytes",
    "kv_bytes_per_token",
    "kv_capacity_tokens",
    "plan_serving",
]
