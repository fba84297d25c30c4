import sys

from magis.cli import main

sys.exit(main())
