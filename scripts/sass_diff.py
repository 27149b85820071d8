#!/usr/bin/env python3
"""Compares the machine code of every kernel in two `scripts/sass.sh` listings.

    scripts/sass_diff.py OLD/gdp.sass NEW/gdp.sass [KERNEL,KERNEL,...]

For each kernel (or the listed ones) it says whether the two builds' code is the same once
addresses, immediates and branch labels are normalised, and for those that differ, the
instruction count and the opcodes whose counts moved by 8 or more. A kernel change that was
meant to touch some kernels only can be checked this way before any device time is spent:
nvcc may compile a shared helper differently for kernels that do not use the change.
"""
import collections
import re
import sys


def kernels(path):
    """Kernel name -> its normalised instructions, in order."""
    out, cur = {}, None
    with open(path) as f:
        for line in f:
            m = re.match(r"\s*\.text\.(\w+):", line)
            if m:
                cur = m.group(1)
                out[cur] = []
                continue
            m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line) if cur else None
            if m:
                ins = re.sub(r"0x[0-9a-f]+", "X", m.group(1))
                out[cur].append(re.sub(r"\.L_x_\d+", "L", ins))
    return out


def opcodes(instructions):
    """Counts by opcode (predicates and modifiers dropped)."""
    ops = collections.Counter()
    for ins in instructions:
        ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
        ops[ins.split()[0].split(".")[0]] += 1
    return ops


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    old, new = kernels(sys.argv[1]), kernels(sys.argv[2])
    names = sys.argv[3].split(",") if len(sys.argv) == 4 else sorted(set(old) | set(new))
    same = 0
    for name in names:
        a, b = old.get(name), new.get(name)
        if a is None or b is None:
            print(f"{name}: only in {'the new' if a is None else 'the old'} listing")
        elif a == b:
            same += 1
        else:
            oa, ob = opcodes(a), opcodes(b)
            moved = sorted(
                ((op, oa[op], ob[op]) for op in oa | ob if abs(oa[op] - ob[op]) >= 8),
                key=lambda x: -abs(x[1] - x[2]),
            )
            detail = ", ".join(f"{op} {x} -> {y}" for op, x, y in moved) or "same opcode counts"
            print(f"{name}: differs, {len(a)} -> {len(b)} instructions ({detail})")
    print(f"{same} of {len(names)} kernels the same")


if __name__ == "__main__":
    main()
