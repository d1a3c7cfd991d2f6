"""Fail if a wheel ships anything but the llama_mtp package (no llama.cpp headers, libs, cmake)."""

import sys
import zipfile

bad = []
for name in zipfile.ZipFile(sys.argv[1]).namelist():
    top = name.split("/")[0]
    if top.endswith(".dist-info"):
        continue
    if top != "llama_mtp" or name.endswith((".h", ".hpp", ".cmake", ".a", ".pc")) or "/include/" in name:
        bad.append(name)
if bad:
    sys.exit("wheel contains files it should not:\n  " + "\n  ".join(bad))
print(f"{sys.argv[1]}: ok")
