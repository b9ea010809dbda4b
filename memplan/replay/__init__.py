"""The caching allocator over a whole model's steps: traced events of a model (need), synthesized for a deep model
from short cut traces (synth), replayed through runtime.allocator to the smallest cap a step fits under. Imports the
tracer and below.
"""
