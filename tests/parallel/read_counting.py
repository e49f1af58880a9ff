"""Count the tensor bytes a process reads from safetensors checkpoints, below the engine: every
tensor that comes out of safetensors' safe_open (get_tensor, or a get_slice region) is recorded,
whatever the engine's own bookkeeping says. A rank's worker process records into a file named
after its rank in the folder `READS_DIR_ENV` names (rank 0 runs in the test's own process)."""

from __future__ import annotations

import os

READS_DIR_ENV = "PAGEWISE_TEST_READS_DIR"


def count_checkpoint_reads(record) -> None:
    """From now on, call `record(nbytes)` for each tensor this process reads through safe_open."""
    import safetensors

    real_open = safetensors.safe_open

    def nbytes(tensor) -> int:
        record(tensor.numel() * tensor.element_size())
        return tensor

    class Slice:
        def __init__(self, inner):
            self.inner = inner

        def get_shape(self):
            return self.inner.get_shape()

        def get_dtype(self):
            return self.inner.get_dtype()

        def __getitem__(self, index):
            return nbytes(self.inner[index])

    class Handle:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            return nbytes(self.inner.get_tensor(name))

        def get_slice(self, name):
            return Slice(self.inner.get_slice(name))

    safetensors.safe_open = Handle


def counting_worker_main(rank, layout, config, init_method, local_rank) -> None:
    """engine.executor.worker.worker_main, with this rank's checkpoint reads appended to
    <READS_DIR_ENV>/rank<rank>.txt, one line per read."""
    from engine.executor.worker import worker_main

    path = os.path.join(os.environ[READS_DIR_ENV], f"rank{rank}.txt")

    def record(n: int) -> None:
        with open(path, "a") as f:
            f.write(f"{n}\n")

    count_checkpoint_reads(record)
    worker_main(rank, layout, config, init_method, local_rank)
