#!/usr/bin/env bash
# Cuts the bundled Fashion-MNIST sample (data/fashion-mnist-sample/) from the full set that
# Debian's `dataset-fashion-mnist` package installs: the first TRAIN train images + labels
# and the first TEST test images + labels, re-written as gzip IDX files with the standard
# names. The output is byte-for-byte reproducible (gzip mtime 0, no file name in the header).
#
#   tools/make-sample.sh [SRC_DIR] [OUT_DIR]
#   TRAIN=5000 TEST=1000 MAX_BYTES=3000000 tools/make-sample.sh
#
# SRC_DIR defaults to /usr/share/datasets/fashion-mnist (apt-get install dataset-fashion-mnist),
# OUT_DIR to data/fashion-mnist-sample. Fails if the four files together exceed MAX_BYTES.
# Prints the label counts of each split (class balance) at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

SRC=${1:-/usr/share/datasets/fashion-mnist}
OUT=${2:-data/fashion-mnist-sample}
TRAIN=${TRAIN:-5000}
TEST=${TEST:-1000}
MAX_BYTES=${MAX_BYTES:-3000000}

if [[ ! -d $SRC ]]; then
    echo "make-sample: $SRC is missing; install it with: apt-get install -y dataset-fashion-mnist" >&2
    exit 1
fi
command -v python3 >/dev/null || { echo "make-sample: python3 is needed" >&2; exit 1; }
mkdir -p "$OUT"

python3 - "$SRC" "$OUT" "$TRAIN" "$TEST" "$MAX_BYTES" <<'PY'
import gzip, io, os, struct, sys

src, out, n_train, n_test, max_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

def read(name):
    for cand in (name + ".gz", name):
        path = os.path.join(src, cand)
        if os.path.exists(path):
            with open(path, "rb") as f:
                raw = f.read()
            return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    sys.exit(f"make-sample: {name}[.gz] not found in {src}")

def cut(name, count):
    data = read(name)
    magic = struct.unpack(">I", data[:4])[0]
    ndim = magic & 0xFF
    if magic >> 8 != 0x08:
        sys.exit(f"make-sample: {name}: not a u8 IDX file (magic {magic:#010x})")
    dims = list(struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim]))
    if count > dims[0]:
        sys.exit(f"make-sample: {name} has only {dims[0]} items, {count} asked")
    item = 1
    for d in dims[1:]:
        item *= d
    header = 4 + 4 * ndim
    dims[0] = count
    body = struct.pack(">I", magic) + struct.pack(">" + "I" * ndim, *dims) + data[header:header + count * item]
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as g:
        g.write(body)
    path = os.path.join(out, name + ".gz")
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return path, body[header:]

total = 0
counts = {}
for split, count in (("train", n_train), ("t10k", n_test)):
    for kind in ("images-idx3", "labels-idx1"):
        path, payload = cut(f"{split}-{kind}-ubyte", count)
        size = os.path.getsize(path)
        total += size
        print(f"{path}: {count} items, {size} bytes")
        if kind.startswith("labels"):
            counts[split] = [payload.count(bytes([c])) for c in range(10)]

for split, c in counts.items():
    print(f"{split} label counts (class 0..9): {' '.join(map(str, c))}")
print(f"total: {total} bytes")
if total >= max_bytes:
    sys.exit(f"make-sample: total {total} bytes is over the {max_bytes}-byte limit; lower TRAIN (now {n_train})")
PY
