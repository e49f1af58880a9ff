"""Which data-parallel replica gets a request.

The least loaded one (fewest unfinished requests routed to it), unless the replica that last
took a prompt with the same first block of tokens is nearly as idle: its prefix cache probably
still holds that block, and the blocks after it, so sending the prompt there saves their
prefill. The key is the KV cache's own block hash, so "same first block" means exactly what the
replica's prefix cache means by it.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.core.kv_cache import block_hash


class Router:
    def __init__(self, num_replicas: int, block_size: int, slack: int = 2, max_prefixes: int = 1 << 16):
        self.block_size = block_size
        self.slack = slack  # extra requests a prefix's home replica may carry and still get it
        self.max_prefixes = max_prefixes
        self.load = [0] * num_replicas  # unfinished requests routed to each replica
        self.routed = [0] * num_replicas  # requests routed to each replica, ever
        self.affinity_hits = 0  # requests sent to their prefix's home rather than the least loaded
        self._home: OrderedDict[int, int] = OrderedDict()  # first-block hash -> replica, least recent first

    def choose(self, prompt_token_ids: list[int]) -> int:
        # Ties go to the replica that has taken fewer requests, so an idle server alternates.
        least = min(range(len(self.load)), key=lambda i: (self.load[i], self.routed[i], i))
        choice, key = least, None
        if len(prompt_token_ids) > self.block_size:  # only full blocks are cached, and one token stays to compute
            key = block_hash(None, prompt_token_ids[: self.block_size])
            home = self._home.get(key)
            if home is not None and self.load[home] - self.load[least] <= max(self.slack, self.load[least] // 4):
                choice = home
                self.affinity_hits += choice != least
            self._home[key] = choice
            self._home.move_to_end(key)
            if len(self._home) > self.max_prefixes:
                self._home.popitem(last=False)
        self.load[choice] += 1
        self.routed[choice] += 1
        return choice

    def finished(self, replica: int) -> None:
        self.load[replica] -= 1
