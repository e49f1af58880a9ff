"""Running the model on one or many ranks: the executor rank 0's core steps (a ModelRunner in one
process, or the TP x PP ranks' leader), the followers' worker loop, the plain-data step messages
between them, and the worker processes themselves."""
