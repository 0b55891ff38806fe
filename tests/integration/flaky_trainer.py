"""An entrypoint for crash-loop tests: exits 1 at once while the file named by its first argument
exists, else runs the example job with the remaining arguments.

    {python} tests/integration/flaky_trainer.py /tmp/broken --steps 20 ...
"""

import os
import sys

if __name__ == "__main__":
    marker, *rest = sys.argv[1:]
    if os.path.exists(marker):
        print(f"flaky_trainer: {marker} exists: crashing", file=sys.stderr)
        sys.exit(1)
    from trainer.examples.mlp import main

    sys.exit(main(rest))
