"""Constants of the quantized kernels' working memory, shared by the terms that place it in a phase."""
from __future__ import annotations

#: bytes per input element live at once while transformers' quantize_fp8_per_row quantizes a Linear's input for
#: compressed-tensors FP8 (integrations/compressed_tensors.py CompressedTensorsFP8Linear): x.float(), x / scale and its
#: clamp, 4 bytes each, before the scaled matmul writes the output
FP8_ROW_QUANT_BYTES = 12
