"""What a model is: ModelSpec and Arch (spec), the built-in catalog (catalog), the transformers class behind a config
(hf), which parameters train and which Linears get LoRA (trainable), block paths (layout), and which setups a model
accepts (compat). Pure data and rules: no torch at import. Imports only the ground floor (setup, errors, units,
libs, gpus, fileio); catalog.load_spec builds an uncatalogued config through memplan.inventory, the one sanctioned
upward call.
"""
