"""The closed-form estimate: pure functions of (ModelSpec, Setup) -> bytes.

breakdown assembles the Estimate from the phases (phases, attention_phases), whose terms are the components in memory/;
launch writes the accelerate and DeepSpeed configs that make a run match what the estimate assumed. Imports model and
the ground floor only: never the tracer, the runtime or the inventory, so `import memplan.estimator.breakdown` stays
torch-free.
"""
