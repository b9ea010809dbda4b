"""CUDA behaviour on a CPU: cuda_like() and the table of every emulation (cuda), autocast's CUDA casts (autocast),
sdpa's CUDA kernel choice (sdpa) and the masks transformers builds for it (masks)."""
