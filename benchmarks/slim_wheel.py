"""Rewrite a bitsandbytes wheel with only the native libraries one CUDA major release loads.

bitsandbytes 0.50 ships a library per CUDA and ROCm release (129 MB unpacked, 43 MB packed); a device
call carries at most 64 MiB, the checkout included. bitsandbytes picks libbitsandbytes_cuda{torch's CUDA}.so
at import (bitsandbytes/cextension.py), so the others are dead weight there.
    python benchmarks/slim_wheel.py WHEEL 13     # keeps cuda13x and cpu libraries, in place
"""
import os
import re
import sys
import zipfile


def slim(path: str, cuda_major: str) -> None:
    keep = re.compile(rf"libbitsandbytes_(cpu|cuda{cuda_major}\d)\.")
    tmp = path + ".part"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            name = os.path.basename(item.filename)
            if name.startswith("libbitsandbytes_") and not keep.match(name):
                continue
            dst.writestr(item, src.read(item.filename))
    os.replace(tmp, path)


if __name__ == "__main__":
    slim(sys.argv[1], sys.argv[2])
