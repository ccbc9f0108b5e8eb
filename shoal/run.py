"""`python -m shoal.run ...` is `shoal run ...` (as `python -m torch.distributed.run`)."""

import sys

from shoal.cli.run import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
