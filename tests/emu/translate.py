"""Turns a CUDA source of kernels/ into C++ for cuda_emu.h: every launch
`name<targs><<<grid, block[, shmem[, stream]]>>>(args)` becomes
`cmlp_emu::launcher(grid, block, shmem, stream, BOUND, "name")(name<targs>, args)`, where BOUND
is the kernel's __launch_bounds__ (0 when it has none). Everything else is left as written.

    python3 tests/emu/translate.py kernels/loss.cu build/emu/loss.cpp
"""
import re
import sys

LAUNCH = re.compile(r"([A-Za-z_]\w*(?:<[^;<>()]*>)?)\s*<<<(.*?)>>>\s*\(", re.S)
BOUNDS = re.compile(r"__launch_bounds__\(([^)]*)\)\s*([A-Za-z_]\w*)\s*\(")


def split_top(s):
    """Splits s at the commas outside parentheses and angle brackets."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return parts


def translate(src, bounds):
    bounds = dict(bounds)
    bounds.update((name, expr.strip()) for expr, name in BOUNDS.findall(src))

    def launch(m):
        kernel, cfg = m.group(1), split_top(m.group(2))
        if not 2 <= len(cfg) <= 4:
            raise SystemExit(f"cannot read the launch configuration <<<{m.group(2)}>>>")
        cfg += ["0"] * (4 - len(cfg))
        base = kernel.split("<")[0]
        bound = bounds.get(base, "0")
        rest = src[m.end():].lstrip()
        sep = "" if rest.startswith(")") else ", "
        return f'cmlp_emu::launcher({", ".join(cfg)}, {bound}, "{base}")({kernel}{sep}'

    return LAUNCH.sub(launch, src), bounds


def main():
    *inputs, out = sys.argv[1:]
    if not inputs:
        raise SystemExit("usage: translate.py [header.cuh ...] source.cu output.cpp")
    bounds = {}
    # headers first: their kernels' bounds apply to launches in the source
    for path in inputs[:-1]:
        _, bounds = translate(open(path).read(), bounds)
    text, _ = translate(open(inputs[-1]).read(), bounds)
    with open(out, "w") as f:
        f.write(f"#line 1 \"{inputs[-1]}\"\n")
        f.write(text)


if __name__ == "__main__":
    main()
