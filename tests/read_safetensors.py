#!/usr/bin/python3
"""Independent safetensors reader (stdlib only), written from the documented format alone:
u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}} plus an
optional __metadata__ of strings, then raw little-endian C-order data (offsets relative to it).

Prints one line per tensor, "name DTYPE [shape] sum=S", in name order, then "metadata k=v" lines.
With --xxh64 also prints the XXH64 (seed 0) of the whole file, as recorded in fsdp-cpp indexes.
Exit status 1 with a message on any format violation.
"""
import json
import struct
import sys

FORMATS = {"F64": "d", "F32": "f", "F16": "e", "I64": "q", "I32": "i", "I16": "h", "I8": "b",
           "U8": "B", "BOOL": "?", "U16": "H", "U32": "I", "U64": "Q", "BF16": "H"}
SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
         "BOOL": 1, "U16": 2, "U32": 4, "U64": 8}
M = (1 << 64) - 1
P1, P2, P3, P4, P5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                      0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)


def rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & M


def rnd(acc, v):
    return (rotl((acc + v * P2) & M, 31) * P1) & M


def xxh64(data):
    n, i = len(data), 0
    if n >= 32:
        v = [(P1 + P2) & M, P2, 0, (-P1) & M]
        while i + 32 <= n:
            for k in range(4):
                v[k] = rnd(v[k], struct.unpack_from("<Q", data, i + 8 * k)[0])
            i += 32
        h = (rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18)) & M
        for k in range(4):
            h = (((h ^ rnd(0, v[k])) * P1) + P4) & M
    else:
        h = P5
    h = (h + n) & M
    while i + 8 <= n:
        h = (rotl(h ^ rnd(0, struct.unpack_from("<Q", data, i)[0]), 27) * P1 + P4) & M
        i += 8
    if i + 4 <= n:
        h = (rotl(h ^ ((struct.unpack_from("<I", data, i)[0] * P1) & M), 23) * P2 + P3) & M
        i += 4
    while i < n:
        h = (rotl(h ^ ((data[i] * P5) & M), 11) * P1) & M
        i += 1
    h ^= h >> 33
    h = (h * P2) & M
    h ^= h >> 29
    h = (h * P3) & M
    return h ^ (h >> 32)


def fail(msg):
    print("read_safetensors: " + msg, file=sys.stderr)
    sys.exit(1)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 1:
        fail("usage: read_safetensors.py FILE [--xxh64]")
    with open(args[0], "rb") as f:
        data = f.read()
    if len(data) < 8:
        fail("file shorter than 8 bytes")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > 100_000_000 or 8 + n > len(data):
        fail("header length %d invalid for a %d-byte file" % (n, len(data)))
    header = json.loads(data[8:8 + n].decode("utf-8"))
    body = data[8 + n:]
    meta = header.pop("__metadata__", {})
    spans = []
    for name in sorted(header):
        e = header[name]
        dt, shape, (b, end) = e["dtype"], e["shape"], e["data_offsets"]
        numel = 1
        for d in shape:
            numel *= d
        if dt not in SIZES or end - b != numel * SIZES[dt] or not 0 <= b <= end <= len(body):
            fail("tensor %s: bad dtype/shape/offsets" % name)
        spans.append((b, end))
        raw = body[b:end]
        vals = struct.unpack("<%d%s" % (numel, FORMATS[dt]), raw)
        if dt == "BF16":
            vals = [struct.unpack("<f", struct.pack("<I", v << 16))[0] for v in vals]
        s = sum(vals)
        text = ("%.17g" % s) if isinstance(s, float) else str(int(s))
        print("%s %s [%s] sum=%s" % (name, dt, ", ".join(str(d) for d in shape), text))
    pos = 0
    for b, end in sorted(spans):
        if b != pos:
            fail("offsets overlap or leave a gap at %d" % pos)
        pos = end
    if pos != len(body):
        fail("tensors cover %d of %d data bytes" % (pos, len(body)))
    for k in sorted(meta):
        print("metadata %s=%s" % (k, meta[k]))
    if "--xxh64" in sys.argv:
        print("xxh64 %016x" % xxh64(data))


if __name__ == "__main__":
    main()
