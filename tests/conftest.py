"""Suite-wide settings.

``fusion="background"`` (tt.compile's default) builds a fused program with Inductor in a worker thread once an
entry is called twice (docs/fusion.md).  Tests that do not care about fusion would each start C++ compiles
that compete for the CI machine's cores, so the suite runs the default as "off" (the torch program, which is
what the default runs until the fused program is ready).  tests/test_fusion_auto.py turns it back on where it tests it.
"""
import os

os.environ.setdefault("THUNDER_TRAIN_FUSION", "off")
