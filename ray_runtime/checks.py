"""Strict conversions of user input, shared by SamplingParams and the request checks.

Each returns the value as the plain Python type the wire format (msgpack, via msgspec) carries,
or raises in the caller's process: InputTypeError for a value of the wrong type, ValueError for
one out of range, the message naming the field. A bool is not an int here (True would pass an
`isinstance(x, int)` check and then fail to decode on the other side of an actor boundary), a
str is not a bool, and numpy integers and floats are accepted and converted.
"""
from __future__ import annotations

import math
import reprlib
from typing import Callable

import numpy as np

INT64_MIN = -(2 ** 63)
INT64_MAX = 2 ** 63 - 1  # every int on the wire fits in a signed 64-bit one



class InputTypeError(TypeError, ValueError):
    """An argument of the wrong type. A TypeError, and a ValueError too, so that the callers
    that catch ValueError for bad input (the CLI, user code) keep catching every bad input."""


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60
_repr.maxlong = 40


def show(value) -> str:
    """A short repr for an error message, with the type where the repr alone can mislead."""
    return f"{_repr.repr(value)} ({type(value).__name__})"


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def as_int(value, name: str, lo: int = INT64_MIN, hi: int = INT64_MAX, limits: str = "") -> int:
    """An integer in [lo, hi] (both inclusive); `limits` describes the range for the message."""
    limits = limits or f"in [{lo}, {hi}]"
    if not _is_int(value):
        raise InputTypeError(f"{name} must be an integer {limits}, got {show(value)}")
    value = int(value)
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer {limits}, got {_repr.repr(value)}")
    return value


def as_float(value, name: str, ok: Callable[[float], bool], limits: str) -> float:
    """A finite number (int or float, not bool) for which ok() holds."""
    if isinstance(value, (bool, np.bool_)) or \
            not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputTypeError(f"{name} must be a number {limits}, got {show(value)}")
    try:
        f = float(value)
    except OverflowError:  # an int beyond the float range
        f = math.inf
    if not math.isfinite(f) or not ok(f):
        raise ValueError(f"{name} must be a finite number {limits}, got {_repr.repr(value)}")
    return f


def as_bool(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InputTypeError(f"{name} must be True or False, got {show(value)}")
    return bool(value)


def as_int_list(value, name: str, lo: int, hi: int, limits: str) -> list[int]:
    """A list, tuple or 1-D numpy array of integers in [lo, hi], as a list of plain ints."""
    if isinstance(value, np.ndarray) and value.ndim == 1:
        value = value.tolist()  # bool or float arrays become bools / floats: refused below
    elif not isinstance(value, (list, tuple)):
        raise InputTypeError(f"{name} must be a list of integers, got {show(value)}")
    if all(type(t) is int for t in value):  # plain ints (bools excluded): the usual case
        ints = list(value)
    else:
        ints = []
        for t in value:
            if not _is_int(t):
                raise InputTypeError(f"{name} must hold integers only, got {show(t)}")
            ints.append(int(t))
    if ints and lo <= min(ints) and max(ints) <= hi:
        return ints
    bad = [t for t in ints if not lo <= t <= hi]
    if bad:
        shown = ", ".join(_repr.repr(t) for t in bad[:5])
        raise ValueError(f"{name} [{shown}{', ...' if len(bad) > 5 else ''}] outside {limits}")
    return ints


def as_str_list(value, name: str, max_count: int, max_chars: int) -> list[str]:
    """None (no strings), one str, or a list / tuple of strs, as a list of plain strs: each
    non-empty and at most max_chars long, at most max_count of them."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, (list, tuple)):
        raise InputTypeError(f"{name} must be a str, a list of strs or None, got {show(value)}")
    if len(value) > max_count:
        raise ValueError(f"{name} holds {len(value)} strings, more than the limit of {max_count}")
    strs = []
    for s in value:
        if not isinstance(s, str):
            raise InputTypeError(f"{name} must hold strs only, got {show(s)}")
        if not 1 <= len(s) <= max_chars:
            raise ValueError(f"{name} strings must be non-empty and at most {max_chars} "
                             f"characters, got one of {len(s)}: {_repr.repr(s)}")
        strs.append(str(s))  # a str subclass (numpy's str_) becomes a plain str
    return strs
