"""Compiler dtypes.

The compiler reasons about dtypes through these small objects rather than
``torch.dtype`` so that prims and clang know nothing about torch.  Each
compiler dtype knows its torch counterpart; the torch language and the torch
executor translate at the boundary.
"""
from __future__ import annotations

import torch

__all__ = ["DType", "from_torch", "to_torch", "all_dtypes"]


class DType:
    """A dtype: name, category (bool < int < float < complex) and byte size."""

    __slots__ = ("name", "category", "itemsize", "torch", "short")

    def __init__(self, name: str, category: int, itemsize: int, torch_dtype, short: str):
        self.name = name
        self.category = category
        self.itemsize = itemsize
        self.torch = torch_dtype
        self.short = short

    def __repr__(self) -> str:
        return f"dtypes.{self.name}"

    # Convenience predicates keep promotion code readable.
    @property
    def is_bool(self) -> bool:
        return self.category == BOOL

    @property
    def is_int(self) -> bool:
        return self.category == INT

    @property
    def is_float(self) -> bool:
        return self.category == FLOAT

    @property
    def is_complex(self) -> bool:
        return self.category == COMPLEX

    @property
    def is_low_precision(self) -> bool:
        return self.name in ("float16", "bfloat16")


BOOL, INT, FLOAT, COMPLEX = 0, 1, 2, 3

bool8 = DType("bool8", BOOL, 1, torch.bool, "b8")
uint8 = DType("uint8", INT, 1, torch.uint8, "u8")
int8 = DType("int8", INT, 1, torch.int8, "i8")
# torch implements few ops for the wider unsigned types (and no promotion with them); eager's errors apply.
uint16 = DType("uint16", INT, 2, torch.uint16, "u16")
uint32 = DType("uint32", INT, 4, torch.uint32, "u32")
uint64 = DType("uint64", INT, 8, torch.uint64, "u64")
int16 = DType("int16", INT, 2, torch.int16, "i16")
int32 = DType("int32", INT, 4, torch.int32, "i32")
int64 = DType("int64", INT, 8, torch.int64, "i64")
float16 = DType("float16", FLOAT, 2, torch.float16, "f16")
bfloat16 = DType("bfloat16", FLOAT, 2, torch.bfloat16, "bf16")
float32 = DType("float32", FLOAT, 4, torch.float32, "f32")
float64 = DType("float64", FLOAT, 8, torch.float64, "f64")
complex32 = DType("complex32", COMPLEX, 4, torch.complex32, "c32")  # torch.chalf: few ops, eager's errors apply
complex64 = DType("complex64", COMPLEX, 8, torch.complex64, "c64")
complex128 = DType("complex128", COMPLEX, 16, torch.complex128, "c128")

all_dtypes = (bool8, uint8, uint16, uint32, uint64, int8, int16, int32, int64, float16, bfloat16, float32, float64, complex32, complex64,
              complex128)
_from_torch = {d.torch: d for d in all_dtypes}


def from_torch(dt) -> DType:
    if isinstance(dt, DType):
        return dt
    try:
        return _from_torch[dt]
    except KeyError:
        raise TypeError(f"thunder_train does not support dtype {dt}") from None


def to_torch(dt):
    return dt.torch if isinstance(dt, DType) else dt


def default_float() -> DType:
    """The float dtype Python floats become (torch.get_default_dtype())."""
    return _from_torch[torch.get_default_dtype()]


def python_type_category(t: type) -> int:
    """The category of a Python number type (``proxies.number_type`` of a number or number proxy)."""
    for base, cat in ((bool, BOOL), (int, INT), (float, FLOAT), (complex, COMPLEX)):
        if t is not None and issubclass(t, base):
            return cat
    raise TypeError(f"not a Python number type: {t!r}")


def to_complex(d: DType) -> DType:
    return complex128 if d is float64 else complex32 if d is float16 else complex64


def to_real(d: DType) -> DType:
    if d is complex128:
        return float64
    if d is complex64:
        return float32
    if d is complex32:
        return float16
    return d


# Pairwise promotion table in the order torch uses (torch.promote_types).
def promote(a: DType, b: DType) -> DType:
    if a is b:
        return a
    return from_torch(torch.promote_types(a.torch, b.torch))
