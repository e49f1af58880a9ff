"""The engine core: EngineCore.step (engine_core.py) admits requests and turns one scheduled step
into outputs, the scheduler picks each step's tokens under a budget and owns the KV cache manager
(block pool, prefix hashes, per-layer KV groups). It drives an executor and imports nothing above it."""
