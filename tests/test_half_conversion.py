"""cmlp.amp.to_half / from_half (the library's fp16 and bf16 conversions) against references:
NumPy's float16 for fp16, and for bf16 an integer implementation here (round to nearest even
on the top 16 bits of the float32 pattern, NaN stays NaN). Every one of the 65,536 patterns is
decoded; a million random floats and the edge cases (overflow, underflow, subnormals, exact
ties, negative zero, NaN with any payload) are encoded. Patterns must match bit for bit,
except that a NaN only has to stay a NaN (its payload is free).
"""

import numpy as np
import pytest

import cmlp
import cmlp.amp  # noqa: F401  (a submodule file; __init__ may not import it yet)
from cmlp import amp

ALL16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def f32(bits):
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def bits32(x):
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def is_nan16(u, dtype):
    u = np.asarray(u, dtype=np.uint16).astype(np.uint32)
    if dtype == "fp16":
        return ((u & 0x7C00) == 0x7C00) & ((u & 0x03FF) != 0)
    return ((u & 0x7F80) == 0x7F80) & ((u & 0x007F) != 0)


def assert_same_halves(got, want, x, dtype):
    """Bit-equal patterns; where the reference is NaN, got must be a NaN pattern."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.uint16 and got.shape == want.shape
    nan = is_nan16(want, dtype)
    assert np.array_equal(is_nan16(got, dtype), nan), "NaN-ness differs"
    bad = np.flatnonzero((got != want) & ~nan)
    if bad.size:
        i = bad[:8]
        raise AssertionError(f"{bad.size} of {got.size} {dtype} patterns differ; first inputs "
                             f"{[hex(v) for v in bits32(np.ravel(x)[i])]} ({np.ravel(x)[i]}): got "
                             f"{[hex(v) for v in got.ravel()[i]]}, want {[hex(v) for v in want.ravel()[i]]}")


def assert_same_floats(got, want):
    """Bit-equal float32 (so -0.0 counts), NaN where want is NaN."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and got.shape == want.shape
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), "NaN-ness differs"
    bad = np.flatnonzero((bits32(got) != bits32(want)) & ~nan)
    assert bad.size == 0, f"{bad.size} values differ; first at {bad[:8]}: got {got.ravel()[bad[:8]]}, " \
                          f"want {want.ravel()[bad[:8]]}"


# ---- references ----

def ref_fp16(x):
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


def ref_bf16(x):
    """Round to nearest even on the top 16 bits of the float32 pattern; NaN -> a quiet NaN."""
    b = bits32(x).astype(np.uint64)
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, (b >> 16) | 0x0040, rounded).astype(np.uint16)


def ref_from_bf16(u):
    return f32(np.asarray(u, dtype=np.uint16).astype(np.uint32) << 16)


def random_floats(n, seed):
    """A third uniform over all float32 bit patterns (every exponent, inf, NaNs), a third
    log-uniform over fp16's range and beyond with random signs, a third uniform in [-1, 1]."""
    rng = np.random.default_rng(seed)
    k = n // 3
    anybits = f32(rng.integers(0, 1 << 32, k, dtype=np.uint64).astype(np.uint32))
    mag = np.exp2(rng.uniform(-27.0, 18.0, k)) * rng.choice([-1.0, 1.0], k)
    unit = rng.uniform(-1.0, 1.0, n - 2 * k)
    return np.concatenate([anybits, mag.astype(np.float32), unit.astype(np.float32)])


# ---- fp16 ----

def fp16_values(u):
    return np.asarray(u, dtype=np.uint16).view(np.float16).astype(np.float32)


def test_fp16_decode_all_patterns():
    assert_same_floats(amp.from_half(ALL16, "fp16"), fp16_values(ALL16))


def test_fp16_round_trip_all_patterns():
    x = fp16_values(ALL16)
    assert_same_halves(amp.to_half(x, "fp16"), ALL16, x, "fp16")


def test_fp16_random_million():
    x = random_floats(1_000_000, seed=0)
    assert_same_halves(amp.to_half(x, "fp16"), ref_fp16(x), x, "fp16")


def test_fp16_float32_neighbours_of_every_half():
    """The float32 values just above and below every finite fp16 value."""
    h = fp16_values(ALL16)
    h = h[np.isfinite(h)]
    x = np.concatenate([np.nextafter(h, np.float32(np.inf)), np.nextafter(h, np.float32(-np.inf))])
    assert_same_halves(amp.to_half(x, "fp16"), ref_fp16(x), x, "fp16")


def test_fp16_ties_to_even():
    """Every exact midpoint between neighbouring finite fp16 values (both signs, subnormals
    included) goes to the neighbour with an even pattern; one float32 ulp off the midpoint
    goes to the nearer neighbour."""
    lo = np.arange(0, 0x7BFF, dtype=np.uint32)          # lo and lo + 1 both finite and positive
    a, b = fp16_values(lo), fp16_values(lo + 1)
    mid = ((a.astype(np.float64) + b) / 2).astype(np.float32)
    assert np.array_equal(mid.astype(np.float64), (a.astype(np.float64) + b) / 2), "midpoints are exact"
    even = np.where(lo % 2 == 0, lo, lo + 1).astype(np.uint16)
    for sign in (0, 0x8000):
        s = np.float32(-1.0 if sign else 1.0)
        want = even | np.uint16(sign)
        got = amp.to_half(s * mid, "fp16")
        assert_same_halves(got, want, s * mid, "fp16")
        assert_same_halves(got, ref_fp16(s * mid), s * mid, "fp16")
        up = s * np.nextafter(mid, np.float32(np.inf))
        down = s * np.nextafter(mid, np.float32(0))
        assert_same_halves(amp.to_half(up, "fp16"), (lo + 1).astype(np.uint16) | np.uint16(sign), up, "fp16")
        assert_same_halves(amp.to_half(down, "fp16"), lo.astype(np.uint16) | np.uint16(sign), down, "fp16")


@pytest.mark.parametrize("value, pattern", [
    (65504.0, 0x7BFF),                                   # the largest fp16
    (65519.99609375, 0x7BFF),                            # just below the tie with 65536: rounds down
    (65520.0, 0x7C00),                                   # the tie: to even, which is 2**16 = inf
    (65536.0, 0x7C00),
    (1e5, 0x7C00),
    (3.4028234663852886e38, 0x7C00),
    (float("inf"), 0x7C00),
    (-65504.0, 0xFBFF),
    (-65520.0, 0xFC00),
    (float("-inf"), 0xFC00),
    (2.0**-14, 0x0400),                                  # the smallest normal
    (2.0**-14 - 2.0**-24, 0x03FF),                       # the largest subnormal
    (2.0**-14 - 2.0**-25, 0x0400),                       # tie largest subnormal / smallest normal: even
    (2.0**-24, 0x0001),                                  # the smallest subnormal
    (2.0**-25, 0x0000),                                  # half of it: a tie, to even (zero)
    (2.0**-25 * (1 + 2.0**-23), 0x0001),                 # just above half: up
    (2.0**-26, 0x0000),
    (1.5 * 2.0**-24, 0x0002),                            # tie between 1 and 2 units: even (2)
    (2.5 * 2.0**-24, 0x0002),                            # tie between 2 and 3 units: even (2)
    (-2.0**-25, 0x8000),                                 # rounds to negative zero
    (1e-45, 0x0000),                                     # a float32 subnormal
    (0.0, 0x0000),
    (-0.0, 0x8000),
    (1.0, 0x3C00),
    (1.0 + 2.0**-11, 0x3C00),                            # tie, to even
    (1.0 + 3 * 2.0**-11, 0x3C02),                        # tie, to even (up)
    (0.1, 0x2E66),
    (-2.0, 0xC000),
])
def test_fp16_edge_cases(value, pattern):
    x = np.array([value], dtype=np.float32)
    got = amp.to_half(x, "fp16")
    assert int(got[0]) == pattern, f"{value!r} -> {hex(int(got[0]))}, want {hex(pattern)}"
    assert int(ref_fp16(x)[0]) == pattern


@pytest.mark.parametrize("bits", [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7F802000,
                                  0x7FFFFFFF, 0xFFFFFFFF, 0x7F801FFF])
def test_fp16_nan_stays_nan(bits):
    """Including payloads only in the low 13 bits, which a truncating conversion would make inf."""
    x = f32([bits])
    got = int(amp.to_half(x, "fp16")[0])
    assert is_nan16(got, "fp16"), f"NaN {hex(bits)} -> {hex(got)}, not a NaN"
    assert (got & 0x8000) == (bits >> 16 & 0x8000), "the sign of a NaN is kept"


# ---- bf16 ----

def test_bf16_reference_selfcheck():
    """The reference encoder above against a few hand-computed patterns."""
    cases = {0x3F800000: 0x3F80, 0x3F808000: 0x3F80, 0x3F818000: 0x3F82, 0x3F808001: 0x3F81,
             0x7F7FFFFF: 0x7F80, 0x7F7F7FFF: 0x7F7F, 0x00000001: 0x0000, 0x00008001: 0x0001,
             0x80000000: 0x8000, 0xFF800000: 0xFF80}
    got = ref_bf16(f32(list(cases)))
    assert [int(v) for v in got] == list(cases.values())


def test_bf16_decode_all_patterns():
    assert_same_floats(amp.from_half(ALL16, "bf16"), ref_from_bf16(ALL16))


def test_bf16_round_trip_all_patterns():
    x = ref_from_bf16(ALL16)
    assert_same_halves(amp.to_half(x, "bf16"), ALL16, x, "bf16")


def test_bf16_random_million():
    x = random_floats(1_000_000, seed=1)
    assert_same_halves(amp.to_half(x, "bf16"), ref_bf16(x), x, "bf16")


def test_bf16_ties_and_neighbours():
    """For every bf16 pattern p (non-NaN, both signs): the float32 patterns p<<16 | 0x8000 (the
    exact tie with the next pattern), | 0x7FFF and | 0x8001 (either side of it)."""
    p = ALL16.astype(np.uint32)
    p = p[~is_nan16(ALL16, "bf16") & ((p & 0x7FFF) < 0x7F80)]   # finite, so p + 1 is the next magnitude
    ties = f32((p << 16) | 0x8000)
    want = np.where(p % 2 == 0, p, p + 1).astype(np.uint16)
    assert_same_halves(amp.to_half(ties, "bf16"), want, ties, "bf16")
    below, above = f32((p << 16) | 0x7FFF), f32((p << 16) | 0x8001)
    assert_same_halves(amp.to_half(below, "bf16"), p.astype(np.uint16), below, "bf16")
    assert_same_halves(amp.to_half(above, "bf16"), (p + 1).astype(np.uint16), above, "bf16")


@pytest.mark.parametrize("bits, pattern", [
    (0x00000001, 0x0000),       # the smallest float32 subnormal: below half a bf16 unit
    (0x00008000, 0x0000),       # tie: to even (zero)
    (0x00008001, 0x0001),       # kept as a bf16 subnormal, not flushed
    (0x00010000, 0x0001),       # the smallest bf16 subnormal, exact
    (0x00018000, 0x0002),       # tie: to even
    (0x007F0000, 0x007F),       # the largest bf16 subnormal
    (0x007FFFFF, 0x0080),       # the largest float32 subnormal rounds to the smallest normal
    (0x807F0000, 0x807F),       # negative subnormal
    (0x80000000, 0x8000),       # negative zero
    (0x7F7F0000, 0x7F7F),       # the largest bf16
    (0x7F7F7FFF, 0x7F7F),       # just below the tie above it
    (0x7F7F8000, 0x7F80),       # the tie above the largest bf16: to even, which is inf
    (0x7F7FFFFF, 0x7F80),       # FLT_MAX: inf
    (0xFF7FFFFF, 0xFF80),       # -FLT_MAX: -inf
    (0x7F800000, 0x7F80),       # inf
    (0xFF800000, 0xFF80),
    (0x3F800000, 0x3F80),       # 1.0
    (0x3DCCCCCD, 0x3DCD),       # 0.1
])
def test_bf16_edge_cases(bits, pattern):
    got = int(amp.to_half(f32([bits]), "bf16")[0])
    assert got == pattern, f"{hex(bits)} -> {hex(got)}, want {hex(pattern)}"
    assert int(ref_bf16(f32([bits]))[0]) == pattern


@pytest.mark.parametrize("bits", [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7F807FFF, 0x7FFFFFFF,
                                  0xFFFFFFFF, 0x7F80FFFF, 0x7FBFFFFF])
def test_bf16_nan_stays_nan(bits):
    """Including payloads only in the low 16 bits (rounding would carry them into inf) and
    0xFFFFFFFF (where adding the rounding bias overflows 32 bits)."""
    got = int(amp.to_half(f32([bits]), "bf16")[0])
    assert is_nan16(got, "bf16"), f"NaN {hex(bits)} -> {hex(got)}, not a NaN"
    assert (got & 0x8000) == (bits >> 16 & 0x8000), "the sign of a NaN is kept"


# ---- the wrappers ----

@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_shapes_layouts_and_inputs_untouched(dtype):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 10)).astype(np.float32)
    keep = x.copy()
    u = amp.to_half(x, dtype)
    assert u.shape == (6, 10) and u.dtype == np.uint16
    assert np.array_equal(x, keep)
    xt = x.T                                             # not C-contiguous
    assert np.array_equal(amp.to_half(xt, dtype), u.T)
    ukeep = u.copy()
    back = amp.from_half(u, dtype)
    assert back.shape == (6, 10) and back.dtype == np.float32
    assert np.array_equal(u, ukeep)
    assert np.array_equal(amp.from_half(u.T, dtype), back.T)
    assert np.array_equal(amp.from_half(u[:, ::2], dtype), back[:, ::2])
    assert amp.to_half(np.float32(1.0), dtype).shape == ()
    assert amp.to_half(np.zeros((0, 3), np.float32), dtype).shape == (0, 3)
    assert np.array_equal(amp.from_half(u.astype(np.int64), dtype), back)   # integer patterns accepted
    assert np.array_equal(amp.to_half(x, dtype), cmlp._cmlp.to_half(x, dtype))
    assert np.array_equal(amp.to_half(x.astype(np.float64), dtype), u)        # via float32


def test_default_dtype_is_fp16():
    x = np.array([0.1, 65520.0], np.float32)
    assert np.array_equal(amp.to_half(x), ref_fp16(x))
    assert np.array_equal(amp.from_half(np.array([0x3C00], np.uint16)), [1.0])


@pytest.mark.parametrize("call, exc, words", [
    (lambda: amp.to_half(np.ones(2, np.float32), "fp32"), ValueError, "dtype"),
    (lambda: amp.from_half(np.ones(2, np.uint16), "half"), ValueError, "dtype"),
    (lambda: amp.to_half(np.array(["a"]), "fp16"), TypeError, "dtype"),
    (lambda: amp.to_half(np.ones(2, bool), "fp16"), TypeError, "dtype"),
    (lambda: amp.from_half(np.ones(2, np.float32), "fp16"), TypeError, "uint16"),
    (lambda: amp.from_half(np.array([70000]), "fp16"), ValueError, "65535"),
    (lambda: amp.from_half(np.array([-1]), "bf16"), ValueError, "65535"),
])
def test_bad_arguments(call, exc, words):
    with pytest.raises(exc, match=words):
        call()
