"""Whether Inductor's CPU backend can compile here (it needs a C++ compiler): fused tests skip without one."""
from __future__ import annotations

import shutil


def cxx_available() -> bool:
    try:
        from torch._inductor import config
    except Exception:  # noqa: BLE001
        return False
    names = [c for c in (config.cpp.cxx if isinstance(config.cpp.cxx, (tuple, list)) else (config.cpp.cxx,)) if c]
    return any(shutil.which(c) for c in names + ["g++", "c++", "clang++"])
