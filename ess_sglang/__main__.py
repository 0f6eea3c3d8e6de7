import sys

from ess_sglang.cli import main

sys.exit(main())
