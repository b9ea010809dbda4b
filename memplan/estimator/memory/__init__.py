"""One pure function per memory component: bytes out, formula and source in each docstring.

Each function takes a `memplan.estimator.memory.context.Ctx` (the resolved facts of one model + Setup) and returns
bytes. Short local names follow one convention across these modules:
  a  the model's Arch (ctx.spec.arch)          s  the Setup (ctx.setup)
  b  micro-batch size                          t  tokens (batch x sequence) unless named otherwise
  h  hidden size                               k  experts per token (MoE)
  c  bytes per element of the matmul dtype, or of the activations (ctx.compute_bytes / ctx.act_bytes)
  r  bytes per element of the residual stream (ctx.residual_bytes); in LoRA code, the LoRA rank
"""
