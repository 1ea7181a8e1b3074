"""`python -m tierfs.demo`: what `tierfs demo` (and `make demo`) runs."""

from tierfs.demo.run import run_demo

try:
    raise SystemExit(run_demo())
except KeyboardInterrupt:
    raise SystemExit(130) from None
