import sys

from cacheserver.cli import main

sys.exit(main())
