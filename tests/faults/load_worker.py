"""One writer or reader process of the load test (no torch: many of these run at once).

    python load_worker.py write STEP_DIR RANK FILES SIZE SEED   # writes __RANK_<i>.distcp
    python load_worker.py read STEP_DIR RANK                    # reads them back

Both print one JSON object: file name -> xxh3-128 of its bytes. The bytes of a file are a
function of (SEED, RANK, i), so the test knows what each file must hold."""

from __future__ import annotations

import json
import os
import random
import sys

import xxhash


def main() -> None:
    mode, step_dir, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    found = {}
    if mode == "write":
        files, size, seed = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
        os.makedirs(step_dir, exist_ok=True)
        for i in range(files):
            data = random.Random(seed * 1_000_003 + rank * 10_007 + i).randbytes(size)
            name = f"__{rank}_{i}.distcp"
            with open(os.path.join(step_dir, name), "wb") as f:
                for offset in range(0, size, 1 << 20):  # as a writer would: in pieces
                    f.write(data[offset:offset + (1 << 20)])
            found[name] = xxhash.xxh3_128_hexdigest(data)
    else:
        for name in sorted(os.listdir(step_dir)):
            if name.startswith(f"__{rank}_"):
                with open(os.path.join(step_dir, name), "rb") as f:
                    found[name] = xxhash.xxh3_128_hexdigest(f.read())
    print(json.dumps(found))


if __name__ == "__main__":
    main()
