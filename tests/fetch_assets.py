"""Fetch the test assets that only a registry sdist ships: llama.cpp's vocab-only GGUFs and their
reference tokenizations (from `llama-cpp-python==0.3.36`), into `.assets/llama.cpp-models`.

Idempotent and offline-safe: when the files are there it does nothing; when the registry cannot be
reached it says so and exits 0, and the tests that need the files skip with that reason.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
TARGET = Path(__file__).resolve().parent.parent / ".assets" / "llama.cpp-models"
MEMBER_PREFIX = "vendor/llama.cpp/models/ggml-vocab-"


def main() -> int:
    if (TARGET / "ggml-vocab-gpt-2.gguf").exists():
        print(f"test assets present in {TARGET}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
             SDIST, "-d", tmp],
            capture_output=True, text=True,
        )
        archives = list(Path(tmp).glob("*.tar.gz"))
        if not archives:
            print(f"could not fetch {SDIST}; llama.cpp vocab tests will skip:\n{got.stderr[-2000:]}")
            return 0
        TARGET.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                _, _, inner = member.name.partition("/")
                if member.isfile() and inner.startswith(MEMBER_PREFIX):
                    data = tar.extractfile(member).read()
                    (TARGET / Path(inner).name).write_bytes(data)
    print(f"fetched llama.cpp vocab GGUFs into {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
