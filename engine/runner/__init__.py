"""Each rank's model runner: ModelRunner (its copy of the request streams, the batch tensors, one
forward), the sampler, step inputs and outputs, CUDA graphs, KV cache sizing, bad-words and host-memory
helpers, and the CPU thread policy. It loads weights through engine.loading and runs engine.models."""
