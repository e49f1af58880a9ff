"""Communication for tensor and pipeline parallel: process groups, the collectives layers call,
stage-to-stage send/recv, and the layout (which rank holds what). What layers and models may
import; it imports nothing of the engine above it."""
