"""Real runs and the CI gate: one setup measured in its own process (runner, meter), sweeps (sweep), stored rows
(rows), the re-estimation of every stored row (gate) and the Trainer callback (callbacks). Imports the estimator,
the tracer, the runtime and below.
"""
