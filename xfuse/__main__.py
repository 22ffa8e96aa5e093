import sys

from xfuse.cli import main

sys.exit(main())
