import sys

from tierkv.cacheserver.cli import main

sys.exit(main())
