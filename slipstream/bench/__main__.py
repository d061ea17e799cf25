import sys

from slipstream.bench.cli import main

sys.exit(main())
