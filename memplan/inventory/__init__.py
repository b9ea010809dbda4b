"""How a ModelSpec is built: the real transformers class instantiated on the meta device (build), and the facts read
from the model's own code by running its modules on meta tensors (config, probes, blocks, attention, activation,
linear_attention, kv_cache). Imports model, runtime and the ground floor.
"""
