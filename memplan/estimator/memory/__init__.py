"""One pure function per memory component: bytes out, formula and source in each docstring.

Each function takes a `memplan.estimator.memory.context.Ctx` (the resolved facts of one model + Setup).
"""
